"""The active runner of this context, and the hot path that reads it.

The ContextVar holds one tuple per open scope ("frame"), so ``resolve`` is one
``ContextVar.get`` plus one tuple index:

    0..2  handler per Phase          5  plan (what backend.plan(batch) returned)
    3     Binding                    6  handler of batch.phase (None without a batch)
    4     batch (or None)            7  parent frame (or None)
                                     8  attention form chosen for the batch (or None)
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import ParamSpec
from typing import TypeVar

from attn_dispatch._binding import Binding
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._errors import ScopeError
from attn_dispatch._forms import AttnForm
from attn_dispatch._phase import Phase
from attn_dispatch._phase import UnknownPhaseError
from attn_dispatch._protocol import Handler

P = ParamSpec("P")
R = TypeVar("R")

_BINDING, _BATCH, _PLAN, _RUN, _PARENT, _FORM = 3, 4, 5, 6, 7, 8

Frame = tuple[Any, ...]
_CURRENT: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "attn_dispatch.current", default=None
)


def _binding_of(runner: object) -> Binding:
    binding = getattr(runner, "attn_binding", None)
    if not isinstance(binding, Binding):
        got = type(binding).__name__ if binding is not None else "no attn_binding attribute"
        raise InvalidSpecError(
            "runner",
            runner,
            f"attn_scope needs a Binding or an object whose attn_binding is one (got {got}); "
            "make it with attn_dispatch.bind(spec, config)",
        )
    return binding


class attn_scope:
    """Make ``runner`` the active one in this context for the duration of a forward.

    >>> with attn_scope(target_runner, batch):   # plans batch.phase's backend once
    ...     out = model(...)                     # layers call attention(...) / resolve(...)

    Scopes nest (the innermost wins), are restored on any exit (exceptions and
    ``BaseException`` included), and are private to their thread and asyncio task. Also a
    decorator: ``@attn_scope(runner)``. An instance is entered once at a time.
    """

    __slots__ = ("_batch", "_binding", "_frame", "_token")

    def __init__(self, runner: object, batch: Any = None) -> None:
        # A Binding is the common case: skip the attn_binding property and the isinstance.
        self._binding = runner if type(runner) is Binding else _binding_of(runner)
        self._batch = batch
        self._token: contextvars.Token[Frame | None] | None = None
        self._frame: Frame | None = None
        if batch is not None and not isinstance(getattr(batch, "phase", None), Phase):
            raise InvalidBatchError("phase", f"batch {type(batch).__name__} has no Phase in .phase")

    def __enter__(self) -> Binding:
        if self._token is not None:
            raise ScopeError(
                "this attn_scope is already active; create a new attn_scope(...) to nest"
            )
        b = self._binding
        batch = self._batch
        parent = _CURRENT.get()
        frame: Frame
        h = b._handlers  # explicit items: a starred tuple display builds a list first
        if batch is None:
            frame = (h[0], h[1], h[2], b, None, None, None, parent, None)
        else:
            plan, run, form = b.prepare(batch)
            frame = (h[0], h[1], h[2], b, batch, plan, run, parent, form)
        self._frame = frame
        self._token = _CURRENT.set(frame)
        return b

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        token, frame = self._token, self._frame
        if token is None:
            raise ScopeError("attn_scope exited without being entered")
        current = _CURRENT.get()
        if current is frame:
            try:
                _CURRENT.reset(token)
            except ValueError:
                # A copy of the entering context (carry_scope, a task): the token belongs to
                # the original one, which must close it.
                raise ScopeError(_not_open(frame)) from None
            self._token = self._frame = None
            return
        node = current
        while node is not None and node is not frame:
            node = node[_PARENT]
        if node is None:
            # Resetting here could rebind a stale runner: leave the context as it is, and keep
            # the token so the context that entered this scope can still close it.
            raise ScopeError(_not_open(frame))
        try:
            _CURRENT.reset(token)
        except ValueError:
            raise ScopeError(_not_open(frame)) from None
        self._token = self._frame = None
        raise ScopeError(
            f"attn_scope({_label(frame)}) exited while an inner scope "
            f"({_label(current)}) was still open; scopes must exit in reverse order. Both are "
            "closed now."
        )

    async def __aenter__(self) -> Binding:
        return self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        binding, batch = self._binding, self._batch
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # Wrapping the call would close the scope before the body runs; holding it across
            # yields would leak it into the caller between them. Neither is what anyone means.
            raise ScopeError(
                f"attn_scope cannot decorate the generator function {fn.__qualname__!r}; "
                "open the scope inside it instead: `with attn_scope(...):`"
            )
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                with attn_scope(binding, batch):
                    return await fn(*args, **kwargs)

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with attn_scope(binding, batch):
                return fn(*args, **kwargs)

        return run


def _not_open(frame: Frame | None) -> str:
    return (
        f"attn_scope({_label(frame)}) is not open in this context: it was already closed "
        "by an out-of-order exit of an enclosing scope, or it is being exited in another "
        "thread or task than the one that entered it"
    )


def _label(frame: Frame | None) -> str:
    if frame is None:
        return "none"
    binding = frame[_BINDING]
    return repr(binding.label) if binding.label is not None else str(binding.spec)


def resolve(phase: Phase) -> Handler:
    """The handler the active runner uses for ``phase`` (the per-layer hot path).

    >>> with attn_scope(runner):
    ...     handler = resolve(Phase.DECODE)
    """
    # The happy path is exactly one ContextVar.get and one index: no scope (None) and a bad
    # phase both land in the except clause, which costs nothing until it runs.
    try:
        return _CURRENT.get()[phase]  # type: ignore[index,no-any-return]
    except (TypeError, IndexError):
        if _CURRENT.get() is None:
            raise NoActiveScopeError("resolve") from None
        raise UnknownPhaseError(repr(phase), tuple(p.name for p in Phase)) from None


def current_binding() -> Binding:
    """The Binding of the innermost scope; ``NoActiveScopeError`` outside every scope."""
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("current_binding")
    return frame[_BINDING]  # type: ignore[no-any-return]


def current_batch() -> Any:
    """The batch of the innermost scope (None when it was opened without one)."""
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("current_batch")
    return frame[_BATCH]


def attention_form() -> Any:
    """The attention form (``AttnForm``) the active backend chose for the scope's batch.

    Model code branches on it the way DeepSeek's ``dispatch_attn_forward_method`` does, but
    the choice belongs to the runner's own backend, never to a global.
    """
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("attention_form")
    form = frame[_FORM]
    if form is None:
        if frame[_BATCH] is None:
            raise _no_batch("attention_form")
        raise InvalidBatchError(
            "form",
            f"backend {frame[_BINDING].backend_name(frame[_BATCH].phase)!r} chose no attention "
            "form for this batch (forms apply to MLA configs)",
        )
    return form


def _no_batch(what: str) -> InvalidBatchError:
    return InvalidBatchError(
        "batch",
        f"{what}() needs a scope opened with a batch: `with attn_scope(runner, batch):` "
        "(or call resolve(phase)(q, k_cache, v_cache, binding.plan(batch), sm_scale))",
    )


def attention(
    q: Any, k_cache: Any, v_cache: Any = None, *, sm_scale: float, prefix: Any = None
) -> Any:
    """Run attention for one layer with the active runner's handler for the scope's batch.

    >>> with attn_scope(runner, batch):
    ...     out = attention(q, k_cache, v_cache, sm_scale=head_dim ** -0.5)

    ``prefix`` is only for MLA layers in the ``AttnForm.MHA_CHUNKED`` form: the cached prefix
    as decompressed chunks (see ``attn_dispatch.mla.latent_prefix_chunks``).
    """
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("attention")
    run = frame[_RUN]
    if run is None:
        raise _no_batch("attention")
    if _recording:
        _record(frame)
    if prefix is None:
        return run(q, k_cache, v_cache, frame[_PLAN], sm_scale)
    if frame[_FORM] is not AttnForm.MHA_CHUNKED:
        raise InvalidBatchError(
            "prefix",
            f"prefix chunks are only for the 'mha_chunked' form; this batch runs "
            f"{getattr(frame[_FORM], 'value', 'a non-MLA config')!r} (see attention_form())",
        )
    return run(q, k_cache, v_cache, frame[_PLAN], sm_scale, prefix)


# ---------------------------------------------------------------------------------------------
# record_dispatch


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchEvent:
    """One ``attention`` call: which runner, phase, backend and form served it."""

    label: str | None
    phase: Phase
    backend: str
    form: str | None = None


class DispatchRecorder:
    """Events recorded by ``record_dispatch``; ``counts()`` and ``summary()`` aggregate them."""

    __slots__ = ("_lock", "events")

    def __init__(self) -> None:
        self.events: list[DispatchEvent] = []
        self._lock = threading.Lock()

    def add(self, event: DispatchEvent) -> None:
        with self._lock:
            self.events.append(event)

    def counts(self) -> collections.Counter[tuple[str | None, str, str]]:
        """``(label, phase, backend) -> calls``."""
        return collections.Counter((e.label, e.phase.name.lower(), e.backend) for e in self.events)

    def summary(self) -> str:
        """A plain-text table runner x phase x backend (x form) -> calls."""
        rows = collections.Counter(
            (str(e.label), e.phase.name.lower(), e.backend, e.form or "-") for e in self.events
        )
        header = ("runner", "phase", "backend", "form", "calls")
        body = [(*k, str(v)) for k, v in sorted(rows.items())]
        return format_table(header, body)


_RECORDERS: contextvars.ContextVar[tuple[DispatchRecorder, ...]] = contextvars.ContextVar(
    "attn_dispatch.recorders", default=()
)
# How many recorders are open in the whole process: a plain int read is the only cost the hot
# path pays while nobody records. Which events go where is still decided per context.
_recording = 0
_recording_lock = threading.Lock()


def _record(frame: Frame) -> None:
    recorders = _RECORDERS.get()
    if not recorders:
        return
    binding: Binding = frame[_BINDING]
    phase = frame[_BATCH].phase
    form = frame[_FORM]
    event = DispatchEvent(
        binding.label,
        phase,
        binding.spec.names[phase],
        None if form is None else str(getattr(form, "value", form)),
    )
    for rec in recorders:
        rec.add(event)


class record_dispatch:
    """Record (label, phase, backend, form) of every ``attention`` call in this context.

    >>> with record_dispatch() as rec:
    ...     run_forward()
    >>> rec.counts()[("target", "decode", "flashinfer")]
    """

    __slots__ = ("_recorder", "_token")

    def __init__(self) -> None:
        self._recorder = DispatchRecorder()
        self._token: contextvars.Token[tuple[DispatchRecorder, ...]] | None = None

    def __enter__(self) -> DispatchRecorder:
        global _recording
        if self._token is not None:
            raise ScopeError("this record_dispatch is already active")
        self._token = _RECORDERS.set((*_RECORDERS.get(), self._recorder))
        with _recording_lock:
            _recording += 1
        return self._recorder

    def __exit__(self, *exc_info: object) -> None:
        global _recording
        token, self._token = self._token, None
        if token is None:
            # Decrementing here would leave the process-wide count wrong for good.
            raise ScopeError("record_dispatch exited without being entered")
        with _recording_lock:
            _recording -= 1
        _RECORDERS.reset(token)


# ---------------------------------------------------------------------------------------------
# threads


def carry_scope(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so it runs in a copy of the caller's context (its scopes included).

    ``threading.Thread`` starts with an empty context, so a worker sees no scope unless you
    carry it:

    >>> with attn_scope(runner):
    ...     t = threading.Thread(target=carry_scope(work)); t.start()
    """
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        # A Context can be entered by one thread at a time: each call gets its own copy.
        return ctx.copy().run(fn, *args, **kwargs)

    return run


def run_in_thread(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """Run ``fn(*args, **kwargs)`` in a new thread with the current scope; return its result."""
    result: list[Any] = []
    error: list[BaseException] = []
    wrapped = carry_scope(fn)

    def target() -> None:
        try:
            result.append(wrapped(*args, **kwargs))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="attn_dispatch-worker")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]  # type: ignore[no-any-return]


def iter_scopes() -> Iterator[Binding]:
    """The bindings of the open scopes, innermost first (for debugging)."""
    frame = _CURRENT.get()
    while frame is not None:
        yield frame[_BINDING]
        frame = frame[_PARENT]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table with aligned columns."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
