"""The output buffers of the paged path (``OutBuffers``): what ``attention(..., out=buf)``
writes into, so that a layer neither allocates its output nor copies it.

Why a buffer is reused only when nothing else holds it: the tensor a layer returns goes back
to transformers, which normally drops it as soon as ``o_proj`` has read it (``attn_output =
self.o_proj(attn_output)``), before the next layer's attention runs; but autograd (a forward
with grad enabled saves ``o_proj``'s input), a forward hook or a model that keeps its
attention output would still read it while the next layer writes. So one buffer is kept per
shape, dtype and device, and each call checks that no tensor other than the pool's own still
shares its storage (the storage's use count, read without device work); a buffer still in use
is left to its holders and a fresh one replaces it. In the usual eager inference every layer
of every decode step then writes into the same buffer, and whatever keeps a layer's output
gets one of its own, never overwritten. One buffer per key rather than one per layer: the
decode output is reused across layers and steps without holding ``num_layers`` of them, and
a prefill's large buffer is dropped when the next forward's shapes differ (``keep``).
"""

from __future__ import annotations

from typing import Any

import torch

# The storage's reference count (tensors and storage objects sharing it); a private torch
# function, so without it every call gets a fresh buffer (correct, only not reused).
_USE_COUNT: Any = getattr(torch._C, "_storage_Use_Count", None)


def _uses(t: torch.Tensor) -> int:
    return int(_USE_COUNT(t.untyped_storage()._cdata))


class OutBuffers:
    """One reusable ``[rows, heads, dim]`` buffer per shape, dtype and device (one cache's)."""

    __slots__ = ("_held",)

    # key -> (the buffer, its storage's use count when only the pool holds it)
    _held: dict[tuple[int, int, int, torch.dtype, torch.device], tuple[torch.Tensor, int]]

    def __init__(self) -> None:
        self._held = {}

    def take(self, rows: int, heads: int, dim: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, heads, dim]`` tensor in ``like``'s dtype and device that no
        other tensor shares: the pool's buffer when it is free, else a new one (kept)."""
        key = (rows, heads, dim, like.dtype, like.device)
        held = self._held.get(key)
        if held is not None and _uses(held[0]) <= held[1]:
            return held[0]
        buf = torch.empty(rows, heads, dim, dtype=like.dtype, device=like.device)
        if _USE_COUNT is not None:
            self._held[key] = (buf, _uses(buf))
        return buf

    def keep(self, rows: tuple[int, ...]) -> None:
        """Drop the buffers whose row count is none of ``rows`` (a new forward's shapes): a
        prefill's buffers do not outlive it into the decode steps."""
        if any(key[0] not in rows for key in self._held):
            self._held = {k: v for k, v in self._held.items() if k[0] in rows}

    def clear(self) -> None:
        self._held = {}

    def __len__(self) -> int:
        return len(self._held)
