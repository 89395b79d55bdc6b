"""The rules of one attention call, checked once in the core: every path applies them.

``attention(...)`` (eager and the compiled op) and the handlers a ``Binding`` hands out
(``resolve(phase)``, ``binding.handler(phase)``, ``binding.prepare(batch)``: the direct path
``resolve(phase)(q, k, v, binding.plan(batch), s, **kw)``) all check the softmax scale and
the per-call keywords here, against the bound config, before any backend code runs. Backends
receive only what passed: a float scale in float32's normal range, ``sinks`` (a float32
``[num_q_heads]`` tensor on q's device) only for a sinks config, ``k_scale``/``v_scale``
(floats in range) only for an FP8 cache, ``return_lse=True`` only when the call asked for it
(and the config has ``return_lse=True``), ``out=`` (the caller's output buffer: checked here,
passed to a handler whose backend declares ``Capabilities.out_buffer``, else the result is
copied into it) only when the call gave one. No torch.

>>> import torch
>>> from attn_dispatch import AttnConfig
>>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8,
...                     sm_scale=0.25, sinks=True, return_lse=True)
>>> q, sinks = torch.randn(1, 4, 16), torch.zeros(4)
>>> rule = CallRule.of(config, label="target")
>>> rule.scale(None)                            # the config's sm_scale, or an error
0.25
>>> sorted(rule.keywords(q, sinks, None, None))        # {"sinks": sinks}: a sinks config
['sinks']
>>> sorted(rule.keywords(q, sinks, None, None, True))  # + {"return_lse": True}: an lse config
['return_lse', 'sinks']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._protocol import CORE_CHECKED
from attn_dispatch._protocol import Handler
from attn_dispatch._values import F32_MAX
from attn_dispatch._values import F32_MIN_NORMAL
from attn_dispatch._values import check_out
from attn_dispatch._values import check_scale
from attn_dispatch._values import check_sinks


class CallRule:
    """What one bound config accepts per call (built once per binding or group)."""

    __slots__ = (
        "fp8",
        "heads",
        "lse",
        "mla",
        "plain",
        "planned",
        "sinks",
        "vdim",
        "vdim_mha",
        "who",
    )

    planned: float | None
    sinks: bool
    lse: bool
    fp8: bool
    mla: bool
    heads: int
    # The output's last dim: the config's, and (MLA) the decompressed forms'.
    vdim: int
    vdim_mha: int | None
    who: str
    # True when calls need no keywords (neither sinks nor an FP8 cache): attention()'s fast path.
    # An lse config stays plain: only a call that asks for the state takes return_lse.
    plain: bool

    def __init__(self, config: AttnConfig, who: str) -> None:
        self.planned = config.sm_scale
        self.sinks = config.sinks
        self.lse = config.return_lse
        self.fp8 = config.kv_fp8
        self.mla = config.kind == "mla"
        self.heads = config.num_q_heads
        self.vdim = config.out_head_dim
        self.vdim_mha = config.mha_v_head_dim
        self.who = who
        self.plain = not (self.sinks or self.fp8)

    @classmethod
    def of(
        cls, config: AttnConfig, *, label: str | None = None, group: str | None = None
    ) -> CallRule:
        who = f"runner {label!r}" if label is not None else "this runner"
        if group is not None:
            who += f", group {group!r}"
        return cls(config, who)

    def scale(self, given: Any) -> float:
        """The scale the handler receives: the config's (``given`` must then equal it up to
        float rounding) or ``given`` (float32-representable, > 0)."""
        planned = self.planned
        if planned is None:
            if given is None:
                raise InvalidBatchError(
                    "sm_scale",
                    f"no softmax scale: the call got sm_scale=None and {self.who}'s AttnConfig "
                    "has sm_scale=None; pass attention(..., sm_scale=s) or bind a config with "
                    "AttnConfig(sm_scale=s)",
                )
            if type(given) is float and F32_MIN_NORMAL <= given <= F32_MAX:
                return given
            return check_scale("sm_scale", given)
        if given is None or (given == planned and type(given) is not bool):
            return planned
        value = check_scale("sm_scale", given)
        # Equal up to float rounding (head_dim ** -0.5 vs 1 / math.sqrt(head_dim)) passes, and
        # the planned value is what the handler receives.
        if abs(value - planned) > 1e-6 * planned:
            raise InvalidBatchError(
                "sm_scale",
                f"sm_scale={given!r} differs from the bound AttnConfig.sm_scale {planned!r}, "
                "which the backend planned with; pass the same scale or omit it",
            )
        return planned

    def keywords(
        self, q: Any, sinks: Any, k_scale: Any, v_scale: Any, return_lse: Any = False
    ) -> dict[str, Any]:
        """The keywords the handler takes for this config (only those that apply), checked."""
        kw: dict[str, Any] = {}
        if return_lse is not False:
            if return_lse is True:
                if not self.lse:
                    raise InvalidBatchError(
                        "return_lse",
                        f"{self.who}'s AttnConfig has return_lse=False, so its backends were not "
                        "checked for the attention state; bind a config with "
                        "AttnConfig(return_lse=True) to call attention(..., return_lse=True)",
                    )
                kw["return_lse"] = True
            elif return_lse is not None:
                raise InvalidBatchError(
                    "return_lse", f"must be a bool (True: return (out, lse)), got {return_lse!r}"
                )
        if self.sinks:
            if sinks is None:
                raise InvalidBatchError(
                    "sinks",
                    f"{self.who}'s AttnConfig has sinks=True: pass the layer's sink logits, "
                    "attention(..., sinks=tensor[num_q_heads] float32)",
                )
            check_sinks(sinks, q, self.heads, self.who)
            kw["sinks"] = sinks
        elif sinks is not None:
            raise InvalidBatchError(
                "sinks",
                f"{self.who}'s AttnConfig has sinks=False, so the layer has no sink logits; "
                "drop sinks= or bind a config with AttnConfig(sinks=True)",
            )
        if self.fp8:
            kw["k_scale"] = 1.0 if k_scale is None else check_scale("k_scale", k_scale)
            if not self.mla:
                kw["v_scale"] = 1.0 if v_scale is None else check_scale("v_scale", v_scale)
            elif v_scale is not None:
                raise InvalidBatchError(
                    "v_scale",
                    f"got {v_scale!r}, but an MLA layer's k_scale covers the whole latent (V is "
                    "part of it); pass k_scale only",
                )
        else:
            for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
                if value is not None:
                    raise InvalidBatchError(
                        name,
                        f"got {value!r}, but {self.who}'s kv_dtype is not FP8; scales apply "
                        "only to kv_dtype 'float8_e4m3fn' / 'float8_e5m2'",
                    )
        return kw

    def check_out(self, out: Any, q: Any, k_cache: Any, v_cache: Any, vdim: int) -> None:
        """Raise ``InvalidBatchError("out", ...)`` unless ``out`` can receive this call's
        output (``attn_dispatch._values.out_problem``): ``[q rows, num_q_heads, vdim]``,
        q's dtype and device, contiguous, sharing no memory with q or the caches."""
        check_out(out, q, k_cache, v_cache, self.heads, vdim, self.who)


