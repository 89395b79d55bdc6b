"""One layer of the paged cache (``PagedLayer``): its K and V page pools, the writes of a
forward's new tokens into them (FP8 included) and the page moves the cache asks for.

FP8 (``kv_dtype``): each layer stores ``x / scale`` in FP8 once; the scales (one for K, one for
V, per layer) are ``amax / FP8_MAX`` of the prefill's tensors and stay fixed, so later tokens
whose magnitude exceeds the prefill's saturate at ``FP8_MAX * scale``. FP8 pages are written
and moved as bytes: torch has no float8 ``index_copy_`` on CPU, and a byte copy moves the same
values.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._phase import Phase
from attn_dispatch.integrations.transformers._allocator import Allocation
from attn_dispatch.integrations.transformers._allocator import PageGroup
from attn_dispatch.integrations.transformers._common import _PUBLIC_MODULE
from attn_dispatch.integrations.transformers._common import FP8_MAX
from attn_dispatch.integrations.transformers._common import UnsupportedModelError

if TYPE_CHECKING:
    from attn_dispatch.integrations.transformers._cache import PagedCache


@dataclasses.dataclass(slots=True, eq=False)
class _Step:
    """One forward's plan of writes and reads (made by ``begin``, kept by ``commit``)."""

    phase: Phase
    batch_size: int
    q_len: int
    q_rows: torch.Tensor  # int64 rows of the flat [B * q] new tokens that are real
    all_real: bool  # every new token is real: q_rows is arange(B * q)
    lens: list[int]  # each request's tokens after this forward
    new_real: torch.Tensor  # bool [B, q]
    dst: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # per group: flat
    # slot (page * page_size + slot) of each real new token
    batches: dict[str, AttnBatch] = dataclasses.field(default_factory=dict)
    pages: dict[str, Allocation] = dataclasses.field(default_factory=dict)
    # Per group: whether the backend serving this forward declares Capabilities.out_buffer
    # (use()'s forward sets it): the layers then hand attention() a buffer (``out=``).
    takes_out: dict[str, bool] = dataclasses.field(default_factory=dict)
    # int64 rows of the flat [B * q] new tokens that are padding (None when all_real): zeroed
    # in a reused output buffer.
    pad_rows: torch.Tensor | None = None


