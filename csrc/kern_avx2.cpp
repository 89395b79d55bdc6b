// The kernels compiled for the "avx2" instruction set (flags chosen in setup.py).
#define NA_NS na_avx2
#define NA_TABLE na_kernels_avx2
#define NA_ISA_NAME "avx2"
#define NA_W 8
#include "kernels_impl.h"
