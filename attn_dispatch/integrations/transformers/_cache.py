"""The paged KV cache ``use()`` installs as a transformers model's cache (``PagedCache``).

transformers calls ``cache.update(k, v, layer_idx)`` in every attention layer and hands what it
returns to the attention function. ``PagedCache`` writes the new tokens straight into
attn_dispatch pages and returns the layer's page pools, so attention reads the pages in place:
a decode step writes one token per request and layer and copies no past K/V.

Layout, per attention group (``"full"``, ``"sliding"``, ``"chunked"``): one pool of pages of
``page_size`` tokens per layer (``[pages, page_size, Hkv, D]``, the contract's NHD layout) and
one page table per request, shared by the group's layers (the page numbers come from the
group's ``PageGroup``, ``_allocator``). Only a request's real tokens (its 2-D
``attention_mask``'s ones) are stored, in order, so padding is never attended. After each
forward a sliding (chunked) group frees the pages its next query cannot see and shrinks its
pools when they are mostly free, except while transformers records the past (assisted
generation rolls candidates back with ``crop``); ``crop`` trims back to the window, as
``DynamicSlidingWindowLayer`` does.

Every operation transformers' generation modes call (``reorder_cache`` for beam search,
``crop`` for assisted generation, ``batch_repeat_interleave``, ``batch_select_indices``,
``reset``) works on whole page tables, for every KV dtype (FP8 pages are moved as bytes: torch
has no float8 ``index_copy_`` on CPU), and refuses bad arguments with ``InvalidBatchError``
naming the argument, before anything changes. The pools and their writes are the layers'
(``_layer.PagedLayer``).

Per forward, ``begin`` (called by ``use()``'s forward wrapper with the 2-D mask) allocates the
new tokens' slots and builds the ``AttnBatch`` of each group; the layers' ``update`` calls
write into those slots; ``commit`` makes the new lengths current. A forward that fails leaves
the cache as it was (its slots lie past the committed lengths).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import Cache

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch._values import INT32_MAX
from attn_dispatch.integrations.transformers._allocator import PageGroup
from attn_dispatch.integrations.transformers._buffers import OutBuffers
from attn_dispatch.integrations.transformers._common import _PUBLIC_MODULE
from attn_dispatch.integrations.transformers._common import DEFAULT_PAGE_SIZE
from attn_dispatch.integrations.transformers._common import FP8_MAX
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import GROUP_SLIDING
from attn_dispatch.integrations.transformers._common import UnsupportedModelError
from attn_dispatch.integrations.transformers._layer import PagedLayer
from attn_dispatch.integrations.transformers._layer import _Step


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedBatches:
    """One forward's batches, one per attention group (the sliding group's page tables hold
    only the window's pages). ``attn_scope`` plans each group with its own batch."""

    phase: Phase
    group_batches: Mapping[str, AttnBatch]


def _index(value: Any, field: str) -> int:
    """``value`` as an int (a Python or NumPy int, a 0-d integer tensor); bools and floats
    are refused, naming ``field``."""
    if isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_floating_point())
    ):
        raise InvalidBatchError(field, f"{value!r}; expected an int")
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        raise InvalidBatchError(field, f"{value!r}; expected an int")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidBatchError(
            field, f"{value!r} (a {type(value).__name__}); expected an int"
        ) from None