def _raw(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as plain bytes when its dtype is FP8 (torch's CPU ``index_copy_`` has no
    float8 kernel; copying bytes moves the same values), else ``pool`` itself."""
    if pool.dtype in _FP8_DTYPES:
        return pool.view(torch.uint8)
    return pool


_FP8_DTYPES = frozenset(getattr(torch, name) for name in FP8_MAX)


class PagedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's K and V page pools (``[pages, page_size, Hkv, D]``)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedCache, layer_idx: int, group: PageGroup) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.layer_idx = layer_idx
        self.group = group
        self.is_sliding = group.window is not None
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    @property
    def record_past(self) -> bool:
        # Page tables are per group, so past recording is the cache's: transformers sets this
        # on each layer when it stops recording (generate's deferred stop check).
        return self.cache.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.cache.record_past = bool(value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv_dtype = self.cache.kv_dtype
        dtype = getattr(torch, kv_dtype) if kv_dtype is not None else key_states.dtype
        ps, cap = self.group.page_size, self.group.capacity
        hk, dk = key_states.shape[1], key_states.shape[-1]
        hv, dv = value_states.shape[1], value_states.shape[-1]
        self.device = key_states.device
        self.keys = torch.empty(cap, ps, hk, dk, dtype=dtype, device=self.device)
        self.values = torch.empty(cap, ps, hv, dv, dtype=dtype, device=self.device)
        if kv_dtype is not None:
            limit = FP8_MAX[kv_dtype]
            self.k_scale = _scale(key_states, limit)
            self.v_scale = _scale(value_states, limit)
        self.is_initialized = True

    def resize(self, pages: int) -> None:
        if not self.is_initialized:
            return
        assert self.keys is not None and self.values is not None
        old = min(self.keys.shape[0], pages)
        keys = self.keys.new_empty(pages, *self.keys.shape[1:])
        values = self.values.new_empty(pages, *self.values.shape[1:])
        _raw(keys)[:old] = _raw(self.keys)[:old]
        _raw(values)[:old] = _raw(self.values)[:old]
        self.keys, self.values = keys, values

    def move_pages(self, sources: list[int], destinations: list[int]) -> None:
        """Copy page ``sources[i]`` to page ``destinations[i]`` in both pools (as bytes)."""
        if not self.is_initialized or not sources:
            return
        assert self.keys is not None and self.values is not None
        src = torch.tensor(sources, dtype=torch.long, device=self.keys.device)
        dst = torch.tensor(destinations, dtype=torch.long, device=self.keys.device)
        for pool in (self.keys, self.values):
            raw = _raw(pool)
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def keep_pages(self, live: list[int], pages: int) -> None:
        """New pools of ``pages`` pages holding page ``live[i]`` at page ``i``."""
        if not self.is_initialized:
            return
        assert self.keys is not None and self.values is not None
        src = torch.tensor(live, dtype=torch.long, device=self.keys.device)
        keys = self.keys.new_empty(pages, *self.keys.shape[1:])
        values = self.values.new_empty(pages, *self.values.shape[1:])
        _raw(keys)[: len(live)] = _raw(self.keys).index_select(0, src)
        _raw(values)[: len(live)] = _raw(self.values).index_select(0, src)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.cache._step
        if step is None:
            raise NoActiveScopeError(
                f"PagedCache.update (layer {self.layer_idx}) outside a forward of the model it "
                "was made for: pass it to that model's forward or generate (wrapped by use())"
            )
        b, q = step.batch_size, step.q_len
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if (
                not isinstance(x, torch.Tensor)
                or x.dim() != 4
                or (x.shape[0], x.shape[2]) != (b, q)
            ):
                raise UnsupportedModelError(
                    f"layer {self.layer_idx} wrote {name} of shape "
                    f"{tuple(getattr(x, 'shape', ()))} but the forward has batch {b} and {q} "
                    "new tokens; the paged cache expects [batch, kv_heads, new tokens, "
                    "head_dim] as transformers' attention layers write"
                )
            self._check_dtype(name, x)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        dst = step.dst[self.group.name]
        _write(self.keys, key_states, dst, step, self.k_scale, self.cache.kv_dtype)
        _write(self.values, value_states, dst, step, self.v_scale, self.cache.kv_dtype)
        return self.keys, self.values

    def _check_dtype(self, name: str, x: torch.Tensor) -> None:
        """K/V in a model dtype; without FP8 pages, the dtype the pools were made with (a
        silent cast would change the numbers the binding was checked for)."""
        pools = self.keys if self.is_initialized else None
        if x.dtype in _FP8_DTYPES or not x.is_floating_point():
            problem = "expected the model's floating dtype (float32, bfloat16 or float16)"
        elif self.cache.kv_dtype is None and pools is not None and x.dtype != pools.dtype:
            problem = f"expected {pools.dtype}, the dtype this layer's pages were made with"
        else:
            return
        raise InvalidBatchError(name, f"layer {self.layer_idx}: dtype {x.dtype}; {problem}")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask function ignores the sizes' content (attention applies causality, the
        # window and padding from the page tables); they describe the dense sequence.
        return self.cache.dense_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.dense_len

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        # The cache crops every layer at once (page tables are per group): Cache.crop.
        raise UnsupportedModelError("crop a PagedCache as a whole: cache.crop(n)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("reorder a PagedCache as a whole: cache.reorder_cache(idx)")

    def reset(self) -> None:
        self.k_scale = self.v_scale = None
        self.keys = self.values = None
        self.is_initialized = False

    def offload(self) -> None:
        raise UnsupportedModelError("a PagedCache is not offloaded")

    def prefetch(self) -> None:
        raise UnsupportedModelError("a PagedCache is not offloaded")


def _scale(x: torch.Tensor, limit: float) -> float:
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    return amax / limit if amax > 0.0 and amax == amax and amax != float("inf") else 1.0


def _write(
    pool: torch.Tensor,
    x: torch.Tensor,
    dst: torch.Tensor,
    step: _Step,
    scale: float | None,
    kv_dtype: str | None,
) -> None:
    b, h, q, d = x.shape
    # [B, H, q, D] -> [B * q, H, D]: a view when q == 1 (the projections write [B, q, H, D]).
    src = x.transpose(1, 2).reshape(b * q, h, d)
    if not step.all_real:
        src = src.index_select(0, step.q_rows)
    if kv_dtype is not None:
        limit = FP8_MAX[kv_dtype]
        assert scale is not None
        src = (src.float() / scale).clamp_(-limit, limit).to(pool.dtype)
        _raw(pool).view(-1, h, d).index_copy_(0, dst, _raw(src))
        return
    pool.view(-1, h, d).index_copy_(0, dst, src.to(pool.dtype))


PagedLayer.__module__ = _PUBLIC_MODULE
