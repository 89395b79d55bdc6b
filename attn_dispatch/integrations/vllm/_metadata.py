"""One step's attention metadata for the layers of a KV group (what vLLM calls
``attn_metadata``): the step's batches under each runner's phase rule, and their plans, each
made once per step."""

from __future__ import annotations

import array
import dataclasses
from typing import Any

import torch

from attn_dispatch._binding import Binding
from attn_dispatch._frame import attn_scope
from attn_dispatch._phase import Phase
from attn_dispatch.integrations.vllm import _dcp
from attn_dispatch.integrations.vllm._dcp import DcpStep
from attn_dispatch.integrations.vllm._steps import StepPart
from attn_dispatch.integrations.vllm._steps import step_parts


@dataclasses.dataclass(eq=False)
class DispatchMetadata:
    """One step's attention metadata for every layer of a KV group (what vLLM calls
    ``attn_metadata``). ``parts_for(draft)``: one per phase present (``"split"``) or one
    (``"extend"``), under the phase rule of the layer's runner. Each binding plans each part
    once, at its first layer (``prepared``)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_speculative_tokens: int
    mixed: str
    causal: bool = True
    #: Decode context parallel: vLLM's ``cp_kv_cache_interleave_size`` (0: no DCP).
    interleave: int = 0
    _parts: dict[bool, tuple[StepPart, ...]] = dataclasses.field(default_factory=dict)
    _plans: dict[tuple[int, bool, int], Any] = dataclasses.field(default_factory=dict)
    _scopes: dict[tuple[int, bool, int], attn_scope] = dataclasses.field(default_factory=dict)
    _dcp: DcpStep | None = None
    #: ``kv_rows``'s last answer, with the slot mapping and page size it was made for.
    _kv: tuple[torch.Tensor, int, KvRows] | None = None

    def dcp_step(self, world: int, rank: int) -> DcpStep:
        """This step's batches on decode-context-parallel rank ``rank`` (built once)."""
        if self._dcp is None:
            n = self.seq_lens.shape[0]
            self._dcp = _dcp.dcp_step(
                self.query_start_loc,
                self.seq_lens,
                self.block_table[:n],
                block_size=self.block_size,
                world=world,
                rank=rank,
                interleave=self.interleave,
            )
        return self._dcp

    def parts_for(self, draft: bool) -> tuple[StepPart, ...]:
        """The step's parts under the target's (``draft=False``) or the draft's phase rule."""
        found = self._parts.get(draft)
        if found is None:
            # The whole table: step_blocks reads the rows of the step's requests only.
            found = self._parts[draft] = step_parts(
                self.query_start_loc,
                self.seq_lens,
                self.block_table,
                block_size=self.block_size,
                num_speculative_tokens=self.num_speculative_tokens,
                mixed=self.mixed,
                draft=draft,
            )
        return found

    def prepared(
        self, binding: Binding, draft: bool, part: StepPart | int, batch: Any = None
    ) -> Any:
        """``binding``'s plan of a part (a ``StepPart``, or an index and its batch), made once
        per step at the first layer that runs it."""
        index = part.index if isinstance(part, StepPart) else part
        key = (id(binding), draft, index)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = binding.prepare(
                part.batch if isinstance(part, StepPart) else batch
            )
        return found

    def scope(self, binding: Binding, draft: bool, part: StepPart) -> attn_scope:
        """``binding``'s scope of a part, made once per step (with its plan, ``prepared``) at
        the first layer that runs it; every later layer of the runner enters the same one
        (an ``attn_scope`` is entered by one caller at a time, and layers run one by one)."""
        key = (id(binding), draft, part.index)
        found = self._scopes.get(key)
        if found is None:
            found = self._scopes[key] = attn_scope(
                binding, part.batch, self.prepared(binding, draft, part)
            )
        return found

    def kv_rows(self, slot_mapping: torch.Tensor, page_size: int) -> KvRows:
        """Where the step's new tokens go (``kv_rows``), computed at the first layer's KV
        write and reused by the other layers handed the same ``slot_mapping`` tensor (vLLM
        hands every layer of a KV group one tensor per forward; this metadata holds it, so
        another forward's tensor is never taken for it)."""
        found = self._kv
        if found is not None and found[0] is slot_mapping and found[1] == page_size:
            return found[2]
        rows = kv_rows(slot_mapping, page_size)
        self._kv = (slot_mapping, page_size, rows)
        return rows

    def phases(self, draft: bool = False) -> tuple[Phase, ...]:
        return tuple(p.batch.phase for p in self.parts_for(draft))


#: Slot mappings of at most this many tokens are turned into rows as Python ints.
_LIST_SLOTS = 256


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KvRows:
    """Where one forward's new tokens are written: ``rows`` (int64) of the cache seen as
    ``[2 * blocks * page_size, kv_heads, head_dim]`` rows, for the first ``count`` tokens of
    ``key``/``value`` after ``keep`` (a bool mask, or None when every slot is a real one);
    ``end``, the largest row + 1 (0 without rows), for the per-layer bounds check."""

    rows: torch.Tensor
    count: int
    keep: torch.Tensor | None
    end: int


def kv_rows(slot_mapping: torch.Tensor, page_size: int) -> KvRows:
    """``KvRows`` of vLLM's slot mapping (one slot per token, -1: padding): token slot ``s``
    of block ``b = s // page_size`` lives in page ``2b`` (K) and ``2b + 1`` (V), row
    ``s % page_size``, so at cache row ``2 * page_size * b + s % page_size``."""
    count = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    if 0 < count <= _LIST_SLOTS and slots.dim() == 1:
        # A decode step's few slots: one host read, the rows as Python ints, one tensor made
        # from an int64 array (the tensor ops below cost ~1 us each on a few values, and
        # torch.tensor on a list twice frombuffer's time).
        listed: list[int] = slots.tolist()
        two = 2 * page_size
        keep = None
        if min(listed) < 0:  # vLLM pads with slot -1
            keep = torch.tensor([s >= 0 for s in listed], dtype=torch.bool)
            listed = [s for s in listed if s >= 0]
        values = array.array("q", [s // page_size * two + s % page_size for s in listed])
        return KvRows(
            torch.frombuffer(values, dtype=torch.int64) if values else slots.new_empty(0),
            count,
            keep,
            max(values) + 1 if values else 0,
        )
    valid = slots >= 0  # vLLM pads with slot -1
    keep = None
    if not bool(valid.all()):
        slots, keep = slots[valid], valid
    rows = (slots // page_size) * (2 * page_size) + slots % page_size
    return KvRows(rows, count, keep, int(rows.max()) + 1 if rows.numel() else 0)


__all__ = ["DispatchMetadata", "KvRows", "kv_rows"]
