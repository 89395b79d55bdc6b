// The kernels compiled for the "generic" instruction set (flags chosen in setup.py).
#define NA_NS na_generic
#define NA_TABLE na_kernels_generic
#define NA_ISA_NAME "generic"
#define NA_W 4
#include "kernels_impl.h"
