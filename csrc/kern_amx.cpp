// The kernels compiled for the "amx" instruction set (flags chosen in setup.py): the
// avx512bf16 unit's kernels, with the many-row path's q.K^T and p.V on AMX tiles
// (amx_path.h). Built only when the compiler takes -mamx-tile -mamx-bf16; run only where
// isa.cpp finds the tiles usable (CPUID, XCR0, and Linux's permission for the tile data).
#define NA_NS na_amx_unit
#define NA_TABLE na_kernels_amx
#define NA_ISA_NAME "amx"
#define NA_HAVE_BF16_PATH 1
#define NA_HAVE_AMX 1
#include "kernels_impl.h"
