"""Checks of the prefix chunks given to an ``AttnForm.MHA_CHUNKED`` handler.

Each chunk is ``(k_chunk [rows, heads, d], v_chunk [rows, heads, dv], indptr [B + 1])`` with
request ``i``'s rows at ``indptr[i]:indptr[i+1]`` (``attn_dispatch.mla.latent_prefix_chunks``).
A handler reads only rows the indptr names, so the indptr must stay inside the chunk's rows:
a chunk with too few rows, other heads or widths is refused with ``InvalidBatchError``
(field ``prefix``), never answered from fewer keys or a raw torch error.

>>> import torch
>>> k, v = torch.zeros(5, 2, 8), torch.zeros(5, 2, 4)
>>> check_prefix_chunk(k, v, [0, 3, 5], num_requests=2, heads=2, widths=(8, 4),
...                    dtype=torch.float32, device=torch.device("cpu"))
[0, 3, 5]
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from attn_dispatch.backend import InvalidBatchError

__all__ = ["check_prefix_chunk"]


def check_prefix_chunk(
    k_chunk: Any,
    v_chunk: Any,
    indptr: Any,
    *,
    num_requests: int,
    heads: int,
    widths: tuple[int, int],
    dtype: torch.dtype | None,
    device: torch.device,
) -> list[int]:
    """The chunk's indptr as ints, once ``k_chunk``/``v_chunk``/``indptr`` fit the layer;
    else ``InvalidBatchError`` naming what does not. ``dtype=None`` takes any floating
    dtype (a handler that converts the chunk itself)."""
    for name, x, width in (("k_chunk", k_chunk, widths[0]), ("v_chunk", v_chunk, widths[1])):
        if not isinstance(x, torch.Tensor):
            raise InvalidBatchError("prefix", f"{name} must be a torch.Tensor, got {type(x)!r}")
        if x.dim() != 3 or tuple(x.shape[1:]) != (heads, width):
            raise InvalidBatchError(
                "prefix", f"{name} shape {tuple(x.shape)} != [rows, {heads}, {width}]"
            )
        dtype_ok = x.dtype.is_floating_point if dtype is None else x.dtype == dtype
        if not dtype_ok or x.device != device:
            want = "a floating dtype" if dtype is None else str(dtype)
            raise InvalidBatchError(
                "prefix", f"{name} is {x.dtype} on {x.device}, want {want} on {device}"
            )
    rows = int(k_chunk.shape[0])
    if v_chunk.shape[0] != rows:
        raise InvalidBatchError(
            "prefix", f"k_chunk has {rows} rows, v_chunk {int(v_chunk.shape[0])}"
        )
    try:
        ind = [int(x) for x in indptr]
    except (TypeError, ValueError):
        raise InvalidBatchError(
            "prefix", f"chunk indptr must be a sequence of ints, got {indptr!r}"
        ) from None
    if len(ind) != num_requests + 1:
        raise InvalidBatchError(
            "prefix", f"chunk indptr has {len(ind)} entries, want {num_requests + 1}"
        )
    if ind and (ind[0] < 0 or ind[-1] > rows or any(a > b for a, b in itertools.pairwise(ind))):
        raise InvalidBatchError(
            "prefix",
            f"chunk indptr {ind!r} must be non-decreasing within the chunk's {rows} rows",
        )
    return ind
