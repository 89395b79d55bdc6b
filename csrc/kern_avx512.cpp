// The kernels compiled for the "avx512" instruction set (flags chosen in setup.py).
#define NA_NS na_avx512
#define NA_TABLE na_kernels_avx512
#define NA_ISA_NAME "avx512"
#include "kernels_impl.h"
