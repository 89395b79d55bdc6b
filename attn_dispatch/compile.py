"""``attention`` inside ``torch.compile(fullgraph=True)``: an opaque custom op.

Dynamo cannot trace ``ContextVar.get``, so a compiled model that calls
``attn_dispatch.attention`` would break its graph at every layer (and ``fullgraph=True`` would
refuse it). This module registers the dispatch as one opaque operator,
``torch.ops.attn_dispatch.attention``, whose body runs at *run time*: it reads the active
scope then, so one compiled function serves every runner and follows whichever runner's
``attn_scope`` is open on each call. Its fake implementation gives the output shape
``[T, Hq, Dv]`` from the inputs alone, which is all the compiler needs.

Importing this module registers the op and tells Dynamo to trace ``attn_dispatch.attention``
as that op (``torch.compiler.substitute_in_graph``), so model code keeps calling ``attention``
and eager calls pay nothing extra. A plain ``import attn_dispatch`` is enough: the package
imports this module when Dynamo loads (``torch.compile`` loads it), or at once when Dynamo is
already loaded (``attn_dispatch._dynamo_hook``); never before, since the core imports no torch
and Dynamo imports triton, which must not load before ``TRITON_INTERPRET`` is chosen. Should
that registration fail, a ``RuntimeWarning`` says so and names the one line that shows the
full error: ``import attn_dispatch.compile``.

>>> import torch
>>> import attn_dispatch  # torch.compile registers the op when it loads Dynamo
>>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, attn_scope, bind
>>> from attn_dispatch import record_dispatch
>>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
>>> class Target:
...     attn_binding = bind("torch", config, label="target")
>>> class Draft:
...     attn_binding = bind("native", config, label="draft")
>>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[5], page_tables=[[0]],
...                         page_size=8)
>>> q, k_cache = torch.randn(1, 4, 16), torch.randn(1, 8, 2, 16)
>>> @torch.compile(fullgraph=True, backend="eager")   # any backend; eager compiles fastest
... def layer(q, k_cache, v_cache):
...     return attention(q, k_cache, v_cache, sm_scale=0.125)
>>> with record_dispatch() as rec:
...     with attn_scope(Target(), batch):
...         out = layer(q, k_cache, k_cache)      # the target's kernel
...     with attn_scope(Draft(), batch):
...         out = layer(q, k_cache, k_cache)      # the draft's kernel, same compiled code
>>> sorted(rec.counts())
[('draft', 'decode', 'native'), ('target', 'decode', 'torch')]
>>> torch.compiler.reset()   # forget the compiled code: this example cleans up after itself

``attention(..., return_lse=True)`` is traced as a second op,
``torch.ops.attn_dispatch.attention_lse``, with the same arguments and two outputs
``(out, lse)`` (lse float32 ``[T, Hq]``): one schema per output arity.

MLA passes ``v_cache=None``, so the value width is not in the shapes: inside a compiled
function call ``attention_op(q, k_cache, None, sm_scale=..., v_head_dim=512)``; a plain
``attention`` call with ``v_cache=None`` runs outside the graph (a graph break, or an error
under ``fullgraph=True`` that names this fix). ``sm_scale`` may be omitted when the bound
``AttnConfig`` carries it, as in eager code.

The op is tagged ``cudagraph_unsafe``: Inductor's own CUDA graphs (``mode="reduce-overhead"``)
must not capture it, because a captured graph bakes in the runner, kernel and plan it saw.
Capture decode steps with :mod:`attn_dispatch.cuda_graph`, which follows that rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import torch

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._scope import AttentionExtras
from attn_dispatch._scope import attention as _scope_attention
from attn_dispatch._values import check_scale

if TYPE_CHECKING:
    # typing.Unpack is Python 3.11+; the package supports 3.10 (typing_extensions has it).
    from typing_extensions import Unpack

__all__ = ["OP_NAME", "attention_op"]

OP_NAME = "attn_dispatch::attention"

_TAGS: tuple[Any, ...] = tuple(
    t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None
)

# Registered with torch.library.Library rather than the @custom_op decorator: in a side-by-side
# probe the decorator's Python wrapper cost about three times as much per eager call (~23 vs
# ~8 us on this machine), and this op has no autograd to offer. FRAGMENT leaves the namespace
# open to other ops (a C++ TORCH_LIBRARY_FRAGMENT, say). The Library object must stay alive with
# the module.
_LIB = torch.library.Library("attn_dispatch", "FRAGMENT")  # type: ignore[no-untyped-call]
_ARGS = (
    "Tensor q, Tensor k_cache, Tensor? v_cache, float? sm_scale, int v_head_dim, "
    "Tensor? sinks=None, float? k_scale=None, float? v_scale=None, str? group=None"
)
_LIB.define(f"attention({_ARGS}) -> Tensor", tags=_TAGS)  # type: ignore[no-untyped-call]
# attention(..., return_lse=True): the state as a second output (one schema per output arity).
_LIB.define(f"attention_lse({_ARGS}) -> (Tensor, Tensor)", tags=_TAGS)  # type: ignore[no-untyped-call]


def _run(
    return_lse: bool,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    sm_scale: float | None,
    v_head_dim: int,
    sinks: torch.Tensor | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    group: str | None = None,
) -> Any:
    # Resolved here, at run time, in the caller's context: never at trace time.
    result = _scope_attention(
        q,
        k_cache,
        v_cache,
        sm_scale=sm_scale,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        group=group,
        **({"return_lse": True} if return_lse else {}),
    )
    out, lse = result if return_lse else (result, None)
    want = (q.shape[0], q.shape[1], v_head_dim)
    if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
        # The compiled graph was built from the fake shape; a different real one would be
        # silently misread by the code after the op.
        raise InvalidBatchError(
            "v_head_dim",
            f"the active backend returned {tuple(out.shape)} {out.dtype} on {out.device}, but "
            f"the compiled graph expects {want} {q.dtype} on {q.device} (v_head_dim="
            f"{v_head_dim!r}); pass the bound config's v_head_dim",
        )
    out = _unaliased(out, q, k_cache, v_cache)
    if lse is None:
        return out
    if tuple(lse.shape) != want[:2] or lse.dtype != torch.float32 or lse.device != q.device:
        raise InvalidBatchError(
            "return_lse",
            f"the active backend returned lse {tuple(lse.shape)} {lse.dtype} on {lse.device}; "
            f"the contract is float32 {want[:2]} on {q.device} (a backend bug: report it)",
        )
    return out, _unaliased(lse, q, k_cache, v_cache)


def _unaliased(t: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    # An operator's output must not alias its inputs; a backend may return a view.
    base = t._base
    if base is not None and any(
        x is not None and base is (x._base if x._base is not None else x) for x in inputs
    ):
        return t.clone()
    return t


def _attention_impl(*args: Any) -> torch.Tensor:
    return _run(False, *args)  # type: ignore[no-any-return]


def _attention_lse_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(True, *args)  # type: ignore[no-any-return]


def _attention_fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: Any, sm_scale: Any, v_head_dim: int, *rest: Any
) -> torch.Tensor:
    # The output shape needs q and v_head_dim only; the other arguments are the schema's.
    return q.new_empty((q.shape[0], q.shape[1], v_head_dim))


def _attention_lse_fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: Any, sm_scale: Any, v_head_dim: int, *rest: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((q.shape[0], q.shape[1], v_head_dim))
    return out, q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


# One implementation for every device: the backend the scope chose does the device work.
for _name, _impl, _fake in (
    ("attention", _attention_impl, _attention_fake),
    ("attention_lse", _attention_lse_impl, _attention_lse_fake),
):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"attn_dispatch::{_name}", _fake, lib=_LIB)


def _value_width(k_cache: Any, v_cache: Any, v_head_dim: int | None) -> int:
    if v_head_dim is not None:
        if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim <= 0:
            raise InvalidBatchError("v_head_dim", f"must be a positive int, got {v_head_dim!r}")
        return v_head_dim
    if v_cache is not None:
        return int(v_cache.shape[-1])
    raise InvalidBatchError(
        "v_head_dim",
        "v_cache is None (MLA), so the output width is not in the tensor shapes; pass "
        "v_head_dim=<the config's v_head_dim> (512 for DeepSeek), e.g. "
        "attn_dispatch.compile.attention_op(q, k_cache, None, sm_scale=s, v_head_dim=512)",
    )


def attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    v_head_dim: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    group: str | None = None,
    return_lse: bool = False,
) -> Any:
    """``attention(...)`` as the opaque op ``torch.ops.attn_dispatch.attention``
    (``attention_lse`` with ``return_lse=True``, which returns ``(out, lse)``).

    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attn_scope, bind
    >>> config = AttnConfig("mla", 4, 1, 24, 16, dtype="float32", device="cpu", page_size=8)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[5], page_tables=[[0]],
    ...                         page_size=8)
    >>> q, k, s = torch.randn(1, 4, 24), torch.randn(1, 8, 24), 24**-0.5
    >>> with attn_scope(Runner(), batch):
    ...     out = torch.compile(lambda q, k: attention_op(q, k, None, sm_scale=s,
    ...                                                    v_head_dim=16), fullgraph=True,
    ...                         backend="eager")(q, k)
    >>> out.shape
    torch.Size([1, 4, 16])
    >>> torch.compiler.reset()

    ``v_head_dim`` defaults to ``v_cache.shape[-1]``; MLA (``v_cache=None``) must pass it.
    ``sm_scale`` defaults to the bound config's; ``sinks``/``k_scale``/``v_scale``/``group``/
    ``return_lse`` are ``attention``'s. Eagerly it costs one trip through the torch
    dispatcher more than ``attention``.
    """
    dv = _value_width(k_cache, v_cache, v_head_dim)
    # The schema takes floats: check the values with the core's rule before any conversion
    # (float(True) or float("2") would pass as numbers the eager call refuses).
    scale = None if sm_scale is None else check_scale("sm_scale", sm_scale)
    if return_lse is not False:
        if return_lse is not True:
            raise InvalidBatchError(
                "return_lse", f"must be a bool (True: return (out, lse)), got {return_lse!r}"
            )
        op = _OP_LSE
    else:
        op = _OP
    if sinks is None and k_scale is None and v_scale is None and group is None:
        return op(q, k_cache, v_cache, scale, dv)
    return op(
        q,
        k_cache,
        v_cache,
        scale,
        dv,
        sinks,
        None if k_scale is None else check_scale("k_scale", k_scale),
        None if v_scale is None else check_scale("v_scale", v_scale),
        group,
    )


_OP = torch.ops.attn_dispatch.attention.default
_OP_LSE = torch.ops.attn_dispatch.attention_lse.default


_NOT_TRACEABLE = (
    "attn_dispatch.attention cannot be traced with v_cache=None and no v_head_dim (MLA: the "
    "output width is not in the tensor shapes) nor with prefix chunks (an iterator); in "
    "compiled code call attn_dispatch.compile.attention_op(q, k_cache, None, sm_scale=..., "
    "v_head_dim=<config.v_head_dim>), and run the mha_chunked form outside the compiled region"
)
# Without fullgraph this is a graph break that runs the plain eager call; with fullgraph it is
# an error that carries the reason above.
_attention_outside_graph = torch.compiler.disable(_scope_attention, reason=_NOT_TRACEABLE)  # type: ignore[no-untyped-call]


def _attention_in_graph(
    q: Any,
    k_cache: Any,
    v_cache: Any = None,
    *,
    sm_scale: float | None = None,
    group: str | None = None,
    **extras: Unpack[AttentionExtras],
) -> Any:
    # What Dynamo traces in place of attn_dispatch.attention (eager calls never come here).
    if extras.get("prefix") is not None or v_cache is None or extras.keys() - _EXTRAS_IN_OP:
        return _attention_outside_graph(
            q, k_cache, v_cache, sm_scale=sm_scale, group=group, **extras
        )
    return attention_op(
        q,
        k_cache,
        v_cache,
        sm_scale=sm_scale,
        sinks=extras.get("sinks"),
        k_scale=extras.get("k_scale"),
        v_scale=extras.get("v_scale"),
        group=group,
        return_lse=extras.get("return_lse", False),
    )


_EXTRAS_IN_OP = frozenset({"sinks", "k_scale", "v_scale", "return_lse"})


# The signature check stays on: compiled and eager `attention` take exactly the same arguments.
torch.compiler.substitute_in_graph(_scope_attention)(_attention_in_graph)
