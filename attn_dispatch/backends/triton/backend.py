"""Triton backend, heavy half: ``TritonBackend(config, **options)`` (imports torch and triton).

Per forward, ``plan(batch)`` takes a checked private copy of the batch's index tensors
(``BatchSnapshot``: host checks on the host copies, device-to-device copies, no host sync),
chooses the kernel (the split-KV decode kernel when every request has one query token, the
extend kernel otherwise) and the number of KV splits. The per-layer handler checks tensor shapes
(attribute reads), allocates its output and the decode split scratch (per call, so threads
sharing a plan never share scratch) and launches kernels: no host sync. The kernels drop any
page index outside ``kv_indices`` or the cache given at the call, so unchecked device metadata
cannot make them read outside their tensors."""

from __future__ import annotations

import threading
from typing import Any

import torch

from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BackendUnavailableError
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import Phase
from attn_dispatch.backend import PrivatePlans
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backend import refill
from attn_dispatch.backends.triton import _interpreter_reasons
from attn_dispatch.backends.triton import _ops
from attn_dispatch.backends.triton._dims import DimLayout
from attn_dispatch.backends.triton._dims import dim_reasons

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8 = tuple(sorted(FP8_DTYPES))

# Options a caller may pass through ``BackendSpec``/``bind`` (all ints, all optional).
_INT_OPTIONS = (
    "num_kv_splits",
    "target_programs",
    "min_split_tokens",
    "max_splits",
    "block_h",
    "decode_block_n",
    "extend_block_m",
    "extend_block_n",
    "decode_warps",
    "extend_warps",
    "num_stages",
)
_INTERPRETER_LOCK = threading.Lock()
_POW2_OPTIONS = ("block_h", "decode_block_n", "extend_block_m", "extend_block_n")


