"""What an issued reference plan held when it was made, kept beside it by the backend object.

The reference backend's plan stays a plain record of tensors (a CUDA-graph replay copies a
new plan's tensors into a captured one, field by field, and the test kit reads them), so it
follows the rule "the handler re-derives what it reads from its own private copy" this way:
at issue the backend records every field value (by identity) and, for a host plan, a private
copy of every tensor the handler reads and of the snapshot's step counts. Each call checks
the plan against that record first: a field replaced (``object.__setattr__``, the
snapshot's included), a tensor resized, or (host plans) any entry edited in place is refused
with ``InvalidBatchError`` before anything is indexed.

A captured plan that a CUDA-graph replay refilled in place holds what a newer plan of the
same backend object holds: contents equal to one of the last few plans it issued are taken
as that re-plan (the record follows them). A device plan's contents are not compared (that
would read them back to the host, which a captured graph forbids): there the handler clamps
every page index into the cache given at the call instead.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import NoReturn

import torch

from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import InvalidBatchError

if TYPE_CHECKING:
    from attn_dispatch.backends.reference.backend import TorchPlan

__all__ = ["Seals"]

#: Plans of one backend object whose contents a refilled captured plan may take.
RECENT = 4

_Step = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Seal:
    values: tuple[Any, ...]  # every field value of the plan and of its snapshot
    ptrs: tuple[tuple[int, int], ...]  # address and size of every tensor the handler reads
    copies: tuple[torch.Tensor, ...] | None  # private copies (host plans); None on a device
    step: _Step


def _values(plan: TorchPlan) -> tuple[Any, ...]:
    top = tuple(getattr(plan, f.name) for f in dataclasses.fields(plan))
    snap = plan.snap
    if not isinstance(snap, BatchSnapshot):
        return top
    return top + tuple(getattr(snap, f.name) for f in dataclasses.fields(snap))


def _held(plan: TorchPlan) -> list[torch.Tensor]:
    """Every tensor the handler reads through ``plan`` (the snapshot's copies included)."""
    snap = plan.snap
    held = [plan.page_table, plan.q_rows, plan.q_valid, plan.out_rows, plan.q_pos, plan.kv_lens]
    held += [snap.qo_indptr, snap.kv_indptr, snap.kv_indices, snap.kv_lens]
    held += [snap.qo_indptr_host, snap.kv_indptr_host, snap.kv_lens_host]
    held += [t for t in (plan.mask, snap.custom_mask, snap.mask_indptr) if t is not None]
    for first, _span, lo in plan.blocks:
        held += (first, lo)
    return held


def _step(snap: BatchSnapshot) -> _Step:
    s = snap.step
    return (s.num_tokens, s.max_q_len, s.max_kv_len, s.max_page)


def _same(held: list[torch.Tensor], copies: tuple[torch.Tensor, ...]) -> bool:
    return len(held) == len(copies) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(held, copies, strict=True)
    )


class Seals:
    """One backend object's records of the plans it issued (weakly keyed by plan)."""

    def __init__(self) -> None:
        self._by_plan: weakref.WeakKeyDictionary[Any, _Seal] = weakref.WeakKeyDictionary()
        self._recent: collections.deque[_Seal] = collections.deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def seal(self, plan: TorchPlan) -> None:
        """Record ``plan`` as issued (in ``plan(batch)``, before it is handed out)."""
        held = _held(plan)
        host = all(t.is_cpu for t in held)
        seal = _Seal(
            values=_values(plan),
            ptrs=tuple((t.data_ptr(), t.numel()) for t in held),
            copies=tuple(t.clone() for t in held) if host else None,
            step=_step(plan.snap),
        )
        with self._lock:
            self._by_plan[plan] = seal
            self._recent.append(seal)

    def verify(self, plan: TorchPlan) -> None:
        """Raise ``InvalidBatchError`` (field ``plan``) unless ``plan`` holds what it was
        issued with (or, refilled in place, what a recent plan was issued with)."""
        seal = self._by_plan.get(plan)
        if seal is None:
            _refuse("was issued without a seal")
        now = _values(plan)
        if len(now) != len(seal.values) or any(
            a is not b for a, b in zip(now, seal.values, strict=True)
        ):
            _refuse("had a field replaced after it was made")
        held = _held(plan)
        if tuple((t.data_ptr(), t.numel()) for t in held) != seal.ptrs:
            _refuse("had a tensor resized after it was made")
        if seal.copies is None:
            return
        step = _step(plan.snap)
        if step == seal.step and _same(held, seal.copies):
            return
        with self._lock:
            recent = list(self._recent)
        for other in reversed(recent):
            if other.copies is not None and step == other.step and _same(held, other.copies):
                # A captured plan refilled with a newer plan's contents: follow them.
                self._by_plan[plan] = dataclasses.replace(
                    seal, copies=other.copies, step=other.step
                )
                return
        _refuse("had its tensors or counts edited after it was made")


def _refuse(what: str) -> NoReturn:
    raise InvalidBatchError(
        "plan", f"torch: this plan {what}; plan the batch again (binding.plan(batch))"
    )
