"""The ``sdpa`` backend: PyTorch's fused attention over the paged-KV contract.

Per forward, ``plan`` turns the batch into fused calls (``_planner``: which requests share a
call, and the key parts of each); per layer call the handler gathers the pages those calls
read (``_gather``), runs them (``_fused``) and merges parts and sinks through the LSE in
fp32: ``out * sigmoid(lse - sink)``, ``lse' = logaddexp(lse, sink)``. A request whose pages
follow each other in the cache is read in place, as a view, where that layout is as fast
(``in_place="auto"``: on CUDA, and on CPU when the cache has one KV head, where rows are
head-major already). The decompressed chunked-prefix MLA form lives in ``_chunked``.

A plan is a handle (``SdpaPlan``: immutable summaries only); what the handler reads stays in
the backend object's own table (``PrivatePlans``), so no edit of an issued plan reaches
a kernel. Every call is checked like every backend's (``TensorChecks``: shapes, dtypes,
devices, pages against the cache given), and every view the kernels read is checked against
the extent of the tensor it views (``_fused.rows_of``), never its storage's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

import torch

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import Handler
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import Phase
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import PrivatePlans
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backends.sdpa._chunked import run_chunked
from attn_dispatch.backends.sdpa._fused import Source
from attn_dispatch.backends.sdpa._fused import fused
from attn_dispatch.backends.sdpa._fused import merge
from attn_dispatch.backends.sdpa._fused import rows_of
from attn_dispatch.backends.sdpa._fused import widen
from attn_dispatch.backends.sdpa._fused import with_sinks
from attn_dispatch.backends.sdpa._gather import Buffers
from attn_dispatch.backends.sdpa._gather import Gather
from attn_dispatch.backends.sdpa._planner import MASK_MAX_ELEMENTS
from attn_dispatch.backends.sdpa._planner import WINDOW_BLOCK
from attn_dispatch.backends.sdpa._planner import Extend
from attn_dispatch.backends.sdpa._planner import Planner
from attn_dispatch.backends.sdpa._planner import Steps

if TYPE_CHECKING:
    from attn_dispatch import AttnBatch

__all__ = ["MASK_MAX_ELEMENTS", "WINDOW_BLOCK", "SdpaBackend", "SdpaPlan"]

_EXTENDS = ("auto", "split", "mask")
InPlace = bool | Literal["auto"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SdpaPlan(PlanBase):
    """One forward's plan, made by ``SdpaBackend.plan`` and accepted only by that object.

    A handle: its fields are immutable summaries (for ``record_dispatch`` and tests); the
    handler reads the backend's private record of the plan, never these. ``call_counts`` and
    ``call_parts``: requests and key parts per fused call; ``in_place``: requests read in
    place; ``gathered``: the page indices gathered (None on CUDA, where they stay on the
    device). ``token`` is an object no copy can reproduce: a CUDA-graph replay re-plans
    through ``update_plan``, never by copying fields.
    """

    phase: Phase
    num_tokens: int
    call_counts: tuple[int, ...]
    call_parts: tuple[int, ...]
    in_place: int
    num_gathered: int
    gathered: tuple[int, ...] | None
    token: object = dataclasses.field(default_factory=object)

    @property
    def dispatch_note(self) -> str | None:
        """What ``record_dispatch`` shows beside the call."""
        return f"{len(self.call_counts)} sdpa calls, {self.num_gathered} pages gathered"


class SdpaBackend(BackendBase):
    """Paged attention through ``scaled_dot_product_attention``, CPU and CUDA.

    Options: ``extend`` ("auto", "split" or "mask": how a causal block after a cached prefix
    runs, see ``_planner``), ``window_block`` (query rows per masked window call),
    ``in_place`` (read requests whose pages follow each other without gathering: ``"auto"``
    where the kernel reads the cache's layout as fast as gathered K/V, True always, False
    never), ``validate`` (CUDA: read page indices back at plan time to check them; otherwise
    they are clamped into the cache given at each call).
    """

    name = "sdpa"

    def __init__(
        self,
        config: AttnConfig,
        *,
        extend: Extend = "auto",
        window_block: int = WINDOW_BLOCK,
        in_place: InPlace = "auto",
        validate: bool = False,
    ) -> None:
        if extend not in _EXTENDS:
            raise InvalidSpecError("extend", extend, f"choose one of {_EXTENDS!r}")
        if isinstance(window_block, bool) or not isinstance(window_block, int) or window_block < 1:
            raise InvalidSpecError("window_block", window_block, "must be a positive int")
        if not isinstance(validate, bool):
            raise InvalidSpecError("validate", validate, "must be True or False")
        if not isinstance(in_place, bool) and in_place != "auto":
            raise InvalidSpecError("in_place", in_place, "must be True, False or 'auto'")
        if config.logit_cap:
            raise InvalidSpecError(
                "logit_cap", config.logit_cap, "the sdpa backend serves no logit soft-cap"
            )
        self.config = config
        self.extend = extend
        self.window_block = window_block
        self.validate = validate
        self.mla = config.kind == "mla"
        self.q_dtype: torch.dtype = getattr(torch, config.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, str(config.kv_dtype))
        self.fp8 = config.kv_fp8
        # The dtype the fused op computes in: q's, unless the cache holds another 16/32-bit
        # type (then fp32, so neither side is rounded); FP8 is widened to q's dtype.
        self.dtype: torch.dtype = (
            self.q_dtype if self.fp8 or self.kv_dtype == self.q_dtype else torch.float32
        )
        self.hq, self.hkv = config.num_q_heads, config.num_kv_heads
        self.d, self.dv = config.head_dim, int(config.out_head_dim)
        # One head size for q, k and v (the CPU flash op takes one): MLA's V is the first dv
        # columns of the latent, so K itself serves as V and the output is cut to dv.
        self.e = self.d if self.mla else max(self.d, self.dv)
        self.h_cache = 1 if self.mla else self.hkv
        convert = self.kv_dtype != self.dtype
        self.k_direct = not convert and self.d == self.e
        self.v_direct = self.mla or (not convert and self.dv == self.e)
        self.q_direct = self.q_dtype == self.dtype and self.d == self.e
        self.device_type = config.device_type
        # On CPU the flash kernel ran 1.3-2x slower on the cache's [rows, heads, e] view than
        # on head-major K/V, more than the gather it saves (bench/sdpa_notes.md); with one
        # KV head the cache's rows are head-major already.
        fast_view = self.device_type != "cpu" or self.h_cache == 1
        wanted = fast_view if in_place == "auto" else in_place
        self.in_place = wanted and self.k_direct and self.v_direct
        self.checks = TensorChecks.of(config, backend="sdpa", layout="rows")
        self.planner = Planner(config, extend, window_block, self.in_place, self.dtype)
        self._gather = Gather(config.page_size, self.h_cache, self.e, self.dtype, self.device_type)
        self._buffers = Buffers()
        self._plans: PrivatePlans[Steps] = PrivatePlans("sdpa")

    # -- planning (once per forward) ----------------------------------------------------------

    def _steps(self, batch: AttnBatch) -> Steps:
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self.validate)
        return self.planner.steps(snap)

    def plan(self, batch: AttnBatch) -> SdpaPlan:
        steps = self._steps(batch)
        handle = SdpaPlan(
            phase=steps.snap.phase,
            num_tokens=steps.num_tokens,
            call_counts=tuple(c.count for c in steps.calls),
            call_parts=tuple(len(c.parts) for c in steps.calls),
            in_place=steps.in_place,
            num_gathered=steps.pages.numel(),
            gathered=steps.gathered,
        )
        return self._plans.issue(self, handle, steps)

    def update_plan(self, plan: SdpaPlan, batch: AttnBatch) -> None:
        """Re-plan ``batch`` into ``plan`` (``cuda_graph``'s replay; on CPU it runs eagerly).
        The batch must keep the plan's phase and token count (what the graph's q holds)."""
        self._plans.get(plan, self)
        steps = self._steps(batch)
        if steps.snap.phase is not plan.phase or steps.num_tokens != plan.num_tokens:
            raise InvalidBatchError(
                "batch",
                f"sdpa: a {steps.snap.phase.name} batch of {steps.num_tokens} tokens into a "
                f"plan for {plan.phase.name} with {plan.num_tokens}; plan it anew",
            )
        self._plans.replace(plan, self, steps)

    # -- per layer ----------------------------------------------------------------------------

    def handler(self, phase: Phase) -> Handler:
        return functools.partial(self._forward, Phase(phase))

    def _forward(
        self,
        phase: Phase,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        plan: Any,
        sm_scale: float,
        /,
        *,
        sinks: Any = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        return_lse: bool = False,
        out: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        steps = self._plans.get(plan, self)
        snap = steps.snap
        if snap.phase is not phase:
            raise InvalidBatchError(
                "phase", f"the plan is for {snap.phase.name}, this handler serves {phase.name}"
            )
        num_pages = self.checks.check(snap, q, k_cache, v_cache)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache is not None and not cache.is_contiguous():
                raise InvalidBatchError(name, "sdpa: must be contiguous (call .contiguous())")
        self.checks.check_keywords(q, sinks=sinks, return_lse=return_lse)  # every backend's
        scale, ks, vs = self.checks.check_scales(sm_scale, k_scale, v_scale, fp8=self.fp8)
        if out is not None:
            self.checks.check_out(out, q, k_cache, v_cache)
        if steps.num_tokens == 0:
            if out is None:
                out = q.new_empty((0, self.hq, self.dv))
            if return_lse:
                return out, torch.empty(0, self.hq, dtype=torch.float32, device=q.device)
            return out  # type: ignore[no-any-return]
        pages = steps.pages
        if steps.max_page is None and pages.numel():
            # Page indices never read on the host (CUDA without validate): keep every gather
            # inside this call's cache; an out-of-range index gives wrong numbers, not a fault.
            pages = pages.clamp(0, max(num_pages - 1, 0))
        gather = functools.partial(self._gather.pages, self._buffers)
        kbuf = gather("k", k_cache, pages, steps.runs, self.d, ks, self.k_direct)
        vbuf = kbuf
        if not self.mla:
            vbuf = gather("v", v_cache, pages, steps.runs, self.dv, vs, self.v_direct)
        h, e = self.h_cache, self.e
        kflat: Source | None = None
        vflat: Source | None = None
        if steps.in_place:  # the cache itself, [rows, heads, e]
            kflat = (k_cache, h, e, h * e)
            vflat = kflat if self.mla else (v_cache, h, e, h * e)
        qc = q if self.q_direct else widen(q, self.d, self.e, self.dtype)
        result = self._attend(
            steps, qc, (kbuf, kflat), (vbuf, vflat), scale, sinks, return_lse, out
        )
        # The contract: NaN in a query row gives NaN in that row (out and lse), in every
        # backend. The CPU flash kernel's running max skips a NaN score and returns the row
        # as if the query were finite, so the rows are marked here. First one reduction with
        # no temporary: a NaN in q makes the sum NaN, so a sum that is not NaN proves q has
        # none; only a NaN sum (NaN in q, or +inf meeting -inf) looks row by row.
        if bool(q.sum().isnan()):
            bad = q.isnan().any(dim=-1)
            res, lse = result if isinstance(result, tuple) else (result, None)
            res.masked_fill_(bad.unsqueeze(-1), math.nan)
            if lse is not None:
                lse.masked_fill_(bad, math.nan)
        return result

    def _attend(
        self,
        steps: Steps,
        q: torch.Tensor,
        keys: tuple[Source, Source | None],
        values: tuple[Source, Source | None],
        scale: float,
        sinks: torch.Tensor | None,
        return_lse: bool,
        dest: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hq, e, dv = self.hq, self.e, self.dv
        t = steps.num_tokens
        calls = steps.calls
        # One SDPA call over every row returns its own tensor (made contiguous if need be);
        # a caller's buffer (dest) takes each call's rows instead: SDPA has no out= itself.
        one = (
            dest is None
            and len(calls) == 1
            and len(calls[0].parts) == 1
            and calls[0].count * calls[0].n == t
        )
        need_lse = return_lse or sinks is not None
        grouped = self.hq != self.hkv
        out: torch.Tensor | None = dest
        lse_out: torch.Tensor | None = None
        if not one:
            if out is None:
                out = torch.empty(t, hq, dv, dtype=self.q_dtype, device=q.device)
            if return_lse:
                lse_out = torch.empty(t, hq, dtype=torch.float32, device=q.device)
        for call in calls:
            m = call.count * call.n
            qv = q[call.q0 : call.q0 + m].reshape(call.count, call.n, hq, e).transpose(1, 2)
            merged = len(call.parts) > 1
            o_acc: torch.Tensor | None = None
            l_acc: torch.Tensor | None = None
            for part in call.parts:
                kv = rows_of(keys[call.source], call, part, e)
                vv = rows_of(values[call.source], call, part, e)
                o, lse = fused(
                    self.device_type, grouped, qv, kv, vv, part, scale, need_lse or merged
                )
                if o_acc is None or l_acc is None or lse is None:
                    o_acc, l_acc = o, lse
                    continue
                o_acc, l_acc = merge(o_acc, l_acc, o, lse)
            assert o_acc is not None
            if sinks is not None:
                assert l_acc is not None
                o_acc, l_acc = with_sinks(o_acc, l_acc, sinks)
            rows_o = o_acc.transpose(1, 2).reshape(m, hq, e)
            if one:
                res = rows_o if dv == e else rows_o[..., :dv]
                if res.dtype != self.q_dtype or not res.is_contiguous():
                    res = res.to(self.q_dtype).contiguous()
                if not return_lse:
                    return res
                assert l_acc is not None
                return res, l_acc.transpose(1, 2).reshape(m, hq).float().contiguous()
            assert out is not None
            out[call.q0 : call.q0 + m].copy_(rows_o if dv == e else rows_o[..., :dv])
            if lse_out is not None:
                assert l_acc is not None
                lse_out[call.q0 : call.q0 + m].copy_(l_acc.transpose(1, 2).reshape(m, hq))
        assert out is not None
        return (out, lse_out) if lse_out is not None else out

    # -- the decompressed, chunked-prefix form of MLA layers ------------------------------------

    def chunked_handler(self, phase: Phase) -> Any:
        """Handler of ``AttnForm.MHA_CHUNKED``: ``run(q, k_new, v_new, batch, sm_scale,
        prefix)``; the prefix chunks and the new tokens are parts merged by their LSE."""
        return self.run_chunked

    def run_chunked(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        batch: AttnBatch,
        sm_scale: float,
        prefix: Iterable[tuple[torch.Tensor, torch.Tensor, Sequence[int]]] | None = None,
        *,
        sinks: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return run_chunked(self, q, k_new, v_new, batch, sm_scale, prefix, sinks, return_lse)
