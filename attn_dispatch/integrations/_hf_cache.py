"""The paged KV cache ``use()`` installs as a transformers model's cache (``PagedCache``).

transformers calls ``cache.update(k, v, layer_idx)`` in every attention layer and hands what it
returns to the attention function. ``PagedCache`` writes the new tokens straight into
attn_dispatch pages and returns the layer's page pools, so attention reads the pages in place:
a decode step writes one token per request and layer and copies no past K/V.

Layout, per attention group (``"full"``, ``"sliding"``): one pool of pages of ``page_size``
tokens per layer (``[pages, page_size, Hkv, D]``, the contract's NHD layout) and one page table
per request, shared by the group's layers. Only a request's real tokens (its 2-D
``attention_mask``'s ones) are stored, in order, so padding is never attended. After each
forward a sliding group frees the pages wholly before its window (``sliding_window - 1``
tokens before the next query) and shrinks its pools when they are mostly free, except while
transformers records the past (assisted generation rolls candidates back with ``crop``);
``crop`` trims back to the window, as ``DynamicSlidingWindowLayer`` does. A chunked group
(Llama 4, ``attention_chunk_size`` C) frees the same way the pages before the next query's
chunk, in whole multiples of ``lcm(page_size, C)`` tokens: a request's positions then shift by
whole chunks, so the contract's chunk boundaries (counted from the first key left) stay put.

FP8 (``kv_dtype``): each layer stores ``x / scale`` in FP8 once; the scales (one for K, one for
V, per layer) are ``amax / FP8_MAX`` of the prefill's tensors and stay fixed, so later tokens
whose magnitude exceeds the prefill's saturate at ``FP8_MAX * scale``.

Per forward, ``begin`` (called by ``use()``'s forward wrapper with the 2-D mask) allocates the
new tokens' slots and builds the ``AttnBatch`` of each group; the layers' ``update`` calls
write into those slots; ``commit`` makes the new lengths current. A forward that fails leaves
the cache as it was (its slots lie past the committed lengths).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.cache_utils import CacheLayerMixin

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._phase import Phase

# Largest finite value of each FP8 format: the per-layer scale maps the prefill's amax onto it.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
DEFAULT_PAGE_SIZE = 16


class UnsupportedModelError(AttnDispatchError, ValueError):
    """A model (or a mask, cache or option it asks for) that this integration cannot serve
    faithfully."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedBatches:
    """One forward's batches, one per attention group (the sliding group's page tables hold
    only the window's pages). ``attn_scope`` plans each group with its own batch."""

    phase: Phase
    group_batches: Mapping[str, AttnBatch]


@dataclasses.dataclass(slots=True, eq=False)
class _Step:
    """One forward's plan of writes and reads (made by ``begin``, kept by ``commit``)."""

    phase: Phase
    batch_size: int
    q_len: int
    q_rows: torch.Tensor  # int64 rows of the flat [B * q] new tokens that are real
    all_real: bool  # every new token is real: q_rows is arange(B * q)
    dst: dict[str, torch.Tensor]  # per group: flat slot (page * page_size + slot) per real token
    batches: dict[str, AttnBatch]
    tables: dict[str, list[list[int]]]
    skips: dict[str, list[int]]
    free: dict[str, list[int]]
    fresh: dict[str, int]
    lens: list[int]
    new_real: torch.Tensor  # bool [B, q]


@dataclasses.dataclass(slots=True, eq=False)
class _Group:
    """Page tables of one attention group; its layers' pools share the page numbering."""

    name: str
    window: int | None  # transformers' sliding_window W (keys seen, the query's included)
    page_size: int
    chunk: int | None = None  # attention_chunk_size C of a chunked group
    # Per request, set by each forward's commit: its page table and the pages dropped before
    # tables[b][0] (sliding, chunked).
    tables: list[list[int]] = dataclasses.field(default_factory=list)
    skips: list[int] = dataclasses.field(default_factory=list)
    free: list[int] = dataclasses.field(default_factory=list)
    fresh: int = 0  # pages 0..fresh-1 have been handed out at least once
    capacity: int = 0  # pages in each layer's pools
    layers: list[PagedLayer] = dataclasses.field(default_factory=list)

    def needed_from(self, length: int) -> int:
        """The first token (of a request holding ``length``) that a next query may see."""
        if self.window is not None:
            return max(0, length - (self.window - 1))
        if self.chunk is not None:
            return length // self.chunk * self.chunk
        return 0

    def droppable(self, length: int) -> int:
        """Whole pages before ``needed_from(length)`` that may be freed: any for a window, for
        chunks only whole multiples of ``lcm(page_size, chunk)`` tokens (positions then move by
        whole chunks)."""
        first = self.needed_from(length)
        if self.chunk is not None:
            unit = math.lcm(self.page_size, self.chunk)
            return first // unit * unit // self.page_size
        return first // self.page_size

    def grow(self, pages: int) -> None:
        if pages <= self.capacity:
            return
        self.capacity = pages
        for layer in self.layers:
            layer.resize(pages)


class PagedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's K and V page pools (``[pages, page_size, Hkv, D]``)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedCache, layer_idx: int, group: _Group) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.layer_idx = layer_idx
        self.group = group
        self.is_sliding = group.window is not None
        self.k_scale: float | None = None
        self.v_scale: float | None = None
        group.layers.append(self)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv_dtype = self.cache.kv_dtype
        dtype = getattr(torch, kv_dtype) if kv_dtype is not None else key_states.dtype
        ps, cap = self.group.page_size, self.group.capacity
        hk, dk = key_states.shape[1], key_states.shape[-1]
        hv, dv = value_states.shape[1], value_states.shape[-1]
        self.device = key_states.device
        self.keys = torch.empty(cap, ps, hk, dk, dtype=dtype, device=self.device)
        self.values = torch.empty(cap, ps, hv, dv, dtype=dtype, device=self.device)
        if kv_dtype is not None:
            limit = FP8_MAX[kv_dtype]
            self.k_scale = _scale(key_states, limit)
            self.v_scale = _scale(value_states, limit)
        self.is_initialized = True

    def resize(self, pages: int) -> None:
        if not self.is_initialized:
            return
        assert self.keys is not None and self.values is not None
        old = self.keys.shape[0]
        keys = self.keys.new_empty(pages, *self.keys.shape[1:])
        values = self.values.new_empty(pages, *self.values.shape[1:])
        keys[:old] = self.keys
        values[:old] = self.values
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.cache._step
        if step is None:
            raise NoActiveScopeError(
                f"PagedCache.update (layer {self.layer_idx}) outside a forward of the model it "
                "was made for: pass it to that model's forward or generate (wrapped by use())"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        b, q = step.batch_size, step.q_len
        if tuple(key_states.shape[::2]) != (b, q) or tuple(value_states.shape[::2]) != (b, q):
            raise UnsupportedModelError(
                f"layer {self.layer_idx} wrote K/V of shape {tuple(key_states.shape)} but the "
                f"forward has batch {b} and {q} new tokens; the paged cache expects "
                "[batch, kv_heads, new tokens, head_dim] as transformers' attention layers write"
            )
        dst = step.dst[self.group.name]
        _write(self.keys, key_states, dst, step, self.k_scale, self.cache.kv_dtype)
        _write(self.values, value_states, dst, step, self.v_scale, self.cache.kv_dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask function ignores the sizes' content (attention applies causality, the
        # window and padding from the page tables); they describe the dense sequence.
        return self.cache.dense_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.dense_len

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        # The cache crops every layer at once (page tables are per group): Cache.crop.
        raise UnsupportedModelError("crop a PagedCache as a whole: cache.crop(n)")

    def reset(self) -> None:
        self.k_scale = self.v_scale = None
        self.keys = self.values = None
        self.is_initialized = False

    def offload(self) -> None:
        raise UnsupportedModelError("a PagedCache is not offloaded")

    def prefetch(self) -> None:
        raise UnsupportedModelError("a PagedCache is not offloaded")


def _scale(x: torch.Tensor, limit: float) -> float:
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    return amax / limit if amax > 0.0 and amax == amax and amax != float("inf") else 1.0


def _write(
    pool: torch.Tensor,
    x: torch.Tensor,
    dst: torch.Tensor,
    step: _Step,
    scale: float | None,
    kv_dtype: str | None,
) -> None:
    b, h, q, d = x.shape
    # [B, H, q, D] -> [B * q, H, D]: a view when q == 1 (the projections write [B, q, H, D]).
    src = x.transpose(1, 2).reshape(b * q, h, d)
    if not step.all_real:
        src = src.index_select(0, step.q_rows)
    if kv_dtype is not None:
        limit = FP8_MAX[kv_dtype]
        assert scale is not None
        src = (src.float() / scale).clamp_(-limit, limit).to(pool.dtype)
        pool.view(torch.uint8).view(-1, h, d).index_copy_(0, dst, src.view(torch.uint8))
        return
    pool.view(-1, h, d).index_copy_(0, dst, src.to(pool.dtype))


class PagedCache(Cache):
    """A transformers ``Cache`` whose layers keep K/V in attn_dispatch pages.

    Made by ``use()`` (for ``generate`` and for forwards that ask for a cache); pass it back as
    ``cache=``/``past_key_values=`` to continue a sequence:

    >>> out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    >>> isinstance(out.past_key_values, PagedCache)
    True

    It serves only the model it was made for (``owner``) and only inside that model's wrapped
    forward; ``crop``, ``reorder_cache`` and the batch selections of ``generate`` work on whole
    page tables.
    """

    def __init__(
        self,
        owner: Any,
        groups: list[str],
        window: int | None,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        kv_dtype: str | None = None,
        max_length: int | None = None,
        chunk: int | None = None,
    ) -> None:
        self.owner = owner
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.max_length = max_length
        self.dense_len = 0
        self.record_past = False
        self._step: _Step | None = None
        self._group_names = groups
        self._window = window
        self._batch_size = 0
        self.groups: dict[str, _Group] = {}
        self.lens: list[int] = []
        self.history = torch.zeros(0, 0, dtype=torch.bool)  # real dense columns, per row
        layers: list[PagedLayer] = []
        for i, name in enumerate(groups):
            group = self.groups.get(name)
            if group is None:
                w = window if name == "sliding" else None
                c = chunk if name == "chunked" else None
                group = self.groups[name] = _Group(name, w, page_size, c)
            layers.append(PagedLayer(self, i, group))
        self.paged_layers = layers  # the same objects as .layers, typed
        super().__init__(layers=list(layers))

    # -- what transformers asks ---------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.dense_len

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.dense_len + query_length, 0

    @property
    def batch_size(self) -> int:
        return self._batch_size if self.dense_len else -1

    def activate_past_recording(self) -> None:
        self.record_past = True

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.record_past

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` dense positions (a positive value keeps that
        many, as transformers' legacy form); sliding (chunked) groups trim back to their
        window (chunk)."""
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - self.dense_len)
        n = -tokens_to_remove
        if n > self.dense_len:
            raise UnsupportedModelError(
                f"crop({tokens_to_remove}) removes more than the {self.dense_len} cached positions"
            )
        lens = self.lens
        if n:
            gone = self.history[:, self.dense_len - n : self.dense_len].sum(dim=1).tolist()
            lens = [length - int(g) for length, g in zip(self.lens, gone, strict=True)]
        # Checked before anything changes: a refused crop leaves the cache as it was.
        for group in self.groups.values():
            for b in range(self._batch_size):
                if group.needed_from(lens[b]) < group.skips[b] * self.page_size:
                    raise UnsupportedModelError(
                        f"crop({tokens_to_remove}) goes back before the pages the {group.name} "
                        "layers kept; call activate_past_recording() before the forwards to "
                        "roll back"
                    )
        self.lens = lens
        self.dense_len -= n
        for group in self.groups.values():
            for b in range(self._batch_size):
                keep = -(-self.lens[b] // self.page_size) - group.skips[b]
                group.free.extend(group.tables[b][keep:])
                del group.tables[b][keep:]
            self._trim(group, group.tables, group.skips, group.free, self.lens)
            self._compact(group)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._clear(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([b for b in range(self._batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def __repr__(self) -> str:
        return (
            f"PagedCache(groups={sorted(self.groups)}, page_size={self.page_size}, "
            f"batch={self._batch_size}, positions={self.dense_len})"
        )

    # -- per forward --------------------------------------------------------------------------

    def begin(self, real: torch.Tensor, q_len: int, device: Any) -> _Step:
        """Plan one forward: ``real`` is the bool ``[B, cached + new]`` mask (CPU)."""
        b = int(real.shape[0])
        if self.dense_len == 0 and not any(self.lens):
            self._clear(b)
        elif b != self._batch_size:
            raise UnsupportedModelError(
                f"the forward has batch {b} but the cache holds {self._batch_size} sequences"
            )
        if not torch.equal(real[:, : self.dense_len], self.history[:, : self.dense_len]):
            raise UnsupportedModelError(
                "attention_mask changed for cached positions (a paged cache stores each row's "
                "real tokens when they are written, so a later mask cannot hide or reveal them); "
                "pass the same mask for the cached positions, extended for the new tokens"
            )
        new_real = real[:, self.dense_len :]
        counts = new_real.sum(dim=1).tolist()
        lens = [length + int(n) for length, n in zip(self.lens, counts, strict=True)]
        flat = new_real.reshape(-1)
        all_real = bool(flat.all())
        q_rows = torch.nonzero(flat).flatten()
        rows = [i for i in range(b) if counts[i]]
        phase = (
            Phase.PREFILL if self.dense_len == 0 else Phase.DECODE if q_len == 1 else Phase.VERIFY
        )
        ps = self.page_size
        dst: dict[str, torch.Tensor] = {}
        batches: dict[str, AttnBatch] = {}
        tables_of: dict[str, list[list[int]]] = {}
        skips_of: dict[str, list[int]] = {}
        free_of: dict[str, list[int]] = {}
        fresh_of: dict[str, int] = {}
        for name, group in self.groups.items():
            tables = [list(t) for t in group.tables]
            skips = list(group.skips)
            free = list(group.free)
            if not self.record_past:
                self._trim(group, tables, skips, free, self.lens)
            fresh = group.fresh
            slots: list[torch.Tensor] = []
            for i in rows:
                table = tables[i]
                need = -(-lens[i] // ps) - skips[i]
                while len(table) < need:
                    if free:
                        table.append(free.pop())
                    else:
                        table.append(fresh)
                        fresh += 1
                first = self.lens[i] - skips[i] * ps
                pos = torch.arange(first, first + counts[i])
                pages = torch.tensor(table, dtype=torch.long)
                slots.append(pages[pos // ps] * ps + pos % ps)
            if fresh > group.capacity:
                group.grow(max(fresh, group.capacity * 2, self._initial_pages(name, b)))
            dst[name] = (torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)).to(device)
            if rows:
                batches[name] = AttnBatch.build(
                    phase,
                    q_lens=[counts[i] for i in rows],
                    kv_lens=[lens[i] - skips[i] * ps for i in rows],
                    page_tables=[tables[i] for i in rows],
                    page_size=ps,
                    num_pages=group.capacity,
                    device=device,
                )
            tables_of[name], skips_of[name], free_of[name], fresh_of[name] = (
                tables,
                skips,
                free,
                fresh,
            )
        step = _Step(
            phase,
            b,
            q_len,
            q_rows.to(device),
            all_real,
            dst,
            batches,
            tables_of,
            skips_of,
            free_of,
            fresh_of,
            lens,
            new_real,
        )
        self._step = step
        return step

    def commit(self, step: _Step) -> None:
        for name, group in self.groups.items():
            group.tables, group.skips = step.tables[name], step.skips[name]
            group.free, group.fresh = step.free[name], step.fresh[name]
        self.lens = step.lens
        width = self.dense_len + step.q_len
        if self.history.shape[1] < width:
            grown = torch.zeros(
                step.batch_size, max(width, 2 * self.history.shape[1]), dtype=torch.bool
            )
            grown[:, : self.dense_len] = self.history[:, : self.dense_len]
            self.history = grown
        self.history[:, self.dense_len : width] = step.new_real
        self.dense_len = width
        self._step = None
        if not self.record_past:
            for group in self.groups.values():
                self._trim(group, group.tables, group.skips, group.free, self.lens)
                self._compact(group)

    def abort(self) -> None:
        self._step = None

    def fill(
        self, real: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], device: Any
    ) -> None:
        """Write a whole dense cache (``[B, Hkv, S, D]`` per layer, ``real`` its bool
        ``[B, S]`` mask) into pages, as one forward would."""
        step = self.begin(real, int(real.shape[1]), device)
        try:
            for layer, (k, v) in zip(self.paged_layers, kv, strict=True):
                layer.update(k, v)
        except BaseException:
            self.abort()
            raise
        self.commit(step)

    # -- helpers ------------------------------------------------------------------------------

    def _initial_pages(self, name: str, batch: int) -> int:
        ps = self.page_size
        group = self.groups[name]
        if self.max_length is None:
            return 0
        per_row = -(-self.max_length // ps)
        if group.window is not None:
            per_row = min(per_row, -(-(group.window + ps) // ps) + 1)
        if group.chunk is not None:  # live: under lcm(ps, C) dropped-short plus the chunk
            unit = math.lcm(ps, group.chunk)
            per_row = min(per_row, -(-(unit + group.chunk) // ps) + 1)
        return batch * per_row + batch

    def _trim(
        self,
        group: _Group,
        tables: list[list[int]],
        skips: list[int],
        free: list[int],
        lens: list[int],
    ) -> None:
        """Free a sliding group's pages wholly before its window (the next query, at each
        row's current length, sees ``window - 1`` earlier keys), a chunked group's before the
        next query's chunk (in whole ``lcm(page_size, chunk)`` tokens)."""
        if group.window is None and group.chunk is None:
            return
        for b, table in enumerate(tables):
            first = group.droppable(lens[b])
            drop = min(first - skips[b], len(table))
            if drop > 0:
                free.extend(table[:drop])
                del table[:drop]
                skips[b] += drop

    def _compact(self, group: _Group) -> None:
        """Shrink a sliding (chunked) group's pools once they are mostly free (a long
        prompt's pages, written by the prefill, then left behind by the window): the live
        pages move to the front, one copy of the window per layer."""
        if group.window is None and group.chunk is None:
            return
        live = [page for table in group.tables for page in table]
        target = max(2 * len(live), 2 * self._batch_size, 1)
        if group.capacity <= 2 * target:
            return
        where = {page: i for i, page in enumerate(live)}
        for layer in group.layers:
            if layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                src = torch.tensor(live, dtype=torch.long, device=layer.keys.device)
                keys = layer.keys.new_empty(target, *layer.keys.shape[1:])
                values = layer.values.new_empty(target, *layer.values.shape[1:])
                keys[: len(live)] = layer.keys.index_select(0, src)
                values[: len(live)] = layer.values.index_select(0, src)
                layer.keys, layer.values = keys, values
        group.tables = [[where[page] for page in table] for table in group.tables]
        group.free, group.fresh, group.capacity = [], len(live), target

    def _clear(self, batch: int) -> None:
        self._batch_size = batch
        self.dense_len = 0
        self.lens = [0] * batch
        self.history = torch.zeros(batch, 0, dtype=torch.bool)
        for group in self.groups.values():
            group.tables = [[] for _ in range(batch)]
            group.skips = [0] * batch
            group.free = list(range(group.fresh))[::-1]

    def _select_rows(self, rows: list[int]) -> None:
        """Row r of the new cache is a copy of row ``rows[r]`` (beam reordering, expansion)."""
        if self.dense_len == 0:
            self._batch_size = len(rows)
            self._clear(len(rows))
            return
        if any(not 0 <= r < self._batch_size for r in rows):
            raise UnsupportedModelError(
                f"row indices {rows!r} outside the batch {self._batch_size}"
            )
        for group in self.groups.values():
            old_pages: list[int] = []
            new_pages: list[int] = []
            tables: list[list[int]] = []
            free = list(group.free)
            fresh = group.fresh
            for r in rows:
                table = []
                for page in group.tables[r]:
                    if free:
                        new = free.pop()
                    else:
                        new = fresh
                        fresh += 1
                    table.append(new)
                    old_pages.append(page)
                    new_pages.append(new)
                tables.append(table)
            if fresh > group.capacity:
                group.grow(max(fresh, group.capacity * 2))
            for layer in group.layers:
                if layer.is_initialized and old_pages:
                    assert layer.keys is not None and layer.values is not None
                    src = torch.tensor(old_pages, device=layer.keys.device)
                    dst = torch.tensor(new_pages, device=layer.keys.device)
                    layer.keys.index_copy_(0, dst, layer.keys.index_select(0, src))
                    layer.values.index_copy_(0, dst, layer.values.index_select(0, src))
            for table in group.tables:
                free.extend(table)
            group.tables = tables
            group.skips = [group.skips[r] for r in rows]
            group.free, group.fresh = free, fresh
        self.lens = [self.lens[r] for r in rows]
        self.history = self.history[rows]
        self._batch_size = len(rows)
