"""FlashInfer backend: adapters from attn_dispatch's paged-KV contract to FlashInfer.

Heavy module: imports torch and flashinfer. The registry imports it only at ``bind``,
after the capability checks in ``attn_dispatch.backends.flashinfer`` have passed.

Routes (one FlashInfer wrapper family each):

- MHA PREFILL, VERIFY: ``BatchPrefillWithPagedKVCacheWrapper``; causal (bottom-right)
  without a mask, ``custom_mask`` for a verify tree (its flat per-request
  ``[q_len, kv_len]`` row-major layout is exactly ours). Also MHA DECODE when
  ``head_dim != v_head_dim`` (the decode wrapper has a single head dim).
- MHA DECODE: ``BatchDecodeWithPagedKVCacheWrapper``, tensor cores for grouped-query
  attention with a group of 4 or more (or a group size its CUDA-core kernel lacks).
- MHA cascade (any phase, where the batch shares leading pages; see ``cascade_groups``):
  ``MultiLevelCascadeAttentionWrapper`` with two levels, the shared pages read once per group
  of requests, then each request's own pages, merged by FlashInfer.
- MLA PREFILL, DECODE, VERIFY (causal chain): ``BatchMLAPagedAttentionWrapper`` planned
  with ``metadata=MLAPlanMetadata.csr(...)``; packed query ``[T, H, ckv+kpe]`` and packed
  latent cache ``[P, page_size, ckv+kpe]`` (our absorbed layout as is).

Variants: ``window_left`` and ``logit_cap`` go to the MHA plans as ``window_left`` (-1 = full)
and ``logits_soft_cap`` (0 = off); an FP8 cache plans with ``kv_data_type`` and runs with
``k_scale``/``v_scale`` (MHA) or, MLA e4m3fn on SM90, ``scale_mode="kv-per-tensor"`` and
``ckv_scale = kpe_scale = k_scale``. Sinks, and window / cap for MLA, are refused at bind (see
the light module's ``_check_variants``). ``causal=False`` plans prefill and verify with
``causal=False`` (MHA and MLA); ``attention_chunk_size`` is refused at bind.

LSE (``return_lse=True`` per call): FlashInfer's kernels compute base-2 log-sum-exps (they fold
log2(e) into the scale). The prefill wrapper converts when asked (``lse_base="ln"``), the MLA
wrapper too (planned ``lse_mode="basee"``, run ``return_lse_base_on_e=True``); the decode
wrapper returns base 2 from every backend it runs (its cuDNN path converts to base 2 itself),
so its lse is multiplied by ln 2 here.

Example (needs a CUDA GPU)::

    from attn_dispatch import AttnConfig, BackendSpec, bind
    cfg = AttnConfig(kind="mla", num_q_heads=16, num_kv_heads=1, head_dim=576,
                     v_head_dim=512, dtype="bfloat16", page_size=64, device="cuda")
    binding = bind(BackendSpec.uniform("flashinfer"), cfg)

Layout: ``_keywords`` (every keyword passed to FlashInfer), ``_tables`` (page tables and cascade
levels), ``_routes`` (one class per wrapper family), ``attn_dispatch.backends._cascade`` (the
cascade planner, pure Python, shared with the native backend's rule); this module holds the
backend object and its plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

import torch

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BackendUnavailableError
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import IncompatibleBackendError
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import Phase
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backend import check_plan
from attn_dispatch.backend import issue_plan
from attn_dispatch.backends import _cascade
from attn_dispatch.backends._cascade import CascadeGroups
from attn_dispatch.backends._cascade import cascade_groups
from attn_dispatch.backends.flashinfer import CAPABILITIES
from attn_dispatch.backends.flashinfer._keywords import WRAPPER_KEYWORDS
from attn_dispatch.backends.flashinfer._routes import NO_EXTRA
from attn_dispatch.backends.flashinfer._routes import CascadeRoute
from attn_dispatch.backends.flashinfer._routes import DecodeRoute
from attn_dispatch.backends.flashinfer._routes import MLARoute
from attn_dispatch.backends.flashinfer._routes import PrefillRoute
from attn_dispatch.backends.flashinfer._routes import Route
from attn_dispatch.backends.flashinfer._tables import Levels
from attn_dispatch.backends.flashinfer._tables import PageTable
from attn_dispatch.backends.flashinfer._tables import cascade_levels
from attn_dispatch.backends.flashinfer._tables import page_table

if TYPE_CHECKING:
    from attn_dispatch import AttnBatch

__all__ = [
    "CASCADE_MIN_SAVED_FRACTION",
    "CASCADE_MIN_SHARED_KEYS",
    "WRAPPER_KEYWORDS",
    "CascadeGroups",
    "FlashInferBackend",
    "FlashInferPlan",
    "cascade_groups",
]

Handler = Callable[..., Any]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {
    **_DTYPES,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: Group sizes FlashInfer's CUDA-core decode kernel is instantiated for

#: The cascade rule's thresholds for this backend (``attn_dispatch.backends._cascade``,
#: ``FLASHINFER``): a cascade runs only when it saves at least this fraction of the key/value
#: reads of the plain plan (a cascade costs two kernels and a merge per layer instead of one;
#: FlashInfer's docstring warns that more levels are not always faster), and a group shares
#: at least this many keys. Read at each plan (tests change them).
CASCADE_MIN_SAVED_FRACTION = _cascade.FLASHINFER.min_saved_fraction
CASCADE_MIN_SHARED_KEYS = _cascade.FLASHINFER.min_shared_keys


@dataclass(frozen=True, slots=True, eq=False)
class FlashInferPlan(PlanBase):
    """What ``FlashInferBackend.plan`` returns: accepted only by the backend object in
    ``owner``, and only while its wrapper still holds this plan (a later ``plan`` of the
    same wrapper supersedes it). ``sm_scale`` is the scale FlashInfer baked in; a call with
    another scale is refused (FlashInfer cannot change it without re-planning).
    ``cascade``: what a cascade plan shares (None: the plain plan ran)."""

    owner: FlashInferBackend
    snap: BatchSnapshot
    route: Route
    wrapper: Any
    sm_scale: float
    ticket: object
    cascade: CascadeGroups | None = None

    @property
    def dispatch_note(self) -> str | None:
        """What ``record_dispatch`` shows beside the call: the cascade, when it ran."""
        return None if self.cascade is None else f"cascade: {self.cascade}"


def _check_config(config: AttnConfig) -> None:
    """Refuse a config FlashInfer cannot serve in any phase (machine, install, dtype,
    dims). ``bind`` has checked the bound phases already; this guards direct
    construction. Phase-specific reasons are checked when a phase's handler is built."""
    per_phase = [CAPABILITIES.reasons(config, p) for p in Phase]
    common = [r for r in per_phase[0] if all(r in other for other in per_phase[1:])]
    if common:
        raise BackendUnavailableError("flashinfer", f"cannot run {config!r}: " + "; ".join(common))


