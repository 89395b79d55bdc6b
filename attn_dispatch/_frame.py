"""The scope: a runner made the active one of this context (``attn_scope``).

One ContextVar holds the innermost open scope. The scope object *is* the frame: a named,
slotted record built by one constructor (``attn_scope(...)``, which ``cuda_graph`` uses too,
with a plan made before capture). Its fields:

    handlers   Phase -> handler (the binding's dict; resolve() is one lookup in it)
    binding    the Binding
    batch      the batch (or None)        plan, run, form   what binding.prepare(batch) gave
    sm_scale   the config's scale (or None)
    parent     the enclosing frame (or None)

Why the frame is a record holding a dict and not a tuple: a tuple index accepts any int, so
``resolve(5)`` returned an internal and an IntEnum of another framework dispatched as a
Phase. ``Phase`` hashes by identity, so a dict lookup refuses both at the cost of one
attribute load (bench/dispatch.py: resolve within 1.25x of a bare ContextVar.get + index).
Why the scope is the frame: a separate frame object cost one more Python-level constructor
per scope (about 160 ns, a third of enter+exit).

What reads the frame (``resolve``, ``attention``, ``current_binding``) is ``_scope``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any
from typing import ParamSpec
from typing import TypeVar

from attn_dispatch._calls import CallRule
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import ScopeError
from attn_dispatch._errors import UsageError
from attn_dispatch._forms import AttnForm
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import Handler
from attn_dispatch._route import Binding

P = ParamSpec("P")
R = TypeVar("R")

_CURRENT: contextvars.ContextVar[attn_scope | None] = contextvars.ContextVar(
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


# What attention() reads of a frame: an attn_scope, or one group's part of one (_GroupFrame).
_FRAME_FIELDS = (
    "batch",
    "binding",
    "checked",
    "fast",
    "form",
    "group",
    "groups",
    "plan",
    "rule",
    "run",
    "scale_ok",
    "sm_scale",
)
# scale_ok: the last per-call sm_scale the rules accepted (an identity cache: model code passes
# the same float object at every layer, so attention() checks it once per scope, not per call).
_UNCHECKED = object()


class attn_scope:
    """Make ``runner`` the active one in this context for the duration of a forward.

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, bind
    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
    ...                     dtype="float32", device="cpu", page_size=8, sm_scale=0.25)
    >>> class Runner:                # any object with an ``attn_binding`` is a runner
    ...     attn_binding = bind("torch", config, label="target")
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9],
    ...                         page_tables=[[3], [0, 1]], page_size=8)
    >>> q, k_cache = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
    >>> with attn_scope(Runner(), batch):   # plans batch.phase's backend once
    ...     out = attention(q, k_cache, k_cache)  # what every layer of the forward calls
    >>> out.shape
    torch.Size([2, 4, 16])

    Scopes nest (the innermost wins), are restored on any exit (exceptions and
    ``BaseException`` included), and are private to their thread and asyncio task. Also a
    decorator of plain and async functions: ``@attn_scope(runner)`` (not of generators: see
    docs/concepts/scope.md, "Scopes in generators"). An instance is entered once at a time,
    by one thread: entering it while it is open raises ``ScopeError`` (in another thread too).

    ``prepared``: ``(plan, handler, form)`` from ``binding.prepare(batch)`` made earlier;
    entering then plans nothing (``cuda_graph`` replays a captured plan this way).
    """

    __slots__ = (*_FRAME_FIELDS, "_closed", "_free", "_plans", "_token", "handlers", "parent")

    handlers: dict[Phase, Handler]
    binding: Binding
    batch: Any
    plan: Any
    run: Handler | None
    # The binding's checked handler behind ``run`` (``CheckedHandler``): a call with ``out=``
    # goes through it (its out rule, and a copy for a backend without ``out_buffer``).
    checked: Any
    form: AttnForm | None
    sm_scale: float | None
    rule: CallRule | None
    # ``run`` (the backend's own callable, after the call rules) when a call without extras may
    # go straight to it (the config takes no sinks or scales), else None: attention()'s fast
    # path tests this one attribute.
    fast: Handler | None
    group: str | None
    groups: dict[str, Any] | None
    parent: attn_scope | None
    _token: contextvars.Token[attn_scope | None] | None
    _closed: bool
    # One item while the instance is free: entering pops it (list.pop is atomic, in every
    # thread), exiting puts it back. A second thread or task entering an open instance finds
    # it empty and is refused, even while the first one is still planning.
    _free: list[int]
    _plans: bool

    def __init__(
        self,
        runner: object,
        batch: Any = None,
        prepared: tuple[Any, Handler, AttnForm | None] | None = None,
    ) -> None:
        # The per-forward cost of a scope is mostly Python call overhead (this __init__,
        # __enter__, __exit__: bench/dispatch.py scope_construct / scope_reuse), so the work
        # here is kept to the slot stores a frame needs: ``parent`` and ``_closed`` are set on
        # entry, and ``prepared`` is positional-or-keyword because a missing keyword-only
        # argument costs a dict lookup per call.
        # A Binding is the common case: skip the attn_binding property and the isinstance.
        binding = runner if type(runner) is Binding else _binding_of(runner)
        self.binding = binding
        self.handlers = binding._handler_map
        self.rule = binding._rule
        self.sm_scale = binding._sm_scale
        self.group = self.groups = None
        self.batch = batch
        self._free = [0]  # _token stays unset until the first entry (one store less per scope)
        if binding._groups is not None and prepared is not None:
            raise UsageError(
                "attn_scope(prepared=...)",
                "a grouped binding plans each group itself; pass no prepared plan",
            )
        if batch is None:
            self.plan = self.run = self.form = self.fast = self.checked = None
            self._plans = False
            if prepared is not None:
                raise UsageError(
                    "attn_scope(prepared=...)", "a prepared plan needs the batch it was made for"
                )
            return
        try:
            phase = batch.phase
        except AttributeError:
            phase = None
        if type(phase) is not Phase:
            raise InvalidBatchError(
                "phase",
                f"batch {type(batch).__name__} has no Phase in .phase "
                f"(got {phase!r}); map framework modes with phase_of()",
            )
        if binding._buckets is not None:
            # Shape buckets: the bucket's own binding serves this forward, chosen here, once,
            # so every layer's dispatch is the same lookup as without buckets.
            binding = self.binding = binding._pick(batch)
            self.handlers = binding._handler_map
        self.scale_ok = _UNCHECKED  # read by attention()'s fast path, which needs a batch
        if prepared is None:
            self.run = self.fast = None  # until __enter__ plans
            self._plans = True
        else:
            self.plan, handler, self.form = prepared
            self.checked = handler
            # Only a handler this binding hands out for this phase: a plan prepared by another
            # binding would run that runner's kernels under this runner's name.
            raw = binding._raw_of(phase, handler)
            if raw is None:
                raise UsageError(
                    "attn_scope(prepared=...)",
                    f"the prepared handler is not one runner {_label(self)} serves "
                    f"{phase.name} with: pass this binding's own binding.prepare(batch), never "
                    "another runner's",
                )
            self.run = raw
            self.fast = raw if self.rule is not None and self.rule.plain else None
            self._plans = False

    def __enter__(self) -> Binding:
        try:
            self._free.pop()  # claimed before planning: nobody else passes meanwhile
        except IndexError:
            raise self._busy() from None
        if self._plans:
            try:
                binding = self.binding
                if binding._groups is None:
                    # The phase was checked on construction: straight to the phase's route.
                    route = binding._routes[self.batch.phase]
                    self.plan, self.checked, self.run, self.form = route.prepare(self.batch)
                    self.fast = self.run if self.rule.plain else None  # type: ignore[union-attr]
                else:
                    self._plan_groups()
            except BaseException:
                self._free.append(0)
                raise
        self.parent = _CURRENT.get()
        self._closed = False
        self._token = _CURRENT.set(self)
        return self.binding

    def _busy(self) -> ScopeError:
        node = _CURRENT.get()
        while node is not None:
            if node is self:
                return ScopeError(
                    "this attn_scope is already active; create a new attn_scope(...) to nest"
                )
            node = node.parent
        return ScopeError(
            f"attn_scope({_label(self)}) is open in another thread or task: an instance is "
            "entered by one at a time; create one attn_scope(...) per thread (or carry this "
            "one with carry_scope)"
        )

    def _plan_groups(self) -> None:
        # Every group planned once per forward, before any layer runs; the frame itself has no
        # handler (each layer names its group). A batch may carry one batch per group
        # (``group_batches``): groups whose caches keep different pages (a sliding window's)
        # share the forward's phase.
        assert self.binding._groups is not None
        per_group = getattr(self.batch, "group_batches", None)
        self.groups = {
            name: _GroupFrame(name, child, _group_batch(self.batch, per_group, name))
            for name, child in self.binding._groups.items()
        }
        self.plan = self.run = self.form = self.checked = None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            token = self._token
        except AttributeError:  # never entered
            token = None
        # A set token means __enter__ ran, which also set _closed. The common exit tests three
        # things and resets; every other case is decided (or refused) in _exit_slow.
        inner = None
        if token is None or self._closed or _CURRENT.get() is not self:
            inner = self._exit_slow(token)
        try:
            _CURRENT.reset(token)  # type: ignore[arg-type]  # _exit_slow refuses None
        except ValueError:
            # A copy of the entering context (carry_scope, a task): the token belongs to the
            # original one, which must close it.
            raise ScopeError(_not_open(self)) from None
        self._token = None
        self._free.append(0)
        if inner is not None:
            current = inner[0]
            for scope in inner:
                scope._closed = True  # and free again: it may be entered anew
                if not scope._free:
                    scope._free.append(0)
            raise ScopeError(
                f"attn_scope({_label(self)}) exited while an inner scope "
                f"({_label(current)}) was still open; scopes must exit in reverse order. Both "
                "are closed now."
            )

    def _exit_slow(self, token: contextvars.Token[attn_scope | None] | None) -> list[attn_scope]:
        """The scopes opened inside this one and still open (to close with it), or an error."""
        if token is None:
            raise ScopeError("attn_scope exited without being entered")
        if self._closed:
            # An enclosing scope exited first and closed this one with it; the instance is
            # free again (it may be entered anew).
            self._token = None
            if not self._free:
                self._free.append(0)
            raise ScopeError(
                f"attn_scope({_label(self)}) was already closed: an enclosing scope exited "
                "before it (scopes must exit in reverse order)"
            )
        inner: list[attn_scope] = []
        node = _CURRENT.get()
        while node is not None and node is not self:
            inner.append(node)
            node = node.parent
        if node is None:
            # Resetting here could rebind a stale runner: leave the context as it is, and keep
            # the token so the context that entered this scope can still close it.
            raise ScopeError(_not_open(self))
        return inner

    async def __aenter__(self) -> Binding:
        return self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        binding, batch = self.binding, self.batch
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # Wrapping the call would close the scope before the body runs; holding it across
            # yields would leak it into the consumer between them (a ContextVar set in a
            # generator frame is visible to whoever resumes it).
            raise ScopeError(
                f"attn_scope cannot decorate the generator function {fn.__qualname__!r}: a "
                "scope held across a `yield` leaks into the consumer between yields. Open it "
                "where no yield happens inside: around each next()/send() in the consumer "
                "(`with attn_scope(runner): item = next(gen)`), or inside the generator's body "
                "between yields, closing it before the next `yield`."
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

    def __repr__(self) -> str:
        token = getattr(self, "_token", None)
        state = "open" if token is not None and not self._closed else "closed"
        return f"<attn_scope {_label(self)} {state}>"


def _group_batch(batch: Any, per_group: Any, name: str) -> Any:
    if per_group is None:
        return batch
    try:
        return per_group[name]
    except (KeyError, TypeError):
        raise InvalidBatchError(
            "group_batches",
            f"the batch carries per-group batches but none for group {name!r}; give one batch "
            "per group of the binding, or no group_batches at all",
        ) from None


class _GroupFrame:
    """One group's part of a scope: what ``attention(..., group=name)`` reads. Built once per
    forward (planning the group's batch); read-only afterwards."""

    __slots__ = _FRAME_FIELDS

    def __init__(self, group: str, binding: Binding, batch: Any) -> None:
        self.group = group
        self.groups = None
        if binding._buckets is not None:
            binding = binding.for_batch(batch)
        self.binding = binding
        self.batch = batch
        rule = self.rule = binding._rule
        assert rule is not None  # a group is a plain binding
        self.sm_scale = rule.planned
        self.scale_ok = _UNCHECKED
        self.plan, self.checked, self.run, self.form = binding._prepare(batch)
        self.fast = self.run if rule.plain else None


def _not_open(frame: attn_scope) -> str:
    return (
        f"attn_scope({_label(frame)}) is not open in this context: it is being exited in "
        "another thread or task than the one that entered it (that one must exit it)"
    )


def _label(frame: attn_scope | _GroupFrame | None) -> str:
    if frame is None:
        return "none"
    binding = frame.binding
    return repr(binding.label) if binding.label is not None else str(binding.spec)