class TritonBackend(BackendBase):
    """Triton kernels for one runner's attention config.

    On a CUDA device (or a CPU with ``TRITON_INTERPRET=1`` set before triton is imported):

    ```python
    cfg = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64, device="cuda")
    backend = TritonBackend(cfg, num_kv_splits=4)
    run = backend.handler(Phase.DECODE)
    out = run(q, k_cache, None, backend.plan(batch), 576**-0.5)
    ```

    Options (ints): ``num_kv_splits`` forces the decode split count; ``target_programs``,
    ``min_split_tokens``, ``max_splits`` tune the split rule (``_ops.choose_num_splits``);
    ``block_h``, ``decode_block_n``, ``extend_block_m``, ``extend_block_n`` (powers of two
    >= 16), ``decode_warps``, ``extend_warps``, ``num_stages`` tune the launches.
    """

    name = "triton"

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        self.config = config
        device = torch.device(config.device)
        interp = _ops.interpreting()
        if device.type == "cpu" and not interp:
            raise BackendUnavailableError(
                self.name,
                f"device {config.device!r} needs TRITON_INTERPRET=1 set before the triton "
                "kernels are first imported (they were imported without it); use a CUDA device "
                "or set it at process start",
            )
        stale = list(_interpreter_reasons()) if interp else []
        if stale:
            raise BackendUnavailableError(self.name, stale[0])
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(
                self.name, f"device {config.device!r} is not served (choose 'cuda' or 'cpu')"
            )
        assert config.v_head_dim is not None
        bad = dim_reasons(config.head_dim, config.v_head_dim)
        if bad:
            raise BackendUnavailableError(self.name, "; ".join(bad))
        if config.dtype not in _DTYPES:
            raise BackendUnavailableError(
                self.name,
                f"dtype {config.dtype!r} is not served (choose one of {sorted(_DTYPES)!r})",
            )
        if config.kv_dtype not in (config.dtype, *_FP8):
            raise BackendUnavailableError(
                self.name,
                f"kv_dtype {config.kv_dtype!r} is not served with dtype {config.dtype!r} "
                f"(choose {config.dtype!r} or one of {list(_FP8)!r})",
            )
        validate = options.pop("validate", False)
        if not isinstance(validate, bool):
            raise InvalidSpecError("validate", validate, "must be a bool")
        # validate: on CUDA, read the index tensors back at plan time and check them (a host
        # sync per forward); without it the kernels drop out-of-range pages instead.
        self._validate = validate
        opts = _check_options(options)
        sms = None
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._kc = kernel_config(config, opts, device=device, num_sms=sms, interpreting=interp)
        self._dtype = _DTYPES[config.dtype]
        self._checks = TensorChecks.of(config, backend="triton", layout="rows")
        self._interpreting = device.type == "cpu"
        self._handlers = {phase: self._run for phase in Phase}
        self._sinks = bool(config.sinks)
        self._fp8 = str(config.kv_dtype) in _FP8
        # What each issued plan stands for: the handle holds summaries only (see PrivatePlans).
        self._plans: PrivatePlans[_ops.DecodePlan | _ops.ExtendPlan] = PrivatePlans("triton")

    @property
    def kernel_config(self) -> _ops.KernelConfig:
        """The launch constants (block sizes, split rule inputs) this backend uses."""
        return self._kc

    def plan(self, batch: Any) -> _ops.TritonPlan:
        """Host-side work for one forward: a checked private copy of the batch's index tensors
        (device-to-device on CUDA, no host sync unless ``validate``) and the launch grids,
        kept by this object; the caller gets a handle (``_ops.TritonPlan``)."""
        record = self._record(batch)
        return self._plans.issue(self, _ops.handle_of(record), record)

    def _record(self, batch: Any) -> _ops.DecodePlan | _ops.ExtendPlan:
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self._validate)
        if (
            snap.max_q_len == 1
            and snap.num_tokens == snap.num_requests
            and snap.custom_mask is None
        ):
            # One query token per request: the split-KV kernel (any phase; a one-token verify
            # with a mask goes to the extend kernel, which reads the mask).
            kc = self._kc
            # A window bounds the keys each request reads: split that, not the context.
            longest = snap.max_kv_len
            if kc.window_left is not None:
                longest = min(longest, kc.window_left + 1)
            if kc.chunk_size is not None:
                longest = min(longest, kc.chunk_size)
            splits = kc.forced_splits or _ops.choose_num_splits(
                snap.num_requests,
                kc.num_kv_heads * kc.groups_per_kv,
                longest,
                target_programs=kc.target_programs,
                min_split_tokens=kc.min_split_tokens,
                max_splits=kc.max_splits,
            )
            return _ops.plan_decode(kc, snap, splits)
        return _ops.plan_extend(self._kc, snap)

    def update_plan(self, handle: _ops.TritonPlan, batch: Any) -> None:
        """Re-plan ``batch`` into a CUDA-graph-captured ``plan`` (``cuda_graph`` calls this).

        The new step is checked like any plan, then copied into the captured plan's own
        snapshot tensors (same shapes: ``cuda_graph`` pads to its capacity). The kernels read
        lengths and page tables from those tensors, so the captured split count and grids stay
        valid for any lengths; a step whose sequences grew past a split-rule threshold is not
        refused. Only what the captured grid must cover is checked.
        """
        plan = self._plans.get(handle, self)
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self._validate)
        if isinstance(plan, _ops.DecodePlan):
            if snap.max_q_len > 1 or snap.custom_mask is not None:
                raise InvalidBatchError(
                    "qo_indptr",
                    f"a query of {snap.max_q_len} tokens in a graph captured for one token per "
                    "request",
                )
        elif snap.max_q_len > plan.grid[2] * self._kc.extend_block_m:
            raise InvalidBatchError(
                "qo_indptr",
                f"a query of {snap.max_q_len} tokens exceeds the captured grid "
                f"({plan.grid[2] * self._kc.extend_block_m} rows per request); capture with the "
                "longest query length",
            )
        _ops.check_launchable(self._kc, plan)  # not edited since it was issued or refilled
        refill(plan.snap, snap)
        if isinstance(plan, _ops.ExtendPlan) and plan.mask is not None:
            if self._kc.window_left is not None or self._kc.chunk_size is not None:
                # The kernel reads the window-folded copy, not the snapshot: refold into it.
                _ops.kernel_mask(self._kc, snap, out=plan.mask)

    def handler(self, phase: Phase) -> Any:
        """The per-layer callable for ``phase`` (one for all phases: the plan picks the kernel)."""
        return self._handlers[Phase(phase)]

    def _run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        handle: _ops.TritonPlan,
        sm_scale: float,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        plan = self._plans.get(handle, self)
        self._checks.check(plan.snap, q, k_cache, v_cache)
        if out is not None:  # the kernels write the caller's buffer through its row strides
            self._checks.check_out(out, q, k_cache, v_cache)
        # The core's keyword rules (the kernels index sinks by head: no strided view either).
        self._checks.check_keywords(q, sinks=sinks, return_lse=return_lse)
        ks = 1.0 if k_scale is None else k_scale
        # MLA: V is part of the latent row, so k_scale covers it.
        vs = ks if self._kc.mla else (1.0 if v_scale is None else v_scale)
        if (k_scale is not None or v_scale is not None) and not self._fp8:
            raise InvalidBatchError(
                "k_scale" if k_scale is not None else "v_scale",
                f"triton: a scale was passed but the bound config's kv_dtype is "
                f"{self.config.kv_dtype!r}, not FP8",
            )
        if self._kc.mla:
            v_cache = None  # V is the latent part of k_cache
        if plan.snap.num_requests == 0:  # SGLang's IDLE forward: no grid to launch
            empty, lse = self._empty_outputs(q, return_lse)
            out = empty if out is None else out
        elif self._interpreting:
            # triton's CPU interpreter keeps the running grid in globals: one launch at a time.
            with _INTERPRETER_LOCK:
                out, lse = _ops.launch(
                    self._kc, plan, q, k_cache, v_cache, sm_scale, sinks, ks, vs, return_lse, out
                )
        else:
            out, lse = _ops.launch(
                self._kc, plan, q, k_cache, v_cache, sm_scale, sinks, ks, vs, return_lse, out
            )
        if return_lse:
            assert lse is not None
            return out, lse
        return out

    def _empty_outputs(
        self, q: torch.Tensor, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        heads = self.config.num_q_heads
        out = q.new_empty((0, heads, self._kc.layout.v_head_dim))
        lse = q.new_empty((0, heads), dtype=torch.float32) if return_lse else None
        return out, lse


def kernel_config(
    config: AttnConfig,
    options: dict[str, int],
    *,
    device: torch.device,
    num_sms: int | None,
    interpreting: bool,
) -> _ops.KernelConfig:
    """Launch constants for ``config``; ``num_sms`` is None off CUDA.

    Kept apart from the backend so a test can build the CUDA constants without a GPU and
    compile the kernels for sm90 ahead of time.
    """
    assert config.v_head_dim is not None
    opts = options
    layout = DimLayout.of(config.head_dim, config.v_head_dim)
    wide = max(layout.main + layout.rest, layout.v_block) > 256
    if num_sms is not None:
        target, min_split = 2 * num_sms, 256
    else:
        # Interpreter: every program costs tens of ms; aim at a handful of programs, but still
        # split long sequences so the two-stage path is what CPU tests exercise.
        target, min_split = 4, 32
    small = interpreting  # tiles in the interpreter: as small as tl.dot allows
    return _ops.KernelConfig(
        mla=config.kind == "mla",
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        layout=layout,
        device=device,
        upcast=interpreting,
        ieee=config.dtype == "float32",
        block_h=opts.get("block_h", 16),
        # GPU defaults: the largest tiles that ptxas compiles for sm_90a without register
        # spills (checked offline with triton.compile; test_kernels_compile_for_sm90 compiles
        # them on every CI run).
        decode_block_n=opts.get("decode_block_n", 16 if small else (32 if wide else 64)),
        extend_block_m=opts.get("extend_block_m", 16 if small else (32 if wide else 64)),
        extend_block_n=opts.get("extend_block_n", 16 if small else (16 if wide else 32)),
        decode_warps=opts.get("decode_warps", 8),
        extend_warps=opts.get("extend_warps", 8),
        num_stages=opts.get("num_stages", 2),
        target_programs=opts.get("target_programs", target),
        min_split_tokens=opts.get("min_split_tokens", min_split),
        max_splits=opts.get("max_splits", 32),
        forced_splits=opts.get("num_kv_splits"),
        window_left=config.window_left,
        logit_cap=config.logit_cap or None,
        sinks=bool(config.sinks),
        kv_scaled=str(config.kv_dtype) in _FP8,
        causal=config.causal,
        chunk_size=config.attention_chunk_size,
    )


def _check_options(options: dict[str, Any]) -> dict[str, int]:
    unknown = sorted(set(options) - set(_INT_OPTIONS))
    if unknown:
        raise InvalidSpecError(
            "options",
            unknown,
            f"unknown triton backend options; choose from {[*_INT_OPTIONS, 'validate']!r}",
        )
    out: dict[str, int] = {}
    for key, value in options.items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidSpecError(key, value, "must be a positive int")
        if key in _POW2_OPTIONS and (value < 16 or value & (value - 1)):
            raise InvalidSpecError(key, value, "must be a power of two >= 16 (tl.dot tile side)")
        out[key] = value
    return out
