// The kernels compiled for the "avx512bf16" instruction set (flags chosen in setup.py).
#define NA_NS na_avx512bf16
#define NA_TABLE na_kernels_avx512bf16
#define NA_ISA_NAME "avx512bf16"
#define NA_HAVE_BF16_PATH 1
#include "kernels_impl.h"
