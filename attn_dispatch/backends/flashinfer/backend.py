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
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import flashinfer
import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper
from flashinfer.mla import MLAPlanMetadata

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import BackendUnavailableError
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch.backends._common import BatchSnapshot
from attn_dispatch.backends._common import TensorChecks
from attn_dispatch.backends._common import window_flat_mask
from attn_dispatch.backends._torch_base import TorchBackendBase
from attn_dispatch.backends.flashinfer import CAPABILITIES

__all__ = [
    "CASCADE_MIN_SAVED_FRACTION",
    "WRAPPER_KEYWORDS",
    "CascadeGroups",
    "FlashInferBackend",
    "FlashInferPlan",
    "cascade_groups",
]

Handler = Callable[..., Any]
Tensor = torch.Tensor
Kw = Mapping[str, Any]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {
    **_DTYPES,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: Group sizes FlashInfer's CUDA-core decode kernel is instantiated for
#: (DISPATCH_GQA_GROUP_SIZE in data/include/flashinfer/utils.cuh); others need tensor cores.
_CUDA_CORE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})

#: ln 2: a base-2 log-sum-exp times this is the natural one.
_LN2 = math.log(2.0)

#: A cascade is planned only when it saves at least this fraction of the key/value token reads
#: of the plain plan: a cascade costs two kernels and a merge per layer instead of one kernel
#: (FlashInfer's docstring warns that more levels are not always faster). The value is a
#: guess not yet measured on a GPU (bench/gpu.sh has no cascade row).
CASCADE_MIN_SAVED_FRACTION = 0.25

# Keywords shared by the two paged MHA wrappers (prefill and decode), per method.
_PAGED_INIT = frozenset({"float_workspace_buffer", "kv_layout", "use_cuda_graph", "backend"})
_PAGED_PLAN = frozenset(
    {
        "num_qo_heads",
        "num_kv_heads",
        "page_size",
        "q_data_type",
        "kv_data_type",
        "sm_scale",
        "window_left",
        "logits_soft_cap",
        "non_blocking",
    }
)
_PAGED_RUN = frozenset({"q", "paged_kv_cache", "k_scale", "v_scale", "return_lse"})