class CopyOut:
    """A handler whose backend does not declare ``Capabilities.out_buffer``, called with
    ``out=``: the handler's own result is copied into ``out`` (one copy), and ``out`` is
    returned in its place (``(out, lse)`` with ``return_lse=True``)."""

    __slots__ = ("__wrapped__",)

    __wrapped__: Callable[..., Any]

    def __init__(self, run: Callable[..., Any]) -> None:
        self.__wrapped__ = run

    def __call__(self, *args: Any, out: Any, **kw: Any) -> Any:
        result = self.__wrapped__(*args, **kw)
        if type(result) is tuple:
            out.copy_(result[0])
            return (out, *result[1:])
        out.copy_(result)
        return out

    def __repr__(self) -> str:
        return f"<copied into out= {self.__wrapped__!r}>"


def returned_out(result: Any, out: Any, name: str, who: str) -> Any:
    """``result`` of a handler called with ``out=``, once it is checked to be ``out`` itself
    (``(out, lse)`` with ``return_lse=True``); callers test ``result is out`` first."""
    if type(result) is tuple and result and result[0] is out:
        return result
    if result is out:
        return result
    raise InvalidBatchError(
        "out",
        f"{who}: backend {name!r} declares Capabilities(out_buffer=True) but its handler "
        "returned a tensor other than the out= it was given (a backend bug: report it)",
    )


