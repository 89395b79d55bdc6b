"""Planning for the ``sdpa`` backend: a batch -> the fused calls of one forward (``Steps``).

Each call is one fused-attention call over a run of requests that share one shape (equal
query and key counts: a uniform batch, decode with equal lengths), made of one or two parts
over key ranges of those requests:

- causal prefill/extend: the cached prefix (every new token sees all of it, no mask) and the
  new tokens (a square, top-left-aligned ``is_causal`` block), merged by their LSE
  (``extend="split"``), or one call with a bottom-right causal mask (``extend="mask"``);
  ``extend="auto"`` masks while the mask has at most ``MASK_MAX_ELEMENTS`` entries and
  splits beyond (bench/sdpa_notes.md has the measurements);
- decode: one query over its visible keys, no mask;
- window / chunked attention: queries in blocks (cut at chunk boundaries) over the keys the
  block can see, with an additive band mask where rows' first keys differ;
- tree verify and any custom mask: one masked call per request (the chunk and window folded
  into the mask first, as every backend does);
- ``causal=False``: all keys, no mask.

``Steps`` is the backend's private record of a plan (``PrivatePlans``): the caller
holds only an immutable handle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

import torch

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import chunk_tree_mask
from attn_dispatch.backend import window_tree_mask
from attn_dispatch.backends.sdpa._fused import SOURCE_BUF
from attn_dispatch.backends.sdpa._fused import SOURCE_CACHE
from attn_dispatch.backends.sdpa._fused import Call
from attn_dispatch.backends.sdpa._fused import MaskCache
from attn_dispatch.backends.sdpa._fused import Part

__all__ = ["MASK_MAX_ELEMENTS", "WINDOW_BLOCK", "Extend", "Planner", "Steps"]

Extend = Literal["auto", "split", "mask"]
#: ``extend="auto"``: one masked call while its mask (queries x keys) has at most this many
#: entries, prefix and new tokens as two parts merged by LSE beyond (a mask that size costs
#: 8 MiB in bf16; bench/sdpa_notes.md has the measurements behind the choice).
MASK_MAX_ELEMENTS = 1 << 22
#: Query block of windowed layers (rows per masked call).
WINDOW_BLOCK = 256

_Unit = tuple[int, int, int, tuple[Part, ...]]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Steps:
    """What the handler reads for one forward: the checked snapshot, the pages to gather
    (int64 on the batch's device, request after request; on CPU also as runs ``(first page,
    count)`` of consecutive pages, else None), the calls, and how many requests are read in
    place. Private to the backend object: never handed out."""

    snap: BatchSnapshot
    num_tokens: int
    max_page: int | None
    pages: torch.Tensor
    runs: tuple[tuple[int, int], ...] | None
    calls: tuple[Call, ...]
    in_place: int
    gathered: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Planner:
    """The planning rules of one backend object (its config and options)."""

    config: AttnConfig
    extend: Extend
    window_block: int
    in_place: bool
    dtype: torch.dtype

    def steps(self, snap: BatchSnapshot) -> Steps:
        ps = self.config.page_size
        dev = snap.device
        qo = snap.qo_indptr_host.tolist()
        kv = snap.kv_indptr_host.tolist()
        lens = snap.kv_lens_host.tolist()
        host_idx = snap.kv_indices.tolist() if dev.type == "cpu" else None
        # Where each request's key 0 lives: (source, row).
        where: list[tuple[int, int]] = []
        gather: list[tuple[int, int]] = []  # (start in kv_indices, pages) per gathered request
        rows = 0
        in_place = 0
        for i in range(snap.num_requests):
            need = -(-lens[i] // ps)
            start = kv[i]
            pages = None if host_idx is None else host_idx[start : start + need]
            if (
                self.in_place
                and pages
                and all(pages[j] == pages[0] + j for j in range(1, len(pages)))
            ):
                where.append((SOURCE_CACHE, pages[0] * ps))
                in_place += 1
            else:
                where.append((SOURCE_BUF, rows))
                gather.append((start, need))
                rows += need * ps
        gathered = None
        if host_idx is not None:
            gathered = tuple(p for s, n in gather for p in host_idx[s : s + n])
        return Steps(
            snap=snap,
            num_tokens=snap.num_tokens,
            max_page=snap.max_page,
            pages=_page_list(snap.kv_indices, gather, dev),
            runs=None if host_idx is None else _runs(host_idx, gather),
            calls=_group(self._units(snap, qo, lens), where, lens),
            in_place=in_place,
            gathered=gathered,
        )

    def _units(self, snap: BatchSnapshot, qo: list[int], lens: list[int]) -> list[_Unit]:
        """``(request, q0, n, parts)`` for every block of queries, in q-row order."""
        c = self.config
        masks = MaskCache(self.dtype, snap.device)
        out: list[_Unit] = []
        mask_off = 0
        for i in range(snap.num_requests):
            q0, n, length = qo[i], qo[i + 1] - qo[i], lens[i]
            if snap.custom_mask is not None:
                flat = snap.custom_mask[mask_off : mask_off + n * length].view(n, length)
                mask_off += n * length
                if c.attention_chunk_size is not None:  # the chunk first, then the window
                    flat = chunk_tree_mask(flat, c.attention_chunk_size)
                if c.window_left is not None:
                    flat = window_tree_mask(flat, c.window_left)
                # A row its mask leaves no key (the batch's mask edited after it was built,
                # say) is an empty state, not the kernel's LSE 0. Kept as a tensor: testing
                # it here would read a CUDA mask back to the host.
                empty = ~flat.any(dim=1)
                part = Part(0, length, mask=masks.additive(flat), empty=empty.to(snap.device))
                out.append((i, q0, n, (part,)))
                continue
            if not c.causal:
                out.append((i, q0, n, (Part(0, length),)))
                continue
            first = length - n
            for a, b in self._blocks(first, length):
                out.append((i, q0 + a - first, b - a, self._causal_parts(a, b, masks)))
        return out

    def lo(self, p: int) -> int:
        """The first key position a (causal) query at position ``p`` sees."""
        c = self.config
        lo = 0
        if c.window_left is not None:
            lo = max(lo, p - c.window_left)
        if c.attention_chunk_size is not None:
            lo = max(lo, p - p % c.attention_chunk_size)
        return lo

    def _blocks(self, first: int, end: int) -> Iterable[tuple[int, int]]:
        """Query position blocks ``[a, b)``: cut at chunk boundaries, and every
        ``window_block`` rows when a window bands the mask."""
        c = self.config
        chunk = c.attention_chunk_size
        step = self.window_block if c.window_left is not None else None
        a = first
        while a < end:
            b = end
            if chunk is not None:
                b = min(b, (a // chunk + 1) * chunk)
            if step is not None:
                b = min(b, a + step)
            yield a, b
            a = b

    def _causal_parts(self, a: int, b: int, masks: MaskCache) -> tuple[Part, ...]:
        lo_a, lo_b = self.lo(a), self.lo(b - 1)
        n = b - a
        if n == 1:  # one query sees every key of its range
            return (Part(lo_a, b),)
        if lo_a == lo_b:  # every row starts at the same key: prefix + causal square
            if a == lo_a:
                return (Part(a, b, causal=True),)
            small = n * (b - lo_a) <= MASK_MAX_ELEMENTS
            if self.extend == "mask" or (self.extend == "auto" and small):
                rel = torch.arange(n)[:, None] + (a - lo_a) >= torch.arange(b - lo_a)[None, :]
                return (Part(lo_a, b, mask=masks.additive(rel, ("causal", n, b - lo_a))),)
            return (Part(lo_a, a), Part(a, b, causal=True))
        pos = torch.arange(a, b)[:, None]
        keys = torch.arange(lo_a, b)[None, :]
        los = [self.lo(p) - lo_a for p in range(a, b)]
        lo = torch.tensor(los)[:, None] + lo_a
        key = ("band", b - lo_a, *los)
        return (Part(lo_a, b, mask=masks.additive((keys <= pos) & (keys >= lo), key)),)

    def new_part(self, first: int, end: int, masks: MaskCache) -> Part:
        """The new tokens (positions ``first:end``) against themselves: a causal square, or a
        mask when a window or chunk cuts it."""
        n = end - first
        if not self.config.causal:
            return Part(0, n)
        los = [self.lo(p) for p in range(first, end)]
        if all(lo <= first for lo in los):
            return Part(0, n, causal=True)
        pos = torch.arange(first, end)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= torch.tensor(los)[:, None])
        return Part(0, n, mask=masks.additive(allowed))


def _page_list(
    indices: torch.Tensor, gather: list[tuple[int, int]], dev: torch.device
) -> torch.Tensor:
    """int64 page indices of the gathered requests (the first ``pages`` of each table),
    taken from the snapshot's own copy on its device (no device-to-host read)."""
    if not gather:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    pos = torch.cat([torch.arange(s, s + n) for s, n in gather])
    return indices.index_select(0, pos.to(dev)).long()


