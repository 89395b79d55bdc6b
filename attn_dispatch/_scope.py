"""The hot path: what model code reads of the active scope (``attn_dispatch._frame``).

``resolve(phase)`` is one ContextVar.get, one attribute load and one dict lookup;
``attention(...)`` reads the frame's ``fast`` handler and calls it. ``current_binding``,
``current_batch`` and ``attention_form`` answer what the innermost scope holds. Every error
of a call is decided off the fast path (``_attention_slow``, ``_resolve_error``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import TypedDict

from attn_dispatch import _frame
from attn_dispatch._calls import CallRule
from attn_dispatch._calls import returned_out
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._errors import UnknownPhaseError
from attn_dispatch._errors import UsageError
from attn_dispatch._forms import AttnForm
from attn_dispatch._frame import _label
from attn_dispatch._frame import attn_scope as attn_scope  # the scope, beside its readers
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import Handler
from attn_dispatch._route import Binding

# Bound by assignment, not imported by name: CPython 3.11 compiles ``name.get()`` on a name a
# ``from ... import`` bound as an attribute load plus a call (it assumes a module's function),
# not as a method call; that cost resolve() about 25 ns, half its time (bench/dispatch.py).
_CURRENT = _frame._CURRENT

if TYPE_CHECKING:
    # typing.Unpack is Python 3.11+; the package supports 3.10 (typing_extensions has it).
    from typing_extensions import Unpack

#: Set by ``attn_dispatch._record`` while any ``record_dispatch`` is open in the process:
#: ``hook(frame, run, args) -> out`` runs the handler (recording, profiling). ``None`` costs
#: the hot path one global read.
_call_hook: Callable[[Any, Callable[..., Any], tuple[Any, ...]], Any] | None = None


def _set_call_hook(
    hook: Callable[[Any, Callable[..., Any], tuple[Any, ...]], Any] | None,
) -> None:
    global _call_hook
    _call_hook = hook


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
        return UsageError(
            "resolve()",
            f"runner {_label(frame)} has groups ({names}): resolve() has no single handler; "
            "call attention(..., group=name), or resolve through binding.groups[name]",
        )
    buckets = frame.binding._buckets
    if buckets is not None and type(phase) is Phase and phase in buckets:
        return UsageError(
            "resolve()",
            f"runner {_label(frame)} picks its {phase.name.lower()} backend by the batch's shape "
            f"({frame.binding.spec.phase_text(phase)}): open the scope with the batch, "
            "attn_scope(runner, batch), and resolve() returns the handler of its bucket",
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
        raise UsageError(
            "attention_form()",
            f"backend {frame.binding.backend_name(frame.batch.phase)!r} chose no attention "
            "form for this batch (forms apply to MLA configs)",
        )
    return form


def _no_batch(what: str) -> UsageError:
    return UsageError(
        f"{what}()",
        "needs a scope opened with a batch: `with attn_scope(runner, batch):` "
        "(or call resolve(phase)(q, k_cache, v_cache, binding.plan(batch), sm_scale))",
    )


class AttentionExtras(TypedDict, total=False):
    """The per-call keywords of ``attention`` beyond ``sm_scale`` and ``group`` (see there)."""

    prefix: Any
    sinks: Any
    k_scale: float | None
    v_scale: float | None
    return_lse: bool
    out: Any


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
    - ``out``: a buffer for the output, contiguous ``[tokens, num_q_heads, v_head_dim]`` in
      q's dtype on q's device, sharing no memory with q or the caches (``InvalidBatchError``
      naming ``"out"`` otherwise). The call returns ``out`` itself (``(out, lse)`` with
      ``return_lse=True``). A backend that declares ``Capabilities.out_buffer`` (every
      built-in one) writes there directly; for any other the core copies the result in.

    >>> buf = torch.empty(2, 4, head_dim)
    >>> with attn_scope(Runner(), batch):
    ...     attention(q, k_cache, v_cache, sm_scale=0.25, out=buf) is buf
    True

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
    # The fast path also takes a call whose only extra is the caller's buffer (a serving
    # engine's every call): the same scale, then the out rule and the write (see _into).
    if run is not None and (not extras or (len(extras) == 1 and extras.get("out") is not None)):
        scale = frame.sm_scale  # type: ignore[union-attr]
        if scale is None:
            # The call's own scale: checked once (float32 normal range, not NaN/None/bool),
            # then recognised by identity.
            scale = sm_scale
            if scale is not frame.scale_ok:  # type: ignore[union-attr]
                scale = frame.scale_ok = frame.rule.scale(sm_scale)  # type: ignore[union-attr]
        elif sm_scale is not None and (sm_scale != scale or type(sm_scale) is bool):
            scale = frame.rule.scale(sm_scale)  # type: ignore[union-attr]
        if extras:
            return _into(frame, (q, k_cache, v_cache, frame.plan, scale), extras["out"], {})  # type: ignore[union-attr]
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
        extras.get("out"),
    )


def _into(frame: Any, args: tuple[Any, ...], out: Any, kw: dict[str, Any]) -> Any:
    """One call with the caller's ``out=`` buffer: the rule's check, then the frame's checked
    handler's ``out_run`` (the backend's callable, or a copy into ``out``)."""
    checked = frame.checked
    frame.rule.check_out(out, args[0], args[1], args[2], checked.out_dim)
    run = checked.out_run
    hook = _call_hook
    if hook is None:
        result = run(*args, out=out, **kw)
    else:
        result = hook(frame, functools.partial(run, out=out, **kw), args)
    return result if result is out else returned_out(result, out, checked.name, frame.rule.who)


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
    raise UsageError("attention(group=...)", problem)


def _no_run(frame: attn_scope) -> Exception:
    if frame.groups is not None:
        names = ", ".join(map(repr, frame.groups))
        return UsageError(
            "attention(group=...)",
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
    out: Any = None,
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
            raise UsageError(
                "attention(prefix=...)",
                f"prefix chunks are only for the 'mha_chunked' form; this batch runs "
                f"{getattr(frame.form, 'value', 'a non-MLA config')!r} (see attention_form())",
            )
        args = (q, k_cache, v_cache, frame.plan, scale, prefix)
    kw = rule.keywords(q, sinks, k_scale, v_scale, return_lse)
    if out is not None:
        return _into(frame, args, out, kw)
    call: Callable[..., Any] = run if not kw else functools.partial(run, **kw)
    hook = _call_hook
    return call(*args) if hook is None else hook(frame, call, args)
