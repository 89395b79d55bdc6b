"""FlashInfer's view of a batch: page tables with exactly ceil(kv_len / page_size) pages per
request, and the two levels of a cascade plan. Host metadata; device gathers without a sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_dispatch.backend import BatchSnapshot

__all__ = ["Levels", "PageTable", "cascade_levels", "page_table"]


@dataclass(frozen=True, slots=True)
class Levels:
    """The two levels of a cascade plan, in FlashInfer's form (host indptrs, device indices)."""

    qo_indptr: tuple[torch.Tensor, torch.Tensor]
    kv_indptr: tuple[torch.Tensor, torch.Tensor]
    kv_indices: tuple[torch.Tensor, torch.Tensor]
    last_page_len: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class PageTable:
    """FlashInfer's view of our page table: exactly ceil(kv_len / page_size) pages per
    request (FlashInfer derives kv_len from the page count and the last page's fill).
    ``levels``: the cascade levels when the plan cascades."""

    qo_indptr: torch.Tensor  # host int32 [B+1]
    kv_indptr: torch.Tensor  # host int32 [B+1]
    kv_indices: torch.Tensor  # device int32
    kv_lens: torch.Tensor  # host int32 [B]
    last_page_len: torch.Tensor  # host int32 [B]
    levels: Levels | None = None


def _gather(indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``indices[positions]`` with host ``positions`` (int64), copied to the device without
    waiting for its queue (pinned memory)."""
    if indices.is_cuda:
        positions = positions.pin_memory().to(indices.device, non_blocking=True)
    return indices.index_select(0, positions).contiguous()


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The concatenated ranges ``starts[i] .. starts[i] + counts[i]`` (int64, host)."""
    starts, counts = starts.to(torch.int64), counts.to(torch.int64)
    total = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        ends - counts, counts
    )
    return torch.repeat_interleave(starts, counts) + offsets


def page_table(snap: BatchSnapshot, page_size: int, num_pages: int | None) -> PageTable:
    """Build FlashInfer's page metadata on the host from the snapshot's host copies; never
    copies device to host. When a request holds more pages than its length needs (spare
    pages reserved ahead), the index list is compacted with one gather on the device.

    FlashInfer's kernels do not bound page indices: unless the snapshot checked them on the
    host, they are clamped on the device into ``[0, num_pages)`` (``[0, inf)`` when the pool
    size is unknown), so a bad index reads a wrong page of the cache, never outside it."""
    kv_lens = snap.kv_lens_host
    kv_indptr = snap.kv_indptr_host
    need = torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")
    have = kv_indptr[1:] - kv_indptr[:-1]
    indices = snap.kv_indices
    if snap.max_page is None:
        indices = indices.clamp(0, None if num_pages is None else num_pages - 1)
    if torch.equal(have, need):
        compact_indptr = kv_indptr
    else:
        compact_indptr = _indptr(need)
        indices = _gather(indices, _ranges(kv_indptr[:-1], need))
    last = torch.where(need > 0, kv_lens - (need - 1) * page_size, torch.zeros_like(kv_lens))
    return PageTable(
        qo_indptr=snap.qo_indptr_host,
        kv_indptr=compact_indptr.contiguous(),
        kv_indices=indices.contiguous(),
        kv_lens=kv_lens,
        last_page_len=last.to(torch.int32).contiguous(),
    )


def cascade_levels(table: PageTable, groups: list[tuple[int, int, int]], page_size: int) -> Levels:
    """The two cascade levels of ``table``: level 0 holds, per group, its shared pages (a
    request in no group brings its own first page, so no level is empty for any request);
    level 1 holds each request's pages after its group's shared ones."""
    shared = torch.tensor([max(p, 1) for _, _, p in groups], dtype=torch.int32)
    firsts = torch.tensor([first for first, _, _ in groups], dtype=torch.int64)
    sizes = torch.tensor([stop - first for first, stop, _ in groups], dtype=torch.int64)
    per_request = torch.repeat_interleave(shared, sizes)
    qo = table.qo_indptr
    kv = table.kv_indptr
    own = (kv[1:] - kv[:-1]) - per_request
    qo0 = torch.cat((qo[firsts], qo[-1:])).to(torch.int32)
    return Levels(
        qo_indptr=(qo0.contiguous(), qo),
        kv_indptr=(_indptr(shared), _indptr(own)),
        kv_indices=(
            _gather(table.kv_indices, _ranges(kv[firsts], shared)),
            _gather(table.kv_indices, _ranges(kv[:-1] + per_request, own)),
        ),
        last_page_len=(
            torch.full((len(groups),), page_size, dtype=torch.int32),
            table.last_page_len,
        ),
    )