class PagedCache(Cache):
    """A transformers ``Cache`` whose layers keep K/V in attn_dispatch pages.

    Made by ``use()`` (for ``generate`` and for forwards that ask for a cache); pass it back as
    ``cache=``/``past_key_values=`` to continue a sequence::

        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        isinstance(out.past_key_values, PagedCache)  # True

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
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidBatchError("page_size", f"{page_size!r}; expected an int >= 1")
        if kv_dtype is not None and kv_dtype not in FP8_MAX:
            raise InvalidBatchError(
                "kv_dtype",
                f"{kv_dtype!r}; expected None (the model's dtype) or one of {sorted(FP8_MAX)!r}",
            )
        self.owner = owner
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.max_length = max_length
        self.dense_len = 0
        self.record_past = False
        self._step: _Step | None = None
        # The layers' attention outputs (attention(..., out=buf)), reused across layers and
        # steps while nothing else holds them (_buffers).
        self.out_buffers = OutBuffers()
        self._group_names = groups
        self._window = window
        self._batch_size = 0
        self.groups: dict[str, PageGroup] = {}
        self._layers_of: dict[str, list[PagedLayer]] = {}
        self.lens: list[int] = []
        self.history = torch.zeros(0, 0, dtype=torch.bool)  # real dense columns, per row
        layers: list[PagedLayer] = []
        for i, name in enumerate(groups):
            group = self.groups.get(name)
            if group is None:
                w = window if name == GROUP_SLIDING else None
                c = chunk if name == GROUP_CHUNKED else None
                group = self.groups[name] = PageGroup(name, w, page_size, c)
                self._layers_of[name] = []
            layer = PagedLayer(self, i, group)
            self._layers_of[name].append(layer)
            layers.append(layer)
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

    def activate_past_recording(
        self, recurrent_states_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """Keep what a later ``crop`` may need (assisted generation calls this before its
        candidates). ``recurrent_states_to_keep`` (transformers >= 5.25 passes it) counts the
        steps of recurrent state a linear-attention layer keeps; this cache holds attention
        layers only, which keep every key until ``crop``, so there is nothing to count. Any
        other keyword (transformers' ``Cache`` takes ``**kwargs`` and passes them on to its
        layers) is refused: this cache would not know what it asks for."""
        if kwargs:
            raise UnsupportedModelError(
                f"activate_past_recording: this cache takes recurrent_states_to_keep only, "
                f"got {sorted(kwargs)!r} as well: a transformers newer than this release asks "
                "for something the paged cache does not record; pin transformers to a release "
                "this version of attn_dispatch was tested with, or upgrade attn_dispatch"
            )
        if recurrent_states_to_keep is not None:
            n = _index(recurrent_states_to_keep, "recurrent_states_to_keep")
            if n < 0:
                raise InvalidBatchError(
                    "recurrent_states_to_keep",
                    f"activate_past_recording: must be None or an int >= 0, got {n!r}",
                )
        self.record_past = True

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.record_past

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` dense positions (a positive value keeps that
        many, as transformers' legacy form); sliding (chunked) groups trim back to their
        window (chunk)."""
        self._no_step("crop")
        n = _index(tokens_to_remove, "tokens_to_remove")
        if n > 0:
            n = min(0, n - self.dense_len)
        n = -n
        if n > self.dense_len:
            raise InvalidBatchError(
                "tokens_to_remove",
                f"crop({tokens_to_remove!r}) removes more than the {self.dense_len} cached "
                "positions",
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
            group.truncate(self.lens)
            group.trim(group.tables, group.skips, group.free, self.lens)
            self._compact(group)

    def reset(self) -> None:
        self._no_step("reset")
        for layer in self.paged_layers:
            layer.reset()
        for group in self.groups.values():
            group.fresh = group.capacity = 0
        self.out_buffers.clear()
        self._clear(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row r becomes a copy of row ``beam_idx[r]`` (beam search); the batch keeps its
        size."""
        rows = self._rows(beam_idx, "beam_idx", "reorder_cache")
        if self.dense_len and len(rows) != self._batch_size:
            raise InvalidBatchError(
                "beam_idx",
                f"{len(rows)} indices for a cache of {self._batch_size} rows; a beam reorder "
                "names one source row per row",
            )
        self._select_rows(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times, in place (generate's expansion for beams)."""
        self._no_step("batch_repeat_interleave")
        n = _index(repeats, "repeats")
        if n < 1:
            raise InvalidBatchError("repeats", f"{repeats!r}; expected an int >= 1")
        self._select_rows([b for b in range(self._batch_size) for _ in range(n)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` names (integers, or a bool mask over the rows)."""
        self._select_rows(self._rows(indices, "indices", "batch_select_indices"))

    def layers_of(self, group: str) -> list[PagedLayer]:
        """The layers of attention group ``group`` (their pools share its page numbers)."""
        if group not in self._layers_of:
            raise InvalidBatchError("group", f"{group!r}; this cache has {sorted(self.groups)!r}")
        return list(self._layers_of[group])

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
        rows = [i for i in range(b) if counts[i]]
        # Every new token real (no padding among them): the rows are 0..B*q-1 in order.
        all_real = len(rows) == b and all(n == q_len for n in counts)
        q_rows = (
            torch.arange(b * q_len, device=device)
            if all_real
            else torch.nonzero(new_real.reshape(-1)).flatten().to(device)
        )
        phase = (
            Phase.PREFILL if self.dense_len == 0 else Phase.DECODE if q_len == 1 else Phase.VERIFY
        )
        ps = self.page_size
        step = _Step(phase, b, q_len, q_rows, all_real, lens, new_real)
        if not all_real:
            step.pad_rows = torch.nonzero(~new_real.reshape(-1)).flatten().to(device)
        # This forward's output shapes: the real rows, and all B * q rows when some are padding.
        self.out_buffers.keep((int(q_rows.shape[0]), b * q_len))
        total_new = sum(counts)
        for name, group in self.groups.items():
            plan = step.pages[name] = group.plan(self.lens, lens, trim=not self.record_past)
            if plan.fresh > group.capacity:
                first_size = group.initial_pages(self.max_length, b)
                self._grow(group, max(plan.fresh, group.capacity * 2, first_size))
            tables = [plan.tables[i] for i in rows]
            firsts = [self.lens[i] - plan.skips[i] * ps for i in rows]
            dst = _slots(tables, firsts, [counts[i] for i in rows], ps, total_new)
            step.dst[name] = dst.to(device)
            if rows:
                step.batches[name] = _batch(
                    phase,
                    [counts[i] for i in rows],
                    [lens[i] - plan.skips[i] * ps for i in rows],
                    tables,
                    ps,
                    group.capacity,
                    device,
                )
        self._step = step
        return step

    def commit(self, step: _Step) -> None:
        for name, group in self.groups.items():
            group.adopt(step.pages[name])
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
                group.trim(group.tables, group.skips, group.free, self.lens)
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

    def _no_step(self, what: str) -> None:
        if self._step is not None:
            raise UnsupportedModelError(
                f"PagedCache.{what} during a forward of this cache: its layers are writing the "
                "forward's tokens; call it between forwards"
            )

    def _rows(self, indices: Any, field: str, what: str) -> list[int]:
        """Row indices from a 1-D integer tensor or sequence (or a bool mask over the rows),
        each in ``[0, batch)`` once the cache holds tokens."""
        self._no_step(what)
        if isinstance(indices, torch.Tensor):
            t = indices.detach()
        elif isinstance(indices, (list, tuple)):
            if any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
                raise InvalidBatchError(field, f"{indices!r}; expected a sequence of ints")
            t = torch.tensor(indices, dtype=torch.long)
        else:
            raise InvalidBatchError(
                field, f"a {type(indices).__name__}; expected a 1-D integer tensor"
            )
        if t.dim() != 1:
            raise InvalidBatchError(field, f"shape {tuple(t.shape)}; expected one dimension")
        if t.dtype == torch.bool:
            if self.dense_len and t.numel() != self._batch_size:
                raise InvalidBatchError(
                    field, f"a bool mask of {t.numel()} rows for a cache of {self._batch_size}"
                )
            t = torch.nonzero(t.cpu()).flatten()
        elif t.is_floating_point() or t.is_complex():
            raise InvalidBatchError(field, f"dtype {t.dtype}; expected an integer dtype")
        rows = [int(i) for i in t.cpu().tolist()]
        if not rows:
            raise InvalidBatchError(field, "no rows; a cache keeps at least one row")
        bad = [r for r in rows if r < 0 or (self.dense_len and r >= self._batch_size)]
        if bad:
            raise InvalidBatchError(
                field, f"rows {bad!r} outside the cache's batch of {self._batch_size} rows"
            )
        return rows

    def _grow(self, group: PageGroup, pages: int) -> None:
        if pages <= group.capacity:
            return
        group.capacity = pages
        for layer in self._layers_of[group.name]:
            layer.resize(pages)

    def _compact(self, group: PageGroup) -> None:
        """Shrink a sliding (chunked) group's pools once they are mostly free (a long
        prompt's pages, written by the prefill, then left behind by the window): the live
        pages move to the front, one copy of the window per layer."""
        plan = group.compaction(self._batch_size)
        if plan is None:
            return
        live, target = plan
        for layer in self._layers_of[group.name]:
            layer.keep_pages(live, target)
        group.compacted(live, target)

    def _clear(self, batch: int) -> None:
        self._batch_size = batch
        self.dense_len = 0
        self.lens = [0] * batch
        self.history = torch.zeros(batch, 0, dtype=torch.bool)
        for group in self.groups.values():
            group.clear(batch)

    def _select_rows(self, rows: list[int]) -> None:
        """Row r of the new cache is a copy of row ``rows[r]`` (beam reordering, expansion)."""
        if self.dense_len == 0:
            self._clear(len(rows))
            return
        for group in self.groups.values():
            sources, destinations = group.copy_rows(rows)
            if group.fresh > group.capacity:
                self._grow(group, max(group.fresh, group.capacity * 2))
            for layer in self._layers_of[group.name]:
                layer.move_pages(sources, destinations)
        self.lens = [self.lens[r] for r in rows]
        self.history = self.history[rows]
        self._batch_size = len(rows)


#: New tokens of a forward up to which their cache slots are computed in Python (a decode
#: step: a few ints) rather than with per-row tensor ops (a prefill).
_PY_SLOTS = 64


def _slots(
    tables: list[list[int]], firsts: list[int], counts: list[int], ps: int, total: int
) -> torch.Tensor:
    """int64 flat slots (``page * ps + offset``) of each row's new tokens, positions
    ``firsts[r]:firsts[r] + counts[r]`` of its table, rows one after the other."""
    if total <= _PY_SLOTS:
        flat = [
            table[pos // ps] * ps + pos % ps
            for table, first, n in zip(tables, firsts, counts, strict=True)
            for pos in range(first, first + n)
        ]
        return torch.tensor(flat, dtype=torch.long)
    parts = []
    for table, first, n in zip(tables, firsts, counts, strict=True):
        pos = torch.arange(first, first + n)
        parts.append(torch.tensor(table, dtype=torch.long)[pos // ps] * ps + pos % ps)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _batch(
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    tables: list[list[int]],
    ps: int,
    num_pages: int,
    device: Any,
) -> AttnBatch:
    """The forward's batch for one group. The lists come from this cache's own allocator
    (ints, tables as long as the lengths need): the int32 tensors are made directly and
    ``AttnBatch`` checks the contract on them, rather than ``AttnBatch.build`` checking every
    page number in Python first (a tenth of a decode step's time outside the kernels at 2048
    tokens). Values past int32 go through ``build``, which refuses them with our error."""
    if max(num_pages, max(kv_lens), sum(q_lens)) > INT32_MAX:
        return AttnBatch.build(
            phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=ps,
            num_pages=num_pages, device=device,
        )  # fmt: skip
    i32 = torch.int32
    batch = AttnBatch(
        phase=phase,
        qo_indptr=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=i32),
        kv_indptr=torch.tensor([0, *itertools.accumulate(map(len, tables))], dtype=i32),
        kv_indices=torch.tensor([p for t in tables for p in t], dtype=i32),
        kv_lens=torch.tensor(kv_lens, dtype=i32),
        page_size=ps,
        num_pages=num_pages,
    )
    return batch if str(device) == "cpu" else batch.to(device)


for _public in (GroupedBatches, PagedCache):
    _public.__module__ = _PUBLIC_MODULE