# Every keyword this module passes to a FlashInfer wrapper, per (wrapper, method). The
# adapter builds its calls from these sets (see _kw) and tests/test_flashinfer.py checks
# each against the installed signatures, so a renamed keyword fails a CPU test, not a
# GPU run.
WRAPPER_KEYWORDS: dict[tuple[str, str], frozenset[str]] = {
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__"): _PAGED_INIT
    | {
        "qo_indptr_buf",
        "paged_kv_indptr_buf",
        "paged_kv_indices_buf",
        "paged_kv_last_page_len_buf",
        "custom_mask_buf",
        "mask_indptr_buf",
    },
    ("BatchPrefillWithPagedKVCacheWrapper", "plan"): _PAGED_PLAN
    | {
        "qo_indptr",
        "paged_kv_indptr",
        "paged_kv_indices",
        "paged_kv_last_page_len",
        "head_dim_qk",
        "head_dim_vo",
        "custom_mask",
        "causal",
    },
    ("BatchPrefillWithPagedKVCacheWrapper", "run"): _PAGED_RUN | {"lse_base"},
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__"): _PAGED_INIT
    | {
        "use_tensor_cores",
        "paged_kv_indptr_buffer",
        "paged_kv_indices_buffer",
        "paged_kv_last_page_len_buffer",
    },
    ("BatchDecodeWithPagedKVCacheWrapper", "plan"): _PAGED_PLAN
    | {"indptr", "indices", "last_page_len", "head_dim"},
    ("BatchDecodeWithPagedKVCacheWrapper", "run"): _PAGED_RUN,
    ("MultiLevelCascadeAttentionWrapper", "__init__"): frozenset(
        {"num_levels", "float_workspace_buffer", "kv_layout"}
    ),
    ("MultiLevelCascadeAttentionWrapper", "plan"): frozenset(
        {
            "qo_indptr_arr",
            "paged_kv_indptr_arr",
            "paged_kv_indices_arr",
            "paged_kv_last_page_len",
            "num_qo_heads",
            "num_kv_heads",
            "head_dim",
            "page_size",
            "causal",
            "sm_scale",
            "logits_soft_cap",
            "q_data_type",
            "kv_data_type",
        }
    ),
    ("MultiLevelCascadeAttentionWrapper", "run"): frozenset({"q", "paged_kv_cache"}),
    ("BatchMLAPagedAttentionWrapper", "__init__"): frozenset(
        {
            "float_workspace_buffer",
            "use_cuda_graph",
            "qo_indptr",
            "kv_indptr",
            "kv_indices",
            "kv_len_arr",
            "backend",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "plan"): frozenset(
        {
            "metadata",
            "num_heads",
            "head_dim_ckv",
            "head_dim_kpe",
            "page_size",
            "causal",
            "sm_scale",
            "q_data_type",
            "kv_data_type",
            "query_layout",
            "kv_cache_layout",
            "scale_mode",
            "lse_mode",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "run"): frozenset(
        {"query", "kv_cache", "ckv_scale", "kpe_scale", "return_lse", "return_lse_base_on_e"}
    ),
    ("MLAPlanMetadata", "csr"): frozenset({"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"}),
}


def _kw(wrapper: str, method: str, **kwargs: Any) -> dict[str, Any]:
    """The keywords for one call, checked against WRAPPER_KEYWORDS (a typo here would
    otherwise only show on a GPU)."""
    allowed = WRAPPER_KEYWORDS[(wrapper, method)]
    unknown = set(kwargs) - allowed
    if unknown:  # pragma: no cover - programming error in this module
        raise AssertionError(f"{wrapper}.{method}: keywords {sorted(unknown)} not declared")
    return kwargs


@dataclass(frozen=True, slots=True)
class CascadeGroups:
    """What a cascade plan reads once: request ranges ``groups[g] = (first, stop)`` (stop
    excluded) whose page tables start with the same ``shared_pages[g]`` pages (same page ids,
    whole pages). ``saved_tokens``: key/value token reads per layer and kv head that the plain
    plan makes and the cascade does not; ``total_tokens``: the plain plan's reads.

    >>> c = CascadeGroups(groups=((0, 4),), shared_pages=(3,), page_size=16, total_tokens=256)
    >>> c.shared_tokens, c.saved_tokens, str(c)
    ((48,), 144, 'cascade: 1 group (4 requests) shares 48 tokens; reads 144 of 256 tokens less')
    """

    groups: tuple[tuple[int, int], ...]
    shared_pages: tuple[int, ...]
    page_size: int
    total_tokens: int

    @property
    def shared_tokens(self) -> tuple[int, ...]:
        return tuple(p * self.page_size for p in self.shared_pages)

    @property
    def saved_tokens(self) -> int:
        return sum(
            (stop - first - 1) * tokens
            for (first, stop), tokens in zip(self.groups, self.shared_tokens, strict=True)
        )

    def __str__(self) -> str:
        n = len(self.groups)
        sizes = "+".join(str(stop - first) for first, stop in self.groups)
        shared = "+".join(str(t) for t in self.shared_tokens)
        return (
            f"cascade: {n} group{'s' if n != 1 else ''} ({sizes} requests) shares {shared} "
            f"tokens; reads {self.saved_tokens} of {self.total_tokens} tokens less"
        )


def _common_pages(pages: Sequence[int], a: int, b: int, limit: int) -> int:
    """How many leading pages ``pages[a:]`` and ``pages[b:]`` have in common, up to ``limit``
    (slice compares run in C; a binary search finds the first difference)."""
    if pages[a : a + limit] == pages[b : b + limit]:
        return limit
    lo, hi = 0, limit  # pages[a:a+lo] == pages[b:b+lo]; they differ within the first hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pages[a : a + mid] == pages[b : b + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _split(common: list[int], first: int, last: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Best grouping of the consecutive requests ``first..last`` (each adjacent pair sharing
    ``common[i]`` >= 1 leading pages): one group sharing the smallest common prefix, or the
    best groupings of the two sides of the pair where that prefix is smallest, whichever saves
    more page reads. Returns (pages saved, [(first, stop, shared pages)])."""
    # An explicit stack (post-order) instead of recursion: a batch may hold thousands of
    # requests.
    results: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    stack: list[tuple[int, int, bool]] = [(first, last, False)]
    while stack:
        a, b, ready = stack.pop()
        if a == b:
            results[(a, b)] = (0, [(a, a + 1, 0)])
            continue
        part = common[a:b]
        low = min(part)
        whole = (b - a) * low
        if max(part) == low:  # no split can save more than one group (the usual case)
            results[(a, b)] = (whole, [(a, b + 1, low)])
            continue
        k = a + part.index(low)
        if not ready:
            stack += [(a, b, True), (a, k, False), (k + 1, b, False)]
            continue
        left, right = results.pop((a, k)), results.pop((k + 1, b))
        if left[0] + right[0] > whole:
            results[(a, b)] = (left[0] + right[0], left[1] + right[1])
        else:
            results[(a, b)] = (whole, [(a, b + 1, low)])
    return results[(first, last)]


def cascade_groups(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    kv_indptr: Sequence[int],
    pages: Sequence[int],
    page_size: int,
) -> list[tuple[int, int, int]]:
    """Split a batch into runs of consecutive requests ``(first, stop, shared_pages)`` for a
    two-level cascade: the requests of a run start with the same ``shared_pages`` pages
    (``shared_pages`` 0 for a request in no group). ``kv_indptr`` indexes ``pages`` with
    exactly ceil(kv_len / page_size) pages per request.

    Only whole pages that lie before a request's first query token are shared, so every
    query sees every shared key and every request keeps at least one key of its own (no
    level of the cascade is ever empty for a request).

    >>> cascade_groups([1, 1, 1], [40, 40, 20], [0, 3, 6, 8], [7, 8, 9, 7, 8, 5, 4, 2], 16)
    [(0, 2, 2), (2, 3, 0)]
    """
    n = len(kv_lens)
    # whole pages before each request's first query position
    room = [(kv - max(q, 1)) // page_size for q, kv in zip(q_lens, kv_lens, strict=True)]
    common = [
        _common_pages(pages, kv_indptr[i], kv_indptr[i + 1], min(room[i], room[i + 1]))
        if min(room[i], room[i + 1]) > 0
        else 0
        for i in range(n - 1)
    ]
    groups: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        j = i
        while j < n - 1 and common[j] > 0:
            j += 1
        groups += _split(common, i, j)[1]
        i = j + 1
    return groups


@dataclass(frozen=True, slots=True)
class _Levels:
    """The two levels of a cascade plan, in FlashInfer's form (host indptrs, device indices)."""

    qo_indptr: tuple[torch.Tensor, torch.Tensor]
    kv_indptr: tuple[torch.Tensor, torch.Tensor]
    kv_indices: tuple[torch.Tensor, torch.Tensor]
    last_page_len: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class FlashInferPlan(PlanBase):
    """What ``FlashInferBackend.plan`` returns: accepted only by the backend object in
    ``owner``, and only while its wrapper still holds this plan (a later ``plan`` of the
    same wrapper supersedes it). ``sm_scale`` is the scale FlashInfer baked in; a call with
    another scale is refused (FlashInfer cannot change it without re-planning).
    ``cascade``: what a cascade plan shares (None: the plain plan ran)."""

    owner: FlashInferBackend
    snap: BatchSnapshot
    route: _Route
    wrapper: Any
    sm_scale: float
    ticket: object
    cascade: CascadeGroups | None = None

    @property
    def dispatch_note(self) -> str | None:
        """What ``record_dispatch`` shows beside the call: the cascade, when it ran."""
        return None if self.cascade is None else f"cascade: {self.cascade}"


@dataclass(frozen=True, slots=True)
class _PageTable:
    """FlashInfer's view of our page table: exactly ceil(kv_len / page_size) pages per
    request (FlashInfer derives kv_len from the page count and the last page's fill).
    ``levels``: the cascade levels when the plan cascades."""

    qo_indptr: torch.Tensor  # host int32 [B+1]
    kv_indptr: torch.Tensor  # host int32 [B+1]
    kv_indices: torch.Tensor  # device int32
    kv_lens: torch.Tensor  # host int32 [B]
    last_page_len: torch.Tensor  # host int32 [B]
    levels: _Levels | None = None


def _gather(indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``indices[positions]`` with host ``positions`` (int64), copied to the device without
    waiting for its queue (pinned memory)."""
    if indices.is_cuda:
        positions = positions.pin_memory().to(indices.device, non_blocking=True)
    return indices.index_select(0, positions).contiguous()


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The concatenated ranges ``starts[i] .. starts[i] + counts[i]`` (int64, host)."""
    starts, counts = starts.to(torch.int64), counts.to(torch.int64)
    total = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        ends - counts, counts
    )
    return torch.repeat_interleave(starts, counts) + offsets


def _page_table(snap: BatchSnapshot, page_size: int, num_pages: int | None) -> _PageTable:
    """Build FlashInfer's page metadata on the host from the snapshot's host copies; never
    copies device to host. When a request holds more pages than its length needs (spare
    pages reserved ahead), the index list is compacted with one gather on the device.

    FlashInfer's kernels do not bound page indices: unless the snapshot checked them on the
    host, they are clamped on the device into ``[0, num_pages)`` (``[0, inf)`` when the pool
    size is unknown), so a bad index reads a wrong page of the cache, never outside it."""
    kv_lens = snap.kv_lens_host
    kv_indptr = snap.kv_indptr_host
    need = torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")
    have = kv_indptr[1:] - kv_indptr[:-1]
    indices = snap.kv_indices
    if snap.max_page is None:
        indices = indices.clamp(0, None if num_pages is None else num_pages - 1)
    if torch.equal(have, need):
        compact_indptr = kv_indptr
    else:
        compact_indptr = _indptr(need)
        indices = _gather(indices, _ranges(kv_indptr[:-1], need))
    last = torch.where(need > 0, kv_lens - (need - 1) * page_size, torch.zeros_like(kv_lens))
    return _PageTable(
        qo_indptr=snap.qo_indptr_host,
        kv_indptr=compact_indptr.contiguous(),
        kv_indices=indices.contiguous(),
        kv_lens=kv_lens,
        last_page_len=last.to(torch.int32).contiguous(),
    )


def _levels(table: _PageTable, groups: list[tuple[int, int, int]], page_size: int) -> _Levels:
    """The two cascade levels of ``table``: level 0 holds, per group, its shared pages (a
    request in no group brings its own first page, so no level is empty for any request);
    level 1 holds each request's pages after its group's shared ones."""
    shared = torch.tensor([max(p, 1) for _, _, p in groups], dtype=torch.int32)
    firsts = torch.tensor([first for first, _, _ in groups], dtype=torch.int64)
    sizes = torch.tensor([stop - first for first, stop, _ in groups], dtype=torch.int64)
    per_request = torch.repeat_interleave(shared, sizes)
    qo = table.qo_indptr
    kv = table.kv_indptr
    own = (kv[1:] - kv[:-1]) - per_request
    qo0 = torch.cat((qo[firsts], qo[-1:])).to(torch.int32)
    return _Levels(
        qo_indptr=(qo0.contiguous(), qo),
        kv_indptr=(_indptr(shared), _indptr(own)),
        kv_indices=(
            _gather(table.kv_indices, _ranges(kv[firsts], shared)),
            _gather(table.kv_indices, _ranges(kv[:-1] + per_request, own)),
        ),
        last_page_len=(
            torch.full((len(groups),), page_size, dtype=torch.int32),
            table.last_page_len,
        ),
    )


def _i32(n: int, device: torch.device) -> torch.Tensor:
    """A persistent int32 metadata buffer for a graph-mode wrapper."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _window(config: AttnConfig) -> int:
    # FlashInfer's window_left has our meaning (keys p - window_left ..= p); -1 = full.
    # FlashInfer holds it as int32: a window reaching past any int32 position is full.
    w = config.window_left
    return -1 if w is None or w >= 2**31 - 1 else int(w)


def _soft_cap(config: AttnConfig) -> float:
    # FlashInfer: logits_soft_cap * tanh(q.k * sm_scale / logits_soft_cap); 0 = off.
    cap = config.logit_cap
    return float(cap) if cap else 0.0


class _Route(abc.ABC):
    """One FlashInfer wrapper family serving one or more phases. Eager mode keeps one
    wrapper; CUDA-graph mode keeps one per batch size (FlashInfer fixes the batch size
    of a graph-mode wrapper), all sharing the backend's workspace and index buffers.

    ``lse_keywords`` make the wrapper's ``run`` return ``(out, lse)``; ``lse_factor`` turns
    that lse into a natural log (None: it is one already)."""

    name = "route"
    lse_keywords: Kw = MappingProxyType({"return_lse": True})
    lse_factor: float | None = None

    def __init__(self, backend: FlashInferBackend) -> None:
        self.backend = backend
        self.config = backend.config
        self._eager: Any = None
        self._graph: dict[int, Any] = {}
        # id(wrapper) -> ticket of the plan it holds now (a wrapper keeps one plan at a time)
        self.tickets: dict[int, object] = {}
        # run() returns (out, lse) on every call (a wrapper planned for one lse mode)
        self.always_lse = False

    def wrapper_for(self, batch: BatchSnapshot) -> Any:
        if not self.backend.use_cuda_graph:
            if self._eager is None:
                self._eager = self._make(None)
            return self._eager
        b = batch.num_requests
        if b > self.backend.max_batch_size:
            raise InvalidBatchError(
                "num_requests",
                f"flashinfer: {b} requests exceed max_batch_size="
                f"{self.backend.max_batch_size} of CUDA-graph mode; bind with a larger "
                "max_batch_size option",
            )
        if b not in self._graph:
            self._graph[b] = self._make(b)
        return self._graph[b]

    def _make(self, graph_batch: int | None) -> Any:
        kwargs: dict[str, Any] = {"float_workspace_buffer": self.backend.workspace}
        kwargs.update(self._options())
        if graph_batch is not None:
            kwargs.update(use_cuda_graph=True, **self._graph_buffers(graph_batch))
        return self._wrapper_class()(**_kw(self.name, "__init__", **kwargs))

    @abc.abstractmethod
    def _wrapper_class(self) -> Callable[..., Any]:
        """The FlashInfer class (looked up at each construction: tests substitute it)."""

    @abc.abstractmethod
    def _options(self) -> dict[str, Any]:
        """Constructor keywords besides the workspace, in both modes."""

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        """Constructor keywords of graph mode: persistent metadata buffers."""
        raise AssertionError(f"{self.name} has no CUDA-graph mode here")  # pragma: no cover

    #: The names a paged MHA wrapper's plan gives (kv_indptr, kv_indices, last_page_len).
    table_keywords = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")

    def _plan_mha(
        self, wrapper: Any, sm_scale: float, table: _PageTable | None, **kwargs: Any
    ) -> None:
        """``wrapper.plan`` with ``kwargs`` and the keywords every MHA wrapper takes alike;
        with ``table``, its pages under ``table_keywords``, copied without blocking."""
        cfg = self.config
        if table is not None:
            pages = (table.kv_indptr, table.kv_indices, table.last_page_len)
            kwargs.update(zip(self.table_keywords, pages, strict=True), non_blocking=True)
        common = {
            "num_qo_heads": cfg.num_q_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "page_size": cfg.page_size,
            "sm_scale": sm_scale,
            "logits_soft_cap": _soft_cap(cfg),
            "q_data_type": self.backend.q_dtype,
            "kv_data_type": self.backend.kv_dtype,
        }
        wrapper.plan(**_kw(self.name, "plan", **common, **kwargs))

    @abc.abstractmethod
    def plan(
        self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float
    ) -> None: ...

    def run(self, wrapper: Any, q: Tensor, k: Tensor, v: Tensor | None, extra: Kw) -> Any:
        """The wrapper's ``run`` with ``extra`` keywords (scales, lse): the output, or
        ``(out, lse)`` when ``extra`` holds ``lse_keywords``. Per layer: one literal call."""
        return wrapper.run(**self.inputs(q, k, v), **extra)

    @abc.abstractmethod
    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        """The query and cache keywords of the wrapper's ``run``."""

    def scale_keywords(self, k_scale: float, v_scale: float) -> dict[str, Any]:
        """``run`` keywords for an FP8 cache holding K / k_scale and V / v_scale. FlashInfer
        folds k_scale into sm_scale and multiplies the output by v_scale (python floats: no
        host sync)."""
        return {"k_scale": k_scale, "v_scale": v_scale}


_NO_EXTRA: Kw = MappingProxyType({})


class _MHARoute(_Route):
    """The paged MHA wrappers take the same inputs."""

    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        assert v is not None
        return {"q": q, "paged_kv_cache": (k, v)}


class _PrefillRoute(_MHARoute):
    name = "BatchPrefillWithPagedKVCacheWrapper"
    # FlashInfer converts its base-2 lse itself (prefill.py: _finish_lse).
    lse_keywords = MappingProxyType({"return_lse": True, "lse_base": "ln"})

    def _wrapper_class(self) -> Callable[..., Any]:
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper

    def _options(self) -> dict[str, Any]:
        return {"kv_layout": "NHD", "backend": self.backend.prefill_backend}

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        be, dev, tree = self.backend, self.backend.device, self.config.tree_verify
        return {
            "qo_indptr_buf": _i32(graph_batch + 1, dev),
            "paged_kv_indptr_buf": _i32(graph_batch + 1, dev),
            "paged_kv_indices_buf": be.graph_indices,
            "paged_kv_last_page_len_buf": _i32(graph_batch, dev),
            "custom_mask_buf": be.graph_mask if tree else None,
            "mask_indptr_buf": _i32(graph_batch + 1, dev) if tree else None,
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        mask = batch.custom_mask
        window = _window(cfg)
        if mask is not None and window >= 0:
            # FlashInfer windows a masked row by position; our contract windows a draft node's
            # own sequence (the last window_left + 1 keys its mask allows): fold that into the
            # mask (device ops, once per plan) and plan no positional window.
            q_lens = (batch.qo_indptr_host[1:] - batch.qo_indptr_host[:-1]).tolist()
            mask = window_flat_mask(mask, q_lens, batch.kv_lens_host.tolist(), window)
            window = -1
        self._plan_mha(
            wrapper,
            sm_scale,
            table,
            qo_indptr=table.qo_indptr,
            head_dim_qk=cfg.head_dim,
            head_dim_vo=cfg.v_head_dim,
            custom_mask=None if mask is None else mask.reshape(-1),
            # causal=False (encoder layers): every key of the request, FlashInfer's own
            # non-causal prefill.
            causal=mask is None and cfg.causal,
            window_left=window,
        )


class _DecodeRoute(_MHARoute):
    name = "BatchDecodeWithPagedKVCacheWrapper"
    table_keywords = ("indptr", "indices", "last_page_len")
    # Its run() has no lse_base: every backend it runs returns base 2 (cudnn/decode.py converts
    # cuDNN's natural-log stats to base 2 "like every other FlashInfer backend").
    lse_factor = _LN2

    def __init__(self, backend: FlashInferBackend) -> None:
        super().__init__(backend)
        group = self.config.num_q_heads // self.config.num_kv_heads
        chosen = backend.decode_tensor_cores
        # Tensor cores pay off once several query heads share a KV head (SGLang and
        # FlashInfer's own guidance), and are required for group sizes the CUDA-core
        # kernel is not built for.
        self.use_tensor_cores = (
            chosen if chosen is not None else (group >= 4 or group not in _CUDA_CORE_GROUP_SIZES)
        )
        if not self.use_tensor_cores and group not in _CUDA_CORE_GROUP_SIZES:
            raise InvalidSpecError(
                "decode_tensor_cores",
                chosen,
                f"flashinfer's CUDA-core decode kernel is built for GQA groups "
                f"{sorted(_CUDA_CORE_GROUP_SIZES)}, this config has {group}; leave the "
                "option unset (tensor cores are chosen) or choose another backend",
            )

    def _wrapper_class(self) -> Callable[..., Any]:
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper

    def _options(self) -> dict[str, Any]:
        return {
            "kv_layout": "NHD",
            "use_tensor_cores": self.use_tensor_cores,
            "backend": self.backend.decode_backend,
        }

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        dev = self.backend.device
        return {
            "paged_kv_indptr_buffer": _i32(graph_batch + 1, dev),
            "paged_kv_indices_buffer": self.backend.graph_indices,
            "paged_kv_last_page_len_buffer": _i32(graph_batch, dev),
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        self._plan_mha(wrapper, sm_scale, table, head_dim=cfg.head_dim, window_left=_window(cfg))


class _CascadeRoute(_MHARoute):
    """Two levels through ``MultiLevelCascadeAttentionWrapper``: level 0 the shared pages of
    each group (non-causal: every query of the group lies after them), level 1 each request's
    own pages (causal as configured). Eager mode only; its ``run`` takes no scales and returns
    no lse, so FP8 and ``return_lse`` configs never cascade (``FlashInferBackend._cascade``)."""

    name = "MultiLevelCascadeAttentionWrapper"

    def _wrapper_class(self) -> Callable[..., Any]:
        return flashinfer.MultiLevelCascadeAttentionWrapper

    def _options(self) -> dict[str, Any]:
        return {"num_levels": 2, "kv_layout": "NHD"}

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        levels = table.levels
        assert levels is not None
        self._plan_mha(
            wrapper,
            sm_scale,
            None,
            qo_indptr_arr=list(levels.qo_indptr),
            paged_kv_indptr_arr=list(levels.kv_indptr),
            paged_kv_indices_arr=list(levels.kv_indices),
            paged_kv_last_page_len=list(levels.last_page_len),
            head_dim=self.config.head_dim,
            causal=self.config.causal,
        )


class _MLARoute(_Route):
    name = "BatchMLAPagedAttentionWrapper"
    lse_keywords = MappingProxyType({"return_lse": True, "return_lse_base_on_e": True})

    def __init__(self, backend: FlashInferBackend, *, causal: bool) -> None:
        super().__init__(backend)
        self.causal = causal
        assert self.config.v_head_dim is not None  # filled by AttnConfig
        self.ckv = self.config.v_head_dim
        # FlashInfer fixes the lse mode at plan and refuses a run asking another
        # (_contracts.py: validate_run_options), so a config that may ask plans for it and
        # every run returns it.
        self.always_lse = backend.lse

    def _wrapper_class(self) -> Callable[..., Any]:
        return BatchMLAPagedAttentionWrapper

    def _options(self) -> dict[str, Any]:
        return {"backend": self.backend.mla_backend}

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        dev = self.backend.device
        return {
            "qo_indptr": _i32(graph_batch + 1, dev),
            "kv_indptr": _i32(graph_batch + 1, dev),
            "kv_indices": self.backend.graph_indices,
            "kv_len_arr": _i32(graph_batch, dev),
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        metadata = MLAPlanMetadata.csr(
            **_kw(
                "MLAPlanMetadata",
                "csr",
                qo_indptr=table.qo_indptr,
                kv_indptr=table.kv_indptr,
                kv_indices=table.kv_indices,
                kv_len_arr=table.kv_lens,
            )
        )
        # An FP8 latent cache is dequantised per tensor (ckv_scale / kpe_scale at run).
        extra: dict[str, Any] = {"scale_mode": "kv-per-tensor"} if self.backend.kv_fp8 else {}
        if self.always_lse:
            extra["lse_mode"] = "basee"
        wrapper.plan(
            **_kw(
                self.name,
                "plan",
                **extra,
                metadata=metadata,
                num_heads=cfg.num_q_heads,
                head_dim_ckv=self.ckv,
                head_dim_kpe=cfg.head_dim - self.ckv,
                page_size=cfg.page_size,
                # A single query token sees every key: planning it non-causal keeps it
                # clear of the causal tile-boundary rule (see the light module).
                causal=self.causal and batch.max_q_len > 1,
                sm_scale=sm_scale,
                q_data_type=self.backend.q_dtype,
                kv_data_type=self.backend.kv_dtype,
                query_layout="packed",
                kv_cache_layout="packed",
            )
        )

    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        # Our absorbed layout is FlashInfer's packed layout: q [T, H, ckv+kpe] and cache
        # [P, page_size, ckv+kpe]; V is the first ckv columns of the same cache.
        return {"query": q, "kv_cache": k}

    def scale_keywords(self, k_scale: float, v_scale: float) -> dict[str, Any]:
        # Our k_scale covers the whole latent row: both the ckv part (which is V too) and
        # the rope part.
        return {"ckv_scale": k_scale, "kpe_scale": k_scale}


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


class FlashInferBackend(TorchBackendBase):
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

    >>> import torch; torch.cuda.is_available() or print("needs CUDA")  # doctest: +SKIP
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
        self._routes: dict[Phase, _Route] = {}
        self._cascade_route: _CascadeRoute | None = None
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

    def _route(self, phase: Phase) -> _Route:
        route = self._routes.get(phase)
        if route is None:
            route = self._make_route(phase)
            self._routes[phase] = route
        return route

    def _make_route(self, phase: Phase) -> _Route:
        cfg = self.config
        if cfg.kind == "mla":
            # Prefill and verify share one causal wrapper (one plan per forward anyway).
            if phase is not Phase.DECODE:
                for other, r in self._routes.items():
                    if other is not Phase.DECODE:
                        return r
            return _MLARoute(self, causal=phase is not Phase.DECODE and cfg.causal)
        if phase is Phase.DECODE and cfg.head_dim == cfg.v_head_dim:
            return _DecodeRoute(self)
        for r in self._routes.values():
            if isinstance(r, _PrefillRoute):
                return r
        return _PrefillRoute(self)

    def _cascade(
        self, snap: BatchSnapshot, table: _PageTable
    ) -> tuple[CascadeGroups, _Levels] | None:
        """What a cascade of this batch would share and its levels, or None where the plain
        plan runs: the config must allow it (``_may_cascade``), the page ids must be on the
        host without a device sync (a CPU batch, or ``validate=True``, which reads them back
        anyway), the batch must have no custom mask and a query in every request, every
        request a whole page before its first query (no level may be empty for a request:
        FlashInfer's handling of empty requests has had NaN bugs), and the groups must save
        at least ``CASCADE_MIN_SAVED_FRACTION`` of the key reads."""
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
        groups = cascade_groups(q_lens, kv_lens, table.kv_indptr.tolist(), pages, ps)
        shared = [(first, stop, p) for first, stop, p in groups if p > 0]
        info = CascadeGroups(
            groups=tuple((first, stop) for first, stop, _ in shared),
            shared_pages=tuple(p for _, _, p in shared),
            page_size=ps,
            total_tokens=sum(kv_lens),
        )
        if not shared or info.saved_tokens < CASCADE_MIN_SAVED_FRACTION * info.total_tokens:
            return None
        return info, _levels(table, groups, ps)

    # -- protocol ----------------------------------------------------------------------

    def plan(self, batch: AttnBatch) -> FlashInferPlan:
        """Plan the wrapper serving ``batch.phase``: once per forward, host metadata only.

        FlashInfer bakes the softmax scale into its plan: ``self.sm_scale`` (the config's).
        The batch is copied and checked first (``_common.BatchSnapshot``); a later edit of
        its tensors never reaches FlashInfer. Where the batch shares leading pages, the plan
        is a cascade and ``plan.cascade`` says what it shares.
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
        table = _page_table(snap, self.config.page_size, self.max_num_pages)
        found = self._cascade(snap, table)
        info = None
        if found is not None:
            info, levels = found
            table = dataclasses.replace(table, levels=levels)
            if self._cascade_route is None:
                self._cascade_route = _CascadeRoute(self)
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_plan(plan, self, "flashinfer")
        assert isinstance(plan, FlashInferPlan)
        if not isinstance(return_lse, bool):
            raise InvalidBatchError(
                "return_lse", f"flashinfer: must be a bool (True or False), got {return_lse!r}"
            )
        route = plan.route
        if route.tickets.get(id(plan.wrapper)) is not plan.ticket:
            raise InvalidBatchError(
                "plan",
                "flashinfer: this plan was superseded: a later plan() re-planned the same "
                "FlashInfer wrapper (one plan per forward; use the scope's current plan)",
            )
        self._checks.check(plan.snap, q, k_cache, v_cache)
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
            empty = q.new_empty((0, self.config.num_q_heads, self.config.out_head_dim))
            if return_lse:
                lse0 = torch.empty(
                    (0, self.config.num_q_heads), dtype=torch.float32, device=q.device
                )
                return empty, lse0
            return empty
        extra = _NO_EXTRA
        if self.kv_fp8:
            ks = 1.0 if k_scale is None else float(k_scale)
            vs = 1.0 if v_scale is None else float(v_scale)
            extra = route.scale_keywords(ks, vs)
        if not (return_lse or route.always_lse):
            plain: torch.Tensor = route.run(plan.wrapper, q, k_cache, v_cache, extra)
            return plain
        out: torch.Tensor
        lse: torch.Tensor
        out, lse = route.run(plan.wrapper, q, k_cache, v_cache, {**extra, **route.lse_keywords})
        if not return_lse:
            return out
        if route.lse_factor is not None:
            lse = lse.mul_(route.lse_factor)
        return out, lse