def _check_phase(config: AttnConfig, phase: Phase) -> None:
    reasons = CAPABILITIES.reasons(config, phase)
    if reasons:
        raise IncompatibleBackendError(None, {phase: ("flashinfer", reasons)}, config=config)


def _device_for(config: AttnConfig) -> torch.device:
    return torch.device(config.device)


class FlashInferBackend(BackendBase):
    """Attention through FlashInfer's paged wrappers, for one model runner.

    Owns its workspace (one per runner, never shared: two runners planning into one
    workspace would overwrite each other's schedule) and its wrappers.

    Options:
      use_cuda_graph: keep persistent index buffers and one graph-mode wrapper per batch
        size, so ``run`` can be captured and replayed; ``plan`` is never captured.
      max_batch_size, max_num_pages: sizes of those persistent buffers (graph mode).
      max_mask_bytes: bytes of the packed verify-tree mask buffer (graph mode, MHA).
      workspace_bytes: float workspace size (default 128 MiB, FlashInfer's advice).
      sm_scale: the softmax scale to plan with (default: the config's ``sm_scale``, else
        1/sqrt(head_dim)). FlashInfer fixes the scale at ``plan``, so a call passing another
        scale is refused with ``InvalidBatchError`` (field ``sm_scale``), never re-planned
        inside the layer loop.
      validate: read the batch's device index tensors back at plan time and check them on
        the host (a device sync per forward; for debugging). Without it, page indices are
        clamped into the cache on the device (FlashInfer's kernels do not bound them).
      prefill_backend, decode_backend, mla_backend: FlashInfer's own backend names
        (default "auto": FlashInfer picks among the kernels that serve the plan).
      decode_tensor_cores: force tensor-core decode on or off (default: GQA group >= 4).
      cascade: plan FlashInfer's two-level cascade when requests share leading pages (see
        ``_cascade`` for where; default True). ``False``: always the plain wrappers.

    On a CUDA device (``bind(..., options={"flashinfer": {...}})`` passes the options):

    ```python
    cfg = AttnConfig("mha", 32, 8, 128, dtype="bfloat16", page_size=64, device="cuda",
                     sm_scale=128**-0.5)
    backend = FlashInferBackend(cfg, use_cuda_graph=True, max_batch_size=64)
    ```

    Elsewhere it refuses, with every reason (``bind`` gives them before building anything):

    >>> cfg = AttnConfig("mha", 32, 8, 128, dtype="bfloat16", page_size=64, device="cpu")
    >>> FlashInferBackend(cfg)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attn_dispatch.BackendUnavailableError: attention backend 'flashinfer' is unavailable: ...
    """

    name = "flashinfer"

    def __init__(
        self,
        config: AttnConfig,
        *,
        use_cuda_graph: bool = False,
        max_batch_size: int = 256,
        max_num_pages: int | None = None,
        max_mask_bytes: int = 16 << 20,
        workspace_bytes: int = 128 << 20,
        sm_scale: float | None = None,
        prefill_backend: str = "auto",
        decode_backend: str = "auto",
        mla_backend: str = "auto",
        decode_tensor_cores: bool | None = None,
        validate: bool = False,
        cascade: bool = True,
    ) -> None:
        _check_config(config)
        # Flags are Python bools (numpy and torch bools, ints and strings are refused), the
        # rule every backend and AttnConfig follow.
        for flag, value in (
            ("cascade", cascade),
            ("validate", validate),
            ("use_cuda_graph", use_cuda_graph),
        ):
            if not isinstance(value, bool):
                raise InvalidSpecError(flag, value, "must be a bool (True or False)")
        if decode_tensor_cores is not None and not isinstance(decode_tensor_cores, bool):
            raise InvalidSpecError(
                "decode_tensor_cores", decode_tensor_cores, "must be a bool, or None for automatic"
            )
        self.config = config
        self.device = _device_for(config)
        self.q_dtype = _DTYPES[config.dtype]
        self.kv_dtype = _KV_DTYPES[config.kv_dtype or config.dtype]
        self.kv_fp8 = self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.lse = config.return_lse
        self.use_cuda_graph = use_cuda_graph
        self.max_batch_size = max_batch_size
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.mla_backend = mla_backend
        self.decode_tensor_cores = decode_tensor_cores
        self.cascade = cascade
        # zeros, not empty: FlashInfer asks for a zeroed float workspace on first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Graph mode: plan() refills the persistent buffers of one wrapper per batch size,
        # so a captured graph follows each new plan (cuda_graph reads this flag).
        self.plans_in_place = use_cuda_graph
        self.graph_indices: torch.Tensor | None = None
        self.graph_mask: torch.Tensor | None = None
        if use_cuda_graph:
            if max_num_pages is None:
                raise InvalidSpecError(
                    "max_num_pages",
                    None,
                    "flashinfer with use_cuda_graph=True needs the capacity of its persistent "
                    "kv_indices buffer, e.g. the KV pool's page count",
                )
            # One index buffer shared by every graph-mode wrapper of this runner: only
            # one forward plans at a time, and each captured graph reads the buffer its
            # plan refilled.
            self.graph_indices = torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
            if config.tree_verify:
                self.graph_mask = torch.zeros(max_mask_bytes, dtype=torch.uint8, device=self.device)
        planned = config.sm_scale
        if sm_scale is not None and planned is not None and sm_scale != planned:
            raise InvalidSpecError(
                "sm_scale",
                sm_scale,
                f"differs from the config's sm_scale={planned!r}; give the scale once, in "
                "AttnConfig(sm_scale=...)",
            )
        chosen = sm_scale if sm_scale is not None else planned
        self.sm_scale: float = (
            float(chosen) if chosen is not None else 1.0 / math.sqrt(config.head_dim)
        )
        self.validate = validate
        self.max_num_pages = max_num_pages
        self._checks = TensorChecks.of(
            config,
            backend="flashinfer",
            layout="rows",
            q_dtype=self.q_dtype,
            kv_dtype=self.kv_dtype,
            device_type=self.device.type,
        )
        self._routes: dict[Phase, Route] = {}
        self._cascade_route: CascadeRoute | None = None
        # Whether this config can cascade at all (the batch decides the rest, per plan).
        self._may_cascade = (
            cascade
            and not use_cuda_graph  # the cascade wrapper's graph mode needs per-level buffers
            and config.kind == "mha"
            and config.head_dim == config.v_head_dim  # its plan takes one head_dim
            and config.window_left is None  # a window is positional; levels shift positions
            and not self.kv_fp8  # its run() takes no k_scale / v_scale
            and not self.lse  # its run() returns no lse
        )

    # -- routes ------------------------------------------------------------------------

    def _route(self, phase: Phase) -> Route:
        route = self._routes.get(phase)
        if route is None:
            route = self._make_route(phase)
            self._routes[phase] = route
        return route

    def _make_route(self, phase: Phase) -> Route:
        cfg = self.config
        if cfg.kind == "mla":
            # Prefill and verify share one causal wrapper (one plan per forward anyway).
            if phase is not Phase.DECODE:
                for other, r in self._routes.items():
                    if other is not Phase.DECODE:
                        return r
            return MLARoute(self, causal=phase is not Phase.DECODE and cfg.causal)
        if phase is Phase.DECODE and cfg.head_dim == cfg.v_head_dim:
            return DecodeRoute(self)
        for r in self._routes.values():
            if isinstance(r, PrefillRoute):
                return r
        return PrefillRoute(self)

    def _cascade(
        self, snap: BatchSnapshot, table: PageTable
    ) -> tuple[CascadeGroups, Levels] | None:
        """What a cascade of this batch would share and its levels, or None where the plain
        plan runs: the config must allow it (``_may_cascade``), the page ids must be on the
        host without a device sync (a CPU batch, or ``validate=True``, which reads them back
        anyway), the batch must have no custom mask and a query in every request, every
        request a whole page before its first query (no level may be empty for a request:
        FlashInfer's handling of empty requests has had NaN bugs), and the groups must save
        at least ``CASCADE_MIN_SAVED_FRACTION`` of the key reads (the cascade rule:
        ``attn_dispatch.backends._cascade``)."""
        if not self._may_cascade or snap.custom_mask is not None or snap.num_requests < 2:
            return None
        if snap.kv_indices.is_cpu:
            pages = table.kv_indices.tolist()
        elif self.validate:
            pages = table.kv_indices.cpu().tolist()
        else:
            return None
        q_lens = (table.qo_indptr[1:] - table.qo_indptr[:-1]).tolist()
        kv_lens = table.kv_lens.tolist()
        ps = self.config.page_size
        if min(q_lens) < 1 or any(kv - q < ps for q, kv in zip(q_lens, kv_lens, strict=True)):
            return None
        rule = _cascade.CascadeRule(
            min_shared_keys=CASCADE_MIN_SHARED_KEYS,
            min_saved_fraction=CASCADE_MIN_SAVED_FRACTION,
            own_keys=_cascade.FLASHINFER.own_keys,
        )
        indptr = table.kv_indptr.tolist()
        groups = cascade_groups(q_lens, kv_lens, indptr, pages, ps, rule)
        info = _cascade.plan_cascade(q_lens, kv_lens, indptr, pages, ps, rule, groups=groups)
        if info is None:
            return None
        return info, cascade_levels(table, groups, ps)

    # -- protocol ----------------------------------------------------------------------

    def plan(self, batch: AttnBatch) -> FlashInferPlan:
        """Plan the wrapper serving ``batch.phase``: once per forward, host metadata only.

        FlashInfer bakes the softmax scale into its plan: ``self.sm_scale`` (the config's).
        The batch is copied and checked first (``attn_dispatch.backend.BatchSnapshot``); a
        later edit of its tensors never reaches FlashInfer. Where the batch shares leading
        pages, the plan is a cascade and ``plan.cascade`` says what it shares.
        """
        if batch.phase is Phase.VERIFY and batch.custom_mask is not None:
            if self.config.kind == "mla":
                raise InvalidBatchError(
                    "custom_mask",
                    "flashinfer MLA has no custom mask (bind verify to 'triton' or 'torch' "
                    "for tree verify)",
                )
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self.validate)
        route = self._route(snap.phase)
        table = page_table(snap, self.config.page_size, self.max_num_pages)
        found = self._cascade(snap, table)
        info = None
        if found is not None:
            info, levels = found
            table = dataclasses.replace(table, levels=levels)
            if self._cascade_route is None:
                self._cascade_route = CascadeRoute(self)
            route = self._cascade_route
        wrapper = route.wrapper_for(snap)
        scale = self.sm_scale
        try:
            route.plan(wrapper, snap, table, scale)
        except ValueError as exc:
            if isinstance(exc, InvalidBatchError):
                raise
            raise InvalidBatchError(
                "batch",
                f"flashinfer {route.name}.plan refused this {snap.phase.name} batch "
                f"({snap.num_requests} requests, {snap.num_tokens} tokens, max kv "
                f"{snap.max_kv_len}): {exc}",
            ) from exc
        ticket = object()
        route.tickets[id(wrapper)] = ticket
        plan = FlashInferPlan(self, snap, route, wrapper, scale, ticket, cascade=info)
        return issue_plan(self, plan)

    def handler(self, phase: Phase) -> Handler:
        """The per-layer callable for ``phase``; builds its route now (bind time)."""
        _check_phase(self.config, phase)
        self._route(phase)
        return self._run

    def _run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: object,
        sm_scale: float,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_plan(plan, self, "flashinfer")
        assert isinstance(plan, FlashInferPlan)
        self._checks.check_keywords(q, return_lse=return_lse)  # every backend's rule
        route = plan.route
        if route.tickets.get(id(plan.wrapper)) is not plan.ticket:
            raise InvalidBatchError(
                "plan",
                "flashinfer: this plan was superseded: a later plan() re-planned the same "
                "FlashInfer wrapper (one plan per forward; use the scope's current plan)",
            )
        self._checks.check(plan.snap, q, k_cache, v_cache)
        if out is not None:
            self._checks.check_out(out, q, k_cache, v_cache)
        if sm_scale != plan.sm_scale and not math.isclose(sm_scale, plan.sm_scale, rel_tol=1e-6):
            raise InvalidBatchError(
                "sm_scale",
                f"flashinfer: {sm_scale!r} differs from the planned {plan.sm_scale!r}; FlashInfer "
                "bakes the scale in at plan time: bind with AttnConfig(sm_scale=...) equal to "
                "the scale the model passes",
            )
        if (k_scale is not None or v_scale is not None) and not self.kv_fp8:
            raise InvalidBatchError(
                "k_scale" if k_scale is not None else "v_scale",
                f"flashinfer: a scale was passed but the bound config's kv_dtype is "
                f"{self.config.kv_dtype!r}, not FP8",
            )
        if return_lse and not self.lse and (self.config.kind == "mla" or plan.cascade):
            raise InvalidBatchError(
                "return_lse",
                "flashinfer: this plan was made without lse (FlashInfer's MLA wrapper fixes "
                "its lse mode at plan, its cascade wrapper returns none); bind with "
                "AttnConfig(return_lse=True)",
            )
        if plan.snap.num_requests == 0:  # SGLang's IDLE forward: nothing to launch
            empty = (
                q.new_empty((0, self.config.num_q_heads, self.config.out_head_dim))
                if out is None
                else out
            )
            if return_lse:
                lse0 = torch.empty(
                    (0, self.config.num_q_heads), dtype=torch.float32, device=q.device
                )
                return empty, lse0
            return empty
        extra = NO_EXTRA
        if self.kv_fp8:
            ks = 1.0 if k_scale is None else float(k_scale)
            vs = 1.0 if v_scale is None else float(v_scale)
            extra = route.scale_keywords(ks, vs)
        if out is not None and route.takes_out:
            extra = {**extra, "out": out}  # the wrapper's kernel writes there
        if not (return_lse or route.always_lse):
            plain: torch.Tensor = route.run(plan.wrapper, q, k_cache, v_cache, extra)
            return plain if out is None or plain is out else out.copy_(plain)
        res: torch.Tensor
        lse: torch.Tensor
        res, lse = route.run(plan.wrapper, q, k_cache, v_cache, {**extra, **route.lse_keywords})
        if out is not None and res is not out:
            res = out.copy_(res)  # the cascade wrapper (no out=), or a wrapper that ignored it
        if not return_lse:
            return res
        if route.lse_factor is not None:
            lse = lse.mul_(route.lse_factor)
        return res, lse
