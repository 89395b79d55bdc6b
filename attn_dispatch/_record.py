"""record_dispatch: which runner, phase, backend and form served each ``attention`` call.

While no recorder is open anywhere in the process, ``attention`` pays one global read for
this feature. Opening one installs a call hook in ``_scope``; which events go to which
recorder is still decided per context (thread, asyncio task), like the scopes themselves.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from attn_dispatch import _scope
from attn_dispatch._errors import ScopeError
from attn_dispatch._phase import Phase
from attn_dispatch._table import format_table


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchEvent:
    """One ``attention`` call: which runner, phase, backend, form and group served it.

    ``note``: what the backend's plan says about how it ran the batch, when it says anything
    (the native backend: ``"cascade: 16 requests in 1 group share 3584 keys"``).
    """

    label: str | None
    phase: Phase
    backend: str
    form: str | None = None
    group: str | None = None
    note: str | None = None

    def range_name(self) -> str:
        """The torch.profiler range name:
        ``attn_dispatch/<runner>[:<group>]/<phase>/<backend>[/<form>]``."""
        tail = f"/{self.form}" if self.form is not None else ""
        who = self.label if self.group is None else f"{self.label}:{self.group}"
        return f"attn_dispatch/{who}/{self.phase.name.lower()}/{self.backend}{tail}"


class DispatchRecorder:
    """Events recorded by ``record_dispatch``; ``counts()`` and ``summary()`` aggregate them.

    ``tally=True`` (what ``attn_dispatch.testing`` opens): no event per call; ``tally()``
    counts calls per ``(binding, phase, form, group)`` of the frame that ran them (the
    binding object itself, so its config stays reachable), and ``events`` holds only what
    ``record_events`` added. Cheaper per call: one tuple, one dict lookup, one counter step.
    """

    __slots__ = ("_lock", "events", "profile", "tallied")

    def __init__(self, *, profile: bool = False, tally: bool = False) -> None:
        self.events: list[DispatchEvent] = []
        self.profile = profile
        # None: record one event per call; a dict: count calls per frame key instead.
        # next() of an itertools.count is one C call (atomic under the GIL): carried scopes
        # may call from several threads at once without a lock.
        self.tallied: dict[tuple[Any, Phase, Any, str | None], itertools.count[int]] | None = (
            {} if tally else None
        )
        self._lock = threading.Lock()

    def add(self, event: DispatchEvent) -> None:
        with self._lock:
            self.events.append(event)

    def tally(self) -> dict[tuple[Any, Phase, Any, str | None], int]:
        """``(binding, phase, form, group) -> calls`` of a ``tally=True`` recorder (read it
        after the calls: reading is not atomic with them)."""
        tallied = self.tallied or {}
        out = {}
        for key in list(tallied):
            # A counter has been advanced once per call, so next() reads the calls; a fresh
            # counter starting there takes its place for the calls still to come.
            out[key] = calls = next(tallied[key])
            tallied[key] = itertools.count(calls)
        return out

    def counts(self) -> collections.Counter[tuple[str | None, str, str]]:
        """``(label, phase, backend) -> calls``."""
        return collections.Counter((e.label, e.phase.name.lower(), e.backend) for e in self.events)

    def group_counts(self) -> collections.Counter[tuple[str | None, str | None, str, str]]:
        """``(label, group, phase, backend) -> calls`` (group None: a binding without groups)."""
        return collections.Counter(
            (e.label, e.group, e.phase.name.lower(), e.backend) for e in self.events
        )

    def summary(self) -> str:
        """A plain-text table runner x phase x backend x form -> calls (with a group column
        after the runner when any call named a group, and a note column when a plan left one)."""
        grouped = any(e.group is not None for e in self.events)
        noted = any(e.note is not None for e in self.events)
        rows = collections.Counter(
            (
                str(e.label),
                *((e.group or "-",) if grouped else ()),
                e.phase.name.lower(),
                e.backend,
                e.form or "-",
                *((e.note or "-",) if noted else ()),
            )
            for e in self.events
        )
        header = (
            "runner",
            *(("group",) if grouped else ()),
            "phase",
            "backend",
            "form",
            *(("note",) if noted else ()),
            "calls",
        )
        body = [(*k, str(v)) for k, v in sorted(rows.items())]
        return format_table(header, body)


_RECORDERS: contextvars.ContextVar[tuple[DispatchRecorder, ...]] = contextvars.ContextVar(
    "attn_dispatch.recorders", default=()
)
# How many recorders are open in the whole process; the hook is installed while it is > 0.
_open = 0
_open_lock = threading.Lock()


def _event(frame: Any) -> DispatchEvent:
    # frame: an attn_scope, or a group's part of one (same fields, plus its group name).
    binding = frame.binding
    phase = frame.batch.phase
    form = frame.form
    return DispatchEvent(
        binding.label,
        phase,
        binding.spec.names[phase],
        None if form is None else form.value,
        frame.group,
        getattr(frame.plan, "dispatch_note", None),
    )


def _recorded_call(frame: Any, run: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    recorders = _RECORDERS.get()
    if not recorders:  # open elsewhere (another thread or task), not here
        return run(*args)
    event = None
    profile = False
    for rec in recorders:
        tallied = rec.tallied
        if tallied is not None:
            key = (frame.binding, frame.batch.phase, frame.form, frame.group)
            counter = tallied.get(key)
            if counter is None:
                counter = tallied.setdefault(key, itertools.count())
            next(counter)
            continue
        if event is None:
            event = _event(frame)
        rec.add(event)
        profile = profile or rec.profile
    if profile and event is not None and "torch" in sys.modules:
        # Only when asked for, and only if torch is loaded already: never an import here.
        import torch

        with torch.profiler.record_function(event.range_name()):
            return run(*args)
    return run(*args)


def record_events(events: Iterable[DispatchEvent]) -> None:
    """Add ``events`` to the recorders open in this context (for calls that run no Python,
    such as a CUDA-graph replay of baked-in kernels)."""
    if _open:
        recorders = _RECORDERS.get()
        for event in events:
            for rec in recorders:
                rec.add(event)


class record_dispatch:
    """Record (label, phase, backend, form, group) of every ``attention`` call in this context.

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, attn_scope, bind
    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
    ...                     dtype="float32", device="cpu", page_size=8, sm_scale=0.25)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[5], page_tables=[[0]],
    ...                         page_size=8)
    >>> q, k_cache = torch.randn(1, 4, 16), torch.randn(1, 8, 2, 16)
    >>> with record_dispatch() as rec:
    ...     with attn_scope(Runner(), batch):
    ...         for layer in range(3):
    ...             out = attention(q, k_cache, k_cache)
    >>> rec.counts()[("target", "decode", "torch")]
    3

    ``profile=True`` also wraps each call in a ``torch.profiler.record_function`` range named
    ``attn_dispatch/<runner>/<phase>/<backend>[/<form>]``, so a profile shows which runner ran
    which kernel (only while this recorder is open; nothing is imported for it).

    ``tally=True``: count calls per runner binding, phase, form and group instead of keeping
    one event per call (``DispatchRecorder.tally()``; what ``attn_dispatch.testing`` uses;
    about a seventh of an event's cost per call). A tally recorder does not profile.
    """

    __slots__ = ("_recorder", "_token")

    def __init__(self, *, profile: bool = False, tally: bool = False) -> None:
        self._recorder = DispatchRecorder(profile=profile, tally=tally)
        self._token: contextvars.Token[tuple[DispatchRecorder, ...]] | None = None

    def __enter__(self) -> DispatchRecorder:
        global _open
        if self._token is not None:
            raise ScopeError("this record_dispatch is already active")
        self._token = _RECORDERS.set((*_RECORDERS.get(), self._recorder))
        with _open_lock:
            _open += 1
            _scope._set_call_hook(_recorded_call)
        return self._recorder

    def __exit__(self, *exc_info: object) -> None:
        global _open
        token = self._token
        if token is None:
            # Decrementing here would leave the process-wide count wrong for good.
            raise ScopeError("record_dispatch exited without being entered")
        current = _RECORDERS.get()
        try:
            # Validates the context: a token belongs to the context that made it.
            _RECORDERS.reset(token)
        except ValueError:
            # Another thread or task than the one that entered it: leave the count and the
            # token alone, so the entering context can still exit it.
            raise ScopeError(
                "record_dispatch is being exited in another thread or task than the one that "
                "entered it; exit it where it was entered"
            ) from None
        # Out-of-order exits must not bring a closed recorder back: keep every other open one.
        _RECORDERS.set(tuple(r for r in current if r is not self._recorder))
        self._token = None
        with _open_lock:
            _open -= 1
            if _open == 0:
                _scope._set_call_hook(None)


__all__ = ["DispatchEvent", "DispatchRecorder", "record_dispatch", "record_events"]
