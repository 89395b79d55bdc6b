"""The active runner of this context, and the hot path that reads it.

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
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import ParamSpec
from typing import TypedDict
from typing import TypeVar

from attn_dispatch._calls import CallRule
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._errors import ScopeError
from attn_dispatch._errors import UnknownPhaseError
from attn_dispatch._forms import AttnForm
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import Handler
from attn_dispatch._route import Binding

if TYPE_CHECKING:
    # typing.Unpack is Python 3.11+; the package supports 3.10 (typing_extensions has it).
    from typing_extensions import Unpack

P = ParamSpec("P")
R = TypeVar("R")

_CURRENT: contextvars.ContextVar[attn_scope | None] = contextvars.ContextVar(
    "attn_dispatch.current", default=None
)

#: Set by ``attn_dispatch._record`` while any ``record_dispatch`` is open in the process:
#: ``hook(frame, run, args) -> out`` runs the handler (recording, profiling). ``None`` costs
#: the hot path one global read.
_call_hook: Callable[[Any, Callable[..., Any], tuple[Any, ...]], Any] | None = None


def _set_call_hook(
    hook: Callable[[Any, Callable[..., Any], tuple[Any, ...]], Any] | None,
) -> None:
    global _call_hook
    _call_hook = hook


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
            raise InvalidBatchError(
                "prepared", "a grouped binding plans each group itself; pass no prepared plan"
            )
        if batch is None:
            self.plan = self.run = self.form = self.fast = None
            self._plans = False
            if prepared is not None:
                raise InvalidBatchError("batch", "a prepared plan needs the batch it was made for")
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
        self.scale_ok = _UNCHECKED  # read by attention()'s fast path, which needs a batch
        if prepared is None:
            self.run = self.fast = None  # until __enter__ plans
            self._plans = True
        else:
            self.plan, handler, self.form = prepared
            # Only a handler this binding hands out for this phase: a plan prepared by another
            # binding would run that runner's kernels under this runner's name.
            raw = binding._raw_of(phase, handler)
            if raw is None:
                raise InvalidBatchError(
                    "prepared",
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
                    self.plan, _, self.run, self.form = route.prepare(self.batch)
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
        self.plan = self.run = self.form = None

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
        self.binding = binding
        self.batch = batch
        rule = self.rule = binding._rule
        assert rule is not None  # a group is a plain binding
        self.sm_scale = rule.planned
        self.scale_ok = _UNCHECKED
        self.plan, _, self.run, self.form = binding._prepare(batch)
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


def resolve(phase: Phase) -> Handler:
    """The handler the active runner uses for ``phase`` (the per-layer hot path).

    >>> from attn_dispatch import AttnConfig, bind
    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
    ...                     dtype="float32", device="cpu", page_size=8)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> with attn_scope(Runner()):
    ...     handler = resolve(Phase.DECODE)
    >>> handler is Runner.attn_binding.handler(Phase.DECODE)
    True

    Only ``Phase`` members resolve: an int or a framework's own mode enum raises
    ``UnknownPhaseError`` (map it with ``phase_of(mode)`` first).
    """
    # The happy path is one ContextVar.get, one attribute load and one dict lookup: no scope
    # (None) and a bad phase both land in the except clause, which costs nothing until it runs.
    try:
        return _CURRENT.get().handlers[phase]  # type: ignore[union-attr]
    except (AttributeError, KeyError, TypeError):
        raise _resolve_error(phase) from None


def _resolve_error(phase: object) -> Exception:
    frame = _CURRENT.get()
    if frame is None:
        return NoActiveScopeError("resolve")
    if frame.binding._groups is not None and type(phase) is Phase:
        names = ", ".join(map(repr, frame.binding._groups))
        return InvalidBatchError(
            "group",
            f"runner {_label(frame)} has groups ({names}): resolve() has no single handler; "
            "call attention(..., group=name), or resolve through binding.groups[name]",
        )
    return UnknownPhaseError(
        repr(phase),
        tuple(p.name for p in Phase),
        hint=(
            "resolve() takes an attn_dispatch.Phase member; map a framework's forward mode "
            "(SGLang's ForwardMode, a name, an int) with its integration's phase_of(mode) "
            "first (SGLang: attn_dispatch.integrations.sglang.phase_of)."
        ),
    )


def current_binding() -> Binding:
    """The Binding of the innermost scope; ``NoActiveScopeError`` outside every scope."""
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("current_binding")
    return frame.binding


def current_batch() -> Any:
    """The batch of the innermost scope (None when it was opened without one)."""
    frame = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("current_batch")
    return frame.batch


def attention_form(group: str | None = None) -> Any:
    """The attention form (``AttnForm``) the active backend chose for the scope's batch.

    Model code branches on it the way DeepSeek's ``dispatch_attn_forward_method`` does, but
    the choice belongs to the runner's own backend, never to a global. ``group``: the layer's
    group, for a runner bound with groups.
    """
    frame: Any = _CURRENT.get()
    if frame is None:
        raise NoActiveScopeError("attention_form")
    if group is not None:
        frame = _group_frame(frame, group)
    form = frame.form
    if form is None:
        if frame.batch is None:
            raise _no_batch("attention_form")
        raise InvalidBatchError(
            "form",
            f"backend {frame.binding.backend_name(frame.batch.phase)!r} chose no attention "
            "form for this batch (forms apply to MLA configs)",
        )
    return form


def iter_scopes() -> Iterator[Binding]:
    """The bindings of the open scopes, innermost first (for debugging)."""
    frame = _CURRENT.get()
    while frame is not None:
        yield frame.binding
        frame = frame.parent


def _no_batch(what: str) -> InvalidBatchError:
    return InvalidBatchError(
        "batch",
        f"{what}() needs a scope opened with a batch: `with attn_scope(runner, batch):` "
        "(or call resolve(phase)(q, k_cache, v_cache, binding.plan(batch), sm_scale))",
    )


class AttentionExtras(TypedDict, total=False):
    """The per-call keywords of ``attention`` beyond ``sm_scale`` and ``group`` (see there)."""

    prefix: Any
    sinks: Any
    k_scale: float | None
    v_scale: float | None
    return_lse: bool


_EXTRA_NAMES = frozenset(AttentionExtras.__annotations__)


def attention(
    q: Any,
    k_cache: Any,
    v_cache: Any = None,
    *,
    sm_scale: float | None = None,
    group: str | None = None,
    **extras: Unpack[AttentionExtras],
) -> Any:
    """Run attention for one layer with the active runner's handler for the scope's batch.

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, bind
    >>> head_dim = 16
    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
    ...                     dtype="float32", device="cpu", page_size=8, return_lse=True)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9],
    ...                         page_tables=[[3], [0, 1]], page_size=8)
    >>> q = torch.randn(2, 4, head_dim)
    >>> k_cache, v_cache = torch.randn(2, 4, 8, 2, head_dim)   # [pages, page_size, kv_heads, dim]
    >>> with attn_scope(Runner(), batch):
    ...     out = attention(q, k_cache, v_cache, sm_scale=head_dim ** -0.5)

    ``sm_scale`` defaults to the bound ``AttnConfig.sm_scale``; given both, they must agree
    (``InvalidBatchError`` otherwise); given neither, ``InvalidBatchError`` says to pass one.
    ``group``: the layer's group, exactly when the runner was bound with groups
    (``bind(spec, {"sliding": cfg_a, "full": cfg_b})``). Keywords (``AttentionExtras``):

    - ``prefix``: only for MLA layers in the ``AttnForm.MHA_CHUNKED`` form: the cached prefix
      as decompressed chunks (see ``attn_dispatch.mla.latent_prefix_chunks``).
    - ``sinks``: the layer's sink logits (float32 ``[num_q_heads]``), exactly when the config
      has ``sinks=True``.
    - ``k_scale``/``v_scale``: the FP8 cache's scales (floats > 0, default 1.0), only for an
      FP8 ``kv_dtype``; MLA passes ``k_scale`` alone (it covers the latent, V included).
    - ``return_lse``: ``True`` returns ``(out, lse)``, lse float32 ``[tokens, num_q_heads]``
      (the natural log of the sum of exp(score) over the keys each row attended; see
      ``attn_dispatch.merge_state``); only when the config has ``return_lse=True``.

    >>> with attn_scope(Runner(), batch):
    ...     out, lse = attention(q, k_cache, v_cache, sm_scale=0.25, return_lse=True)
    >>> out.shape, lse.shape, lse.dtype
    (torch.Size([2, 4, 16]), torch.Size([2, 4]), torch.float32)

    Under ``torch.compile`` the same call is traced as one opaque op
    (``attn_dispatch.compile``).
    """
    # Why **extras: each keyword-only parameter a call leaves out costs CPython a dict lookup
    # of its default (four more cost ~55 ns, a third of this function); an empty **extras
    # costs a third of that. The fast path reads one frame attribute (``fast``: None without a
    # batch, for a grouped frame, or when the config takes per-call extras); every other case,
    # and every error, is decided in _attention_slow.
    frame = _CURRENT.get()
    if group is not None:
        try:
            frame = frame.groups[group]  # type: ignore[union-attr,index]
        except (AttributeError, KeyError, TypeError):
            frame = _group_frame(frame, group)
    try:
        run = frame.fast  # type: ignore[union-attr]
    except AttributeError:
        raise NoActiveScopeError("attention") from None
    if run is not None and not extras:
        scale = frame.sm_scale  # type: ignore[union-attr]
        if scale is None:
            # The call's own scale: checked once (float32 normal range, not NaN/None/bool),
            # then recognised by identity.
            scale = sm_scale
            if scale is not frame.scale_ok:  # type: ignore[union-attr]
                scale = frame.scale_ok = frame.rule.scale(sm_scale)  # type: ignore[union-attr]
        elif sm_scale is not None and (sm_scale != scale or type(sm_scale) is bool):
            scale = frame.rule.scale(sm_scale)  # type: ignore[union-attr]
        if _call_hook is None:
            return run(q, k_cache, v_cache, frame.plan, scale)  # type: ignore[union-attr,arg-type]
        # Recording: the hook runs the same call (a tally of it costs ~0.3 us: bench/dispatch.py)
        return _call_hook(frame, run, (q, k_cache, v_cache, frame.plan, scale))  # type: ignore[union-attr]
    unknown = extras.keys() - _EXTRA_NAMES
    if unknown:
        raise TypeError(
            f"attention() got an unexpected keyword argument {sorted(unknown)[0]!r} "
            f"(its keywords: sm_scale, group, {', '.join(sorted(_EXTRA_NAMES))})"
        )
    return _attention_slow(
        frame,
        q,
        k_cache,
        v_cache,
        sm_scale,
        extras.get("prefix"),
        extras.get("sinks"),
        extras.get("k_scale"),
        extras.get("v_scale"),
        extras.get("return_lse", False),
    )


def _group_frame(frame: attn_scope | None, group: Any) -> Any:
    if frame is None:
        raise NoActiveScopeError("attention")
    groups = frame.groups
    if groups is None and frame.binding._groups is not None:
        raise _no_batch("attention")
    if groups is not None:
        try:
            return groups[group]
        except (KeyError, TypeError):
            pass
        names = ", ".join(map(repr, groups))
        problem = f"runner {_label(frame)} has no group {group!r} (its groups: {names})"
    else:
        problem = (
            f"runner {_label(frame)} was bound without groups; call attention() without "
            "group=, or bind one config per group: bind(spec, {'sliding': cfg_a, 'full': cfg_b})"
        )
    raise InvalidBatchError("group", problem)


def _no_run(frame: attn_scope) -> Exception:
    if frame.groups is not None:
        names = ", ".join(map(repr, frame.groups))
        return InvalidBatchError(
            "group",
            f"runner {_label(frame)} was bound with groups ({names}); every attention() call "
            "names its layer's group: attention(..., group=<name>)",
        )
    return _no_batch("attention")


def _attention_slow(
    frame: Any,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    sm_scale: float | None,
    prefix: Any,
    sinks: Any,
    k_scale: Any,
    v_scale: Any,
    return_lse: Any,
) -> Any:
    run = frame.run
    if run is None:
        raise _no_run(frame)
    rule: CallRule = frame.rule
    scale = rule.scale(sm_scale)
    args: tuple[Any, ...]
    if prefix is None:
        args = (q, k_cache, v_cache, frame.plan, scale)
    else:
        if frame.form is not AttnForm.MHA_CHUNKED:
            raise InvalidBatchError(
                "prefix",
                f"prefix chunks are only for the 'mha_chunked' form; this batch runs "
                f"{getattr(frame.form, 'value', 'a non-MLA config')!r} (see attention_form())",
            )
        args = (q, k_cache, v_cache, frame.plan, scale, prefix)
    kw = rule.keywords(q, sinks, k_scale, v_scale, return_lse)
    call: Callable[..., Any] = run if not kw else functools.partial(run, **kw)
    hook = _call_hook
    return call(*args) if hook is None else hook(frame, call, args)