def _runs(host_idx: list[int], gather: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The gathered pages as runs ``(first page, count)`` of consecutive page indices."""
    runs: list[list[int]] = []
    for start, need in gather:
        for p in host_idx[start : start + need]:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
    return tuple((p, c) for p, c in runs)


def _group(units: list[_Unit], where: list[tuple[int, int]], lens: list[int]) -> tuple[Call, ...]:
    """Fold adjacent units of one shape whose keys sit at a constant stride into one call."""
    calls: list[Call] = []
    for req, q0, n, parts in units:
        src, base = where[req]
        last = calls[-1] if calls else None
        if (
            last is not None
            and last.n == n
            and last.source == src
            and last.q0 + last.count * last.n == q0
            and _same_parts(last.parts, parts)
        ):
            stride = base - last.base if last.count == 1 else last.stride
            if stride > 0 and base == last.base + last.count * stride:
                calls[-1] = dataclasses.replace(last, count=last.count + 1, stride=stride)
                continue
        calls.append(Call(1, q0, n, src, base, max(lens[req], 1), parts))
    return tuple(calls)


def _same_parts(a: tuple[Part, ...], b: tuple[Part, ...]) -> bool:
    return len(a) == len(b) and all(
        x.k0 == y.k0
        and x.k1 == y.k1
        and x.causal == y.causal
        and x.mask is y.mask
        and x.empty is None
        and y.empty is None
        for x, y in zip(a, b, strict=True)
    )
