"""Host side of the triton kernels: launch constants, plans and launches.

Everything that needs the host is computed in ``plan_decode`` / ``plan_extend`` from the
batch's host copies (python ints and CPU tensors), once per forward; ``launch`` only launches
kernels on tensors that already exist on the device, so it is safe to capture in a CUDA graph
(the output, lse and split scratch tensors are its allocations, taken from the graph's pool
under capture).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from dataclasses import field
from types import MappingProxyType
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import torch
import triton

from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import chunk_flat_mask
from attn_dispatch.backend import window_flat_mask

from ._decode import _decode_merge_kernel
from ._decode import _decode_split_kernel
from ._dims import DimLayout
from ._extend import _extend_kernel
from ._tile import LOG2E
from ._tile import CacheStrides
from ._tile import Math
from ._tile import PartStrides
from ._tile import RowStrides
from ._tile import Scales
from ._tile import Widths

_P = TypeVar("_P", "DecodePlan", "ExtendPlan")

#: window_left passed to the kernels for full attention: larger than any kv length, and
#: small enough that ``kv_len - 1 - FULL_WINDOW`` stays in int32.
FULL_WINDOW = 1 << 30


def interpreting() -> bool:
    """True when triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def choose_num_splits(
    num_requests: int,
    head_groups: int,
    max_kv_len: int,
    *,
    target_programs: int,
    min_split_tokens: int,
    max_splits: int,
) -> int:
    """Number of KV splits for one decode forward.

    Rule: one program per (request, head group) is enough when that already reaches
    ``target_programs`` (about two waves of the GPU's SMs). Otherwise split each sequence into
    ``ceil(target / programs)`` slices, but never into slices shorter than
    ``min_split_tokens`` of the longest sequence (short slices cost more in partial writes and
    merging than they gain) and never more than ``max_splits``.

    Example: ``choose_num_splits(64, 1, 4096, target_programs=264, min_split_tokens=256,
    max_splits=32)`` -> 5 (MLA, 16 heads in one group, on a 132-SM GPU).
    """
    programs = max(1, num_requests * head_groups)
    if programs >= target_programs:
        return 1
    wanted = math.ceil(target_programs / programs)
    by_length = max(1, math.ceil(max_kv_len / max(1, min_split_tokens)))
    return max(1, min(wanted, by_length, max_splits))


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch constants fixed per backend object (per model runner config)."""

    mla: bool
    num_q_heads: int
    num_kv_heads: int
    layout: DimLayout
    device: torch.device
    upcast: bool
    ieee: bool
    block_h: int
    decode_block_n: int
    extend_block_m: int
    extend_block_n: int
    decode_warps: int
    extend_warps: int
    num_stages: int
    target_programs: int
    min_split_tokens: int
    max_splits: int
    forced_splits: int | None
    # Layer variants, planned from the config (never per call).
    window_left: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    kv_scaled: bool = False  # FP8 cache: k_scale / v_scale are applied
    # Attention types: non-causal prefill/verify; chunked local attention (None = off).
    causal: bool = True
    chunk_size: int | None = None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def groups_per_kv(self) -> int:
        return -(-self.group_size // self.block_h)

    @property
    def v_from_k(self) -> bool:
        # MLA whose V is exactly the power-of-two main part of the latent row: reuse that tile.
        return self.mla and self.layout.v_head_dim == self.layout.main


class Constants(NamedTuple):
    """The kernels' compile-time arguments for one ``KernelConfig`` (read-only mappings):
    the head widths and tile sizes every load and store is sized by."""

    decode: MappingProxyType[str, Any]
    merge: MappingProxyType[str, Any]
    extend_masked: MappingProxyType[str, Any]
    extend_plain: MappingProxyType[str, Any]


_CONSTANTS: dict[int, tuple[KernelConfig, Constants]] = {}


def constants_of(kc: KernelConfig) -> Constants:
    """``kc``'s kernel constants, computed once per ``KernelConfig`` object (one dict lookup
    and an identity test per call). Launches take them from the backend's own config, never
    from a plan: a plan edited in place cannot change the widths a kernel runs with."""
    hit = _CONSTANTS.get(id(kc))
    if hit is not None and hit[0] is kc:
        return hit[1]
    made = Constants(
        MappingProxyType(decode_constants(kc)),
        MappingProxyType(merge_constants(kc)),
        MappingProxyType(extend_constants(kc, True)),
        MappingProxyType(extend_constants(kc, False)),
    )
    if len(_CONSTANTS) > 1024:  # configs come and go with backend objects: stay bounded
        _CONSTANTS.clear()
    _CONSTANTS[id(kc)] = (kc, made)  # the entry keeps kc alive, so its id is not reused
    return made


@dataclass(frozen=True, slots=True, eq=False)
class TritonPlan(PlanBase):
    """One forward's plan, made by ``TritonBackend.plan``, accepted only by that object.

    A handle: ``kernel`` ("decode": the split-KV kernel, or "extend"), ``num_requests``,
    ``num_tokens`` and ``num_splits`` (1 for extend) are summaries for display and tests;
    launches read the backend's private record (``DecodePlan`` / ``ExtendPlan``), which
    nothing reachable from the handle leads to, so no edit of an issued plan reaches a
    kernel. ``token`` is an object no copy can reproduce: a CUDA-graph replay re-plans
    through ``update_plan``, never by copying fields."""

    kernel: str
    num_requests: int
    num_tokens: int
    num_splits: int
    token: object = field(default_factory=object)


class _Record:
    """Base of the private launch records: weakly referenceable (``_SEALS`` is keyed by them)."""

    __slots__ = ("__weakref__",)


@dataclass(frozen=True, slots=True, eq=False)
class DecodePlan(_Record):
    """Split-KV decode launch record (private to the backend object).

    Nothing here sizes a kernel's loads: the constants come from the backend's own config at
    each launch, the grids' head axes too, and ``launch`` refuses a record whose grids or
    split count no longer match its batch, or whose tensors were swapped
    (``check_launchable``)."""

    snap: BatchSnapshot
    num_splits: int
    split_grid: tuple[int, int, int]
    merge_grid: tuple[int, int]


@dataclass(frozen=True, slots=True, eq=False)
class ExtendPlan(_Record):
    """Extend (prefill / verify) launch record, private to the backend object (see
    ``DecodePlan`` for what a launch re-checks)."""

    snap: BatchSnapshot
    grid: tuple[int, int, int]
    mask: torch.Tensor | None  # uint8 view of the snapshot's custom mask


def handle_of(plan: DecodePlan | ExtendPlan) -> TritonPlan:
    """The handle a caller gets for the private record ``plan``."""
    snap = plan.snap
    decode = isinstance(plan, DecodePlan)
    return TritonPlan(
        kernel="decode" if decode else "extend",
        num_requests=snap.num_requests,
        num_tokens=snap.num_tokens,
        num_splits=plan.num_splits if isinstance(plan, DecodePlan) else 1,
    )


#: Address and size of every tensor a plan holds, recorded when it is issued. Kept beside the
#: plan, not in it: a CUDA-graph replay compares a captured plan's fields with a new plan's,
#: and refills its tensors in place (same addresses), which this seal allows.
_SEALS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], ...]] = weakref.WeakKeyDictionary()


def held_tensors(plan: DecodePlan | ExtendPlan) -> tuple[torch.Tensor, ...]:
    """Every tensor a launch reads through ``plan``."""
    snap = plan.snap
    held = [snap.qo_indptr, snap.kv_indptr, snap.kv_indices, snap.kv_lens]
    held += [t for t in (snap.custom_mask, snap.mask_indptr) if t is not None]
    mask = getattr(plan, "mask", None)
    if mask is not None:
        held.append(mask)
    return tuple(held)


def _seal(plan: DecodePlan | ExtendPlan) -> tuple[tuple[int, int], ...]:
    return tuple((t.data_ptr(), t.numel()) for t in held_tensors(plan))


def sealed(plan: _P) -> _P:
    """``plan`` with its tensors' addresses recorded (``plan_decode`` / ``plan_extend``)."""
    _SEALS[plan] = _seal(plan)
    return plan