class CheckedHandler:
    """A backend's handler behind the call rules: what a Binding hands out for the direct
    path (``resolve(phase)(q, k, v, plan, sm_scale, **kw)``).

    ``attention()`` checks the same rules itself and calls the backend's callable directly
    (``Route.raw``). Attributes other than the call are the backend callable's.
    """

    __slots__ = ("__wrapped__", "name", "out_dim", "out_run", "rule")

    __wrapped__: Callable[..., Any]
    rule: CallRule
    # What a call with out= runs, only after ``rule.check_out`` (and the scale and keyword
    # rules) passed for that call: the backend's callable or its ``CORE_CHECKED`` variant, or
    # CopyOut of it; and out's last dim.
    out_run: Callable[..., Any]
    out_dim: int
    name: str

    def __init__(
        self,
        run: Callable[..., Any],
        rule: CallRule,
        out_run: Callable[..., Any] | None = None,
        out_dim: int | None = None,
        name: str = "",
    ) -> None:
        self.__wrapped__ = run  # inspect.signature reads the backend callable's signature
        self.rule = rule
        self.out_run = out_run if out_run is not None else CopyOut(run)
        self.out_dim = out_dim if out_dim is not None else rule.vdim
        self.name = name

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        plan: Any,
        sm_scale: Any,
        /,
        *rest: Any,
        sinks: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        return_lse: Any = False,
        out: Any = None,
    ) -> Any:
        rule = self.rule
        scale = rule.scale(sm_scale)
        if (
            rule.plain
            and sinks is None
            and k_scale is None
            and v_scale is None
            and return_lse is False
        ):
            if out is None:
                return self.__wrapped__(q, k, v, plan, scale, *rest)
            rule.check_out(out, q, k, v, self.out_dim)
            result = self.out_run(q, k, v, plan, scale, *rest, out=out)
        else:
            kw = rule.keywords(q, sinks, k_scale, v_scale, return_lse)
            if out is None:
                return self.__wrapped__(q, k, v, plan, scale, *rest, **kw)
            rule.check_out(out, q, k, v, self.out_dim)
            result = self.out_run(q, k, v, plan, scale, *rest, out=out, **kw)
        return result if result is out else returned_out(result, out, self.name, rule.who)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<checked {self.__wrapped__!r}>"


def checked_handler(
    run: Callable[..., Any],
    rule: CallRule,
    *,
    name: str = "",
    takes_out: bool = False,
    out_dim: int | None = None,
) -> Handler:
    """``run`` behind the call rules (see ``CheckedHandler``). ``takes_out``: the backend
    (``name``) declares ``Capabilities.out_buffer``, so a call with ``out=`` passes it on (to
    ``run``'s ``CORE_CHECKED`` variant when it has one: every caller of ``out_run`` checked
    the call first); otherwise the result is copied into it (``CopyOut``). ``out_dim``: out's
    last dim (default the config's; an MLA decompressed form's own)."""
    if takes_out:
        variant = getattr(run, CORE_CHECKED, None)
        out_run = variant if callable(variant) else run
    else:
        out_run = CopyOut(run)
    return CheckedHandler(run, rule, out_run, out_dim, name)
