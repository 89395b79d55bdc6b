"""The page gather of the ``sdpa`` backend: the pages a layer call reads, in the compute dtype.

Per layer call the pages each request reads are gathered, whole pages at a time, into a
buffer reused by the calling thread: on CPU head-major ``[heads, rows, e]`` (the CPU flash
kernel runs 1.3-2x slower on the cache's own ``[rows, heads, e]`` layout than on head-major
K/V, more than the gather costs), one copy per run of consecutive pages when the runs are
few, else one ``index_select`` and one transposing copy; an FP8 cache is converted and
scaled there. On CUDA ``[rows, heads, e]``.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from attn_dispatch.backends.sdpa._fused import Source

__all__ = ["RUN_COPY_MAX_RUNS", "RUN_COPY_MIN_BYTES", "Buffers", "Gather"]

#: CPU gather: one copy per run of consecutive pages while there are at most
#: ``RUN_COPY_MAX_RUNS`` runs averaging at least ``RUN_COPY_MIN_BYTES``; otherwise one
#: ``index_select`` into a row-major scratch buffer and one transposing copy (two passes,
#: two parallel regions). Each copy is a parallel region of its own: on a machine shared
#: with other work, every region can wait a time slice for its second thread (64 per-page
#: copies made a 2-thread layer call 1.4-5x slower there), and a copy's own cost is a few
#: microseconds; on an idle machine the per-run copies are ~1.5x faster than two passes.
RUN_COPY_MIN_BYTES = 16 << 10
RUN_COPY_MAX_RUNS = 8


class Buffers(threading.local):
    """Gather buffers of one backend object, one set per thread (threads that share a plan
    never share a buffer), reused across layers and grown when a batch needs more."""

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        buf = self.store.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype)
            self.store[name] = buf
        return buf[:numel]


@dataclasses.dataclass(frozen=True, slots=True)
class Gather:
    """The gather rules of one backend object: page size, cache heads, head size ``e`` of
    the fused calls and the dtype they compute in."""

    page_size: int
    heads: int
    e: int
    dtype: torch.dtype
    device_type: str

    def pages(
        self, buffers: Buffers, name: str, cache: torch.Tensor, pages: torch.Tensor,
        runs: tuple[tuple[int, int], ...] | None, width: int, scale: float, direct: bool,
    ) -> Source:  # fmt: skip
        """The pages of ``pages`` (checked against ``cache`` by the caller) in the compute
        dtype, converted, scaled and padded to ``e`` columns when the cache is FP8, another
        dtype or narrower."""
        ps, h, e = self.page_size, self.heads, self.e
        n = pages.numel()
        rows = n * ps
        if n == 0:  # every request is read in place
            return torch.empty(0, dtype=self.dtype, device=cache.device), h, 0, 0
        if self.device_type == "cpu":
            assert runs is not None
            buf = buffers.get(name, rows * h * e, self.dtype, zero=width < e)
            # Padding columns sit at the same offsets (mod e) whatever the row count, so the
            # zeros written when the buffer was made stay zero: gathers write columns < width.
            out = buf.view(h, n, ps, e)
            target = out[..., :width] if width < e else out
            paged = cache.view(cache.shape[0], ps, h, width)
            nbytes = n * ps * h * width * cache.element_size()
            if len(runs) <= RUN_COPY_MAX_RUNS and len(runs) * RUN_COPY_MIN_BYTES <= nbytes:
                # One copy per run, transposing (and converting) as it goes. The page
                # indices were checked against this cache at the call (``TensorChecks``).
                src = paged.permute(2, 0, 1, 3)
                j = 0
                for p, count in runs:
                    target[:, j : j + count].copy_(src[:, p : p + count])
                    j += count
            else:
                scratch = buffers.get(
                    name + "_rows", rows * h * width, cache.dtype, zero=False
                ).view(n, ps, h, width)
                torch.index_select(paged, 0, pages, out=scratch)
                target.copy_(scratch.permute(2, 0, 1, 3))
            if scale != 1.0:
                target.mul_(scale)
            return buf, h, rows * e, e
        if direct:
            picked = cache.view(cache.shape[0], -1).index_select(0, pages)
            return picked, h, e, h * e
        picked = cache.index_select(0, pages).view(rows, h, width)
        wide = torch.zeros(rows, h, e, dtype=self.dtype, device=cache.device)
        target = wide[..., :width] if width < e else wide
        target.copy_(picked)
        if scale != 1.0:
            target.mul_(scale)
        return wide, h, e, h * e