def check_launchable(kc: KernelConfig, plan: DecodePlan | ExtendPlan) -> None:
    """Refuse (``InvalidBatchError``, field ``plan``) a plan changed after it was issued: a
    tensor it holds replaced, or grids that no longer cover its batch. Host work only
    (attribute reads and int compares): no device sync. Edits inside the tensors it holds
    reach the kernels, which bound every index by the tensors of the call (a page outside
    the cache is dropped): never memory outside them."""
    if _SEALS.get(plan) != _seal(plan):
        raise InvalidBatchError(
            "plan",
            "triton: a tensor this plan holds was replaced after the plan was made; plan the "
            "batch again",
        )
    snap = plan.snap
    b = snap.num_requests
    if isinstance(plan, ExtendPlan):
        grid = plan.grid
        ok = (
            _ints(grid, 3)
            and grid[0] == b
            and grid[1] == kc.num_q_heads
            and grid[2] * kc.extend_block_m >= snap.max_q_len
        )
    else:
        grid, splits = plan.split_grid, plan.num_splits
        ok = (
            _ints(grid, 3)
            and type(splits) is int
            and grid[0] == b
            and 1 <= splits == grid[2]
            and _ints(plan.merge_grid, 2)
            and plan.merge_grid[0] == b
        )
    if not ok:
        raise InvalidBatchError(
            "plan",
            "triton: the plan's launch grid does not match its batch (the plan was edited "
            "after it was made); plan the batch again",
        )


