"""Head-width layout rule shared by the light capabilities module and the kernels (torch-free).

``tl.arange`` only takes powers of two, and ``tl.dot`` wants every side >= 16. The q/k width
``D`` is therefore split into a *main* part, the largest power of two <= D, and a *rest* part,
D - main, padded with masked lanes to a power of two >= 16 (0 when D is a power of two). The
two parts give two dots that are summed. DeepSeek MLA 576 = 512 + 64 and small MLA 80 = 64 + 16
split exactly; MHA 96 = 64 + 32 too; 72 = 64 + 8 pads the rest to 16. The v width is padded
to a power of two >= 16 with masked lanes. Masked lanes are never loaded from memory, so
padding costs arithmetic only, never bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DIM = 16
MAX_DIM = 1024


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class DimLayout:
    """Compile-time widths of one head layout.

    Example: ``DimLayout.of(576, 512)`` -> main 512, rest 64 (exact), v 512.
    """

    head_dim: int
    v_head_dim: int
    main: int  # power of two
    rest: int  # padded rest width (power of two >= 16), 0 when head_dim is a power of two
    v_block: int  # padded v width

    @staticmethod
    def of(head_dim: int, v_head_dim: int) -> DimLayout:
        main = _pow2_floor(head_dim)
        left = head_dim - main
        rest = 0 if left == 0 else max(MIN_DIM, _pow2_ceil(left))
        return DimLayout(head_dim, v_head_dim, main, rest, max(MIN_DIM, _pow2_ceil(v_head_dim)))


def dim_reasons(head_dim: int, v_head_dim: int) -> list[str]:
    """Reasons the kernels cannot serve these widths (empty when they can)."""
    out: list[str] = []
    for name, value in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if value < MIN_DIM:
            out.append(
                f"{name} {value!r} is below {MIN_DIM}, the narrowest tile tl.dot accepts; "
                f"the triton kernels serve widths {MIN_DIM}..{MAX_DIM}"
            )
        elif value > MAX_DIM:
            out.append(
                f"{name} {value!r} is above {MAX_DIM}: one head row would not fit in a "
                f"tile; the triton kernels serve widths {MIN_DIM}..{MAX_DIM}"
            )
    return out