def _ints(xs: Any, n: int) -> bool:
    return type(xs) is tuple and len(xs) == n and all(type(x) is int for x in xs)


def plan_decode(kc: KernelConfig, snap: BatchSnapshot, num_splits: int) -> DecodePlan:
    """Decode launch plan (the split scratch is allocated per call: see ``run_decode``)."""
    b = snap.num_requests
    plan = DecodePlan(
        snap=snap,
        num_splits=num_splits,
        split_grid=(b, kc.num_kv_heads * kc.groups_per_kv, num_splits),
        merge_grid=(b, -(-kc.num_q_heads // kc.block_h)),
    )
    return sealed(plan)


def plan_extend(kc: KernelConfig, snap: BatchSnapshot) -> ExtendPlan:
    mask = snap.custom_mask
    plan = ExtendPlan(
        snap=snap,
        grid=(snap.num_requests, kc.num_q_heads, max(1, -(-snap.max_q_len // kc.extend_block_m))),
        mask=None if mask is None else kernel_mask(kc, snap),
    )
    return sealed(plan)


def kernel_mask(
    kc: KernelConfig, snap: BatchSnapshot, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The custom mask as the kernel reads it (uint8): the snapshot's own bytes (a view, no
    copy), or with a window the mask with the window folded in (``window_flat_mask``: a node
    sees the last window_left + 1 keys its mask allows), written into ``out`` when given (a
    captured plan's buffer). Device ops only: no host sync."""
    mask = snap.custom_mask
    assert mask is not None
    if kc.window_left is None and kc.chunk_size is None:
        return mask.view(torch.uint8)
    q_lens = (snap.qo_indptr_host[1:] - snap.qo_indptr_host[:-1]).tolist()
    kv_lens = snap.kv_lens_host.tolist()
    folded = mask
    if kc.chunk_size is not None:  # the chunk first, then the window (see chunk_tree_mask)
        folded = chunk_flat_mask(folded, q_lens, kv_lens, kc.chunk_size)
    if kc.window_left is not None:
        folded = window_flat_mask(folded, q_lens, kv_lens, kc.window_left)
    # Same length as the snapshot's mask (which may hold capacity past the batch's part).
    buf = torch.zeros_like(mask) if out is None else out.view(torch.bool)
    buf[: folded.numel()].copy_(folded)
    return buf.view(torch.uint8)


def widths(kc: KernelConfig) -> Widths:
    """The kernels' constexpr head widths (``_dims.DimLayout``)."""
    lay = kc.layout
    return Widths(lay.head_dim, lay.v_head_dim, lay.main, lay.rest, lay.v_block)


def tile_math(kc: KernelConfig) -> Math:
    """The tile step's constexpr switches."""
    return Math(V_FROM_K=kc.v_from_k, IEEE=kc.ieee, SOFTCAP=bool(kc.logit_cap), UPCAST=kc.upcast)


def decode_constants(kc: KernelConfig) -> dict[str, Any]:
    """Compile-time arguments of the split kernel (also used to compile it ahead of time)."""
    return dict(
        W=widths(kc), M=tile_math(kc), BLOCK_H=kc.block_h, BLOCK_N=kc.decode_block_n,
        KV_SCALED=kc.kv_scaled,
    )  # fmt: skip


def merge_constants(kc: KernelConfig) -> dict[str, Any]:
    """Compile-time arguments of the merge kernel but ``STORE_LSE`` (per call: ``launch``)."""
    lay = kc.layout
    return dict(V_DIM=lay.v_head_dim, DV_BLOCK=lay.v_block, BLOCK_H=kc.block_h, HAS_SINKS=kc.sinks)


def extend_constants(kc: KernelConfig, use_mask: bool) -> dict[str, Any]:
    """Compile-time arguments of the extend kernel but ``STORE_LSE`` (per call: ``launch``)."""
    return dict(
        W=widths(kc), M=tile_math(kc), BLOCK_M=kc.extend_block_m, BLOCK_N=kc.extend_block_n,
        USE_MASK=use_mask,
        # WINDOW: skip keys before the window; WINDOW_MASK: mask the rest per row by position
        # (without a custom mask; a tree mask carries its window, see plan_extend).
        WINDOW=kc.window_left is not None, WINDOW_MASK=kc.window_left is not None and not use_mask,
        # CHUNK: skip keys before the chunk; CHUNK_MASK: mask per row (a tree mask carries it).
        CHUNK=kc.chunk_size is not None, CHUNK_MASK=kc.chunk_size is not None and not use_mask,
        NON_CAUSAL=not kc.causal, HAS_SINKS=kc.sinks, KV_SCALED=kc.kv_scaled,
    )  # fmt: skip


def score_args(kc: KernelConfig, sm_scale: float, k_scale: float, v_scale: float = 1.0) -> Scales:
    """Runtime score and output scales.

    k_scale multiplies every q.k of an FP8 cache, so it is folded into the score scale
    (one multiply per score instead of one per loaded element).
    """
    scale = sm_scale * k_scale
    cap = kc.logit_cap
    if cap:
        return Scales(scale * LOG2E, scale / cap, cap * LOG2E, v_scale)
    return Scales(scale * LOG2E, 1.0, 1.0, v_scale)


def kernel_chunk(kc: KernelConfig) -> int:
    # Off (or wider than FULL_WINDOW): one chunk spans every position the kernels see.
    return FULL_WINDOW if kc.chunk_size is None else min(kc.chunk_size, FULL_WINDOW)


def kernel_window(kc: KernelConfig) -> int:
    # The kernels take it as int32; any window wider than FULL_WINDOW is full attention.
    return FULL_WINDOW if kc.window_left is None else min(kc.window_left, FULL_WINDOW)


def _cache_strides(kc: KernelConfig, k_cache: torch.Tensor, v: torch.Tensor) -> CacheStrides:
    if kc.mla:  # [P, page_size, D]: one latent head shared by all query heads
        return CacheStrides(k_cache.stride(0), k_cache.stride(1), 0, v.stride(0), v.stride(1), 0)
    return CacheStrides(*k_cache.stride()[:3], *v.stride()[:3])


def common_args(
    kc: KernelConfig,
    snap: BatchSnapshot,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v: torch.Tensor,
    scales: Scales,
) -> tuple[Any, ...]:
    """The leading arguments of both attention kernels, in their order: the paged request
    (q, caches, page table), the score scales, the key bounds and the strides."""
    return (
        q, k_cache, v, snap.kv_indptr, snap.kv_indices, snap.kv_lens,
        scales, kernel_window(kc), kernel_chunk(kc), RowStrides(*q.stride()[:2]),
        _cache_strides(kc, k_cache, v),
    )  # fmt: skip


def launch(
    kc: KernelConfig,
    plan: DecodePlan | ExtendPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    want_lse: bool = False,
    dest: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse)`` of one layer from the kernel the plan chose. ``lse`` (float32 [tokens,
    q_heads], natural log, sink included) is None unless ``want_lse``. ``dest``: a checked,
    contiguous ``[tokens, q_heads, v_head_dim]`` buffer the kernels write (and return) in
    place of a fresh one."""
    check_launchable(kc, plan)
    consts = constants_of(kc)
    v = k_cache if v_cache is None else v_cache
    snap = plan.snap
    # Zeroed, not empty: every row is written, even one the kernels would skip (device
    # metadata that disagrees with the host copies the plan checked, on CUDA without
    # ``validate``): such a row is an empty state (output 0, LSE -inf), never whatever the
    # allocator held. A memset per layer, small beside the attention it precedes.
    if dest is None:
        out = q.new_zeros((q.shape[0], kc.num_q_heads, kc.layout.v_head_dim))
    else:
        out = dest.zero_()
    lse = None
    if want_lse:
        lse = torch.full(
            (q.shape[0], kc.num_q_heads), -math.inf, dtype=torch.float32, device=q.device
        )
    if snap.kv_lens.numel() == 0:  # no request: nothing to launch
        return out, lse
    # Without sinks / lse the kernels never read those arguments; any device tensor will do.
    sink_arg = snap.kv_lens if sinks is None else sinks
    lse_arg = out if lse is None else lse
    rows = (out, lse_arg, RowStrides(*out.stride()[:2]), RowStrides(*lse_arg.stride()[:2]))
    common = common_args(kc, snap, q, k_cache, v, score_args(kc, sm_scale, k_scale, v_scale))
    sizes = (k_cache.shape[1], kc.group_size)  # page size, q heads per kv head
    if isinstance(plan, ExtendPlan):
        # Without a mask the kernel never reads these; any device tensor will do.
        mask = plan.mask if plan.mask is not None else snap.kv_indices
        mask_indptr = snap.mask_indptr if snap.mask_indptr is not None else snap.kv_indptr
        _extend_kernel[(plan.grid[0], kc.num_q_heads, plan.grid[2])](
            *common, *rows, snap.qo_indptr, mask, mask_indptr, sink_arg, *sizes,
            q.shape[0], k_cache.shape[0], snap.kv_indices.numel(), mask.numel(),
            snap.kv_lens.numel(),
            **(consts.extend_masked if plan.mask is not None else consts.extend_plain),
            STORE_LSE=want_lse,
            num_warps=kc.extend_warps, num_stages=kc.num_stages,
        )  # fmt: skip
        return out, lse
    # The grid's request count, not the snapshot's: the scratch then always covers what the
    # kernels write, and the kernels bound each request by q's rows and the index tensors.
    b, hq, splits, dv = plan.split_grid[0], kc.num_q_heads, plan.num_splits, kc.layout.v_head_dim
    # Scratch per call, not per plan: calls sharing one plan from several threads (or
    # streams) never write each other's partial results. Under CUDA-graph capture it comes
    # from the graph's pool, so every replay sees the same memory.
    scratch = torch.empty(b * hq * splits * (dv + 1), dtype=torch.float32, device=q.device)
    part_out = scratch[: b * hq * splits * dv].view(b, hq, splits, dv)
    part_lse = scratch[b * hq * splits * dv :].view(b, hq, splits)
    parts = (part_out, part_lse, PartStrides(*part_out.stride()[:3], *part_lse.stride()[:2]))
    # Head axes from this backend's constants, not the plan: only the request axis may vary.
    _decode_split_kernel[(b, kc.num_kv_heads * kc.groups_per_kv, splits)](
        *common, *parts, *sizes, kc.groups_per_kv, splits,
        k_cache.shape[0], snap.kv_indices.numel(), q.shape[0], snap.kv_lens.numel(),
        **consts.decode, num_warps=kc.decode_warps, num_stages=kc.num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(b, -(-kc.num_q_heads // kc.block_h))](
        *parts, *rows, sink_arg, kc.num_q_heads, splits, out.shape[0],
        **consts.merge, STORE_LSE=want_lse, num_warps=4,
    )  # fmt: skip
    return out, lse


def run(kc: KernelConfig, plan: DecodePlan | ExtendPlan, *call: Any) -> torch.Tensor:
    """The output alone: ``launch(kc, plan, *call)[0]`` (either plan; the names below are
    kept for callers that name the phase)."""
    return launch(kc, plan, *call)[0]


run_decode = run_extend = run
