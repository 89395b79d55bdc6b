"""One fused attention call of the ``sdpa`` backend, and the algebra of attention states.

A plan's *call* runs ``count`` requests of one shape through PyTorch's fused kernel, one
*part* (a key range) at a time; parts are merged through their LSE, sinks folded in the same
way. Rows that see no key (a custom mask that allows none) are an empty state: output 0 and
LSE -inf, as every backend gives them (the fused kernels return LSE 0 there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch.backend import InvalidBatchError

__all__ = [
    "Call",
    "MaskCache",
    "Part",
    "Source",
    "fused",
    "merge",
    "rows_of",
    "widen",
    "with_sinks",
]

NEG_INF = -math.inf
#: Where a call's keys live: the gather buffer or the cache itself (read in place).
SOURCE_BUF, SOURCE_CACHE = 0, 1
#: Keys or values of one layer call: (tensor, heads, head stride, row stride) in elements.
Source = tuple[torch.Tensor, int, int, int]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Part:
    """Keys ``k0:k1`` (positions in the request) of one call: a square top-left ``causal``
    block, an additive ``mask`` ``[queries, keys]``, or neither (every key visible).
    ``empty``: bool ``[queries]`` on the device, the rows the mask leaves no key (None when
    every row sees one)."""

    k0: int
    k1: int
    causal: bool = False
    mask: torch.Tensor | None = None
    empty: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Call:
    """``count`` requests with ``n`` query rows each, from q row ``q0`` on (adjacent), whose
    keys start at rows ``base + j * stride`` of ``source`` (the gather buffer or the cache)."""

    count: int
    q0: int
    n: int
    source: int
    base: int
    stride: int
    parts: tuple[Part, ...]


class MaskCache:
    """Additive masks in the compute dtype on the device; a pattern named by a ``key`` is
    made once per plan (calls with the same mask object can then be grouped). The storage
    has a multiple of 16 columns (CUDA's memory-efficient kernel needs aligned rows); the
    mask is a view of it."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.seen: dict[tuple[Any, ...], torch.Tensor] = {}

    def additive(self, allowed: torch.Tensor, key: tuple[Any, ...] | None = None) -> torch.Tensor:
        if key is not None and key in self.seen:
            return self.seen[key]
        n, k = allowed.shape
        store = torch.zeros(n, -(-k // 16) * 16, dtype=self.dtype, device=self.device)
        store[:, :k].masked_fill_(~allowed.to(self.device, torch.bool), NEG_INF)
        mask = store[:, :k]
        if key is not None:
            self.seen[key] = mask
        return mask


def rows_of(src: Source | None, call: Call, part: Part, e: int) -> torch.Tensor:
    """``[count, heads, k1 - k0, e]``: keys ``k0:k1`` of each request of ``call``, a view of
    ``src`` (``(tensor, heads, head stride, row stride)``).

    The view is checked against the extent of ``src`` itself, never its storage's: a cache
    that is a view of a larger tensor is read only where the view reaches.
    """
    assert src is not None
    t, h, hs, rs = src
    rows = part.k1 - part.k0
    start = (call.base + part.k0) * rs
    last = start + (call.count - 1) * call.stride * rs + (h - 1) * hs + (rows - 1) * rs + e - 1
    if rows < 1 or call.count < 1 or start < 0 or last >= t.numel():
        raise InvalidBatchError(
            "plan",
            f"sdpa: a call reads elements {start}..{last} of a tensor of {t.numel()}; the plan "
            "does not fit the tensors of this call: plan the batch again",
        )
    return t.as_strided(
        (call.count, h, rows, e), (call.stride * rs, hs, rs, 1), t.storage_offset() + start
    )


def widen(x: torch.Tensor, width: int, e: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., width]`` in ``dtype`` with zero columns up to ``e`` (a copy only when
    needed)."""
    if width == e:
        return x if x.dtype == dtype else x.to(dtype)
    return F.pad(x.to(dtype), (0, e - width))


def merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention states over disjoint keys -> the state over their union (fp32).
    Either may be empty (LSE -inf, output 0); two empty states merge into an empty one (the
    weight of -inf - -inf, NaN, is taken as 0.5: both outputs are 0)."""
    w = torch.sigmoid((l1 - l2).nan_to_num(nan=0.0)).unsqueeze(-1)
    return torch.lerp(o2.float(), o1.float(), w), torch.logaddexp(l1, l2)


def with_sinks(
    o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per head to the normaliser: ``out * sigmoid(lse - sink)`` and
    ``logaddexp(lse, sink)`` (a NaN sink gives NaN, +inf all-zero rows, -inf no sink; a row
    that saw no key keeps output 0 and gets LSE = its sink, as in every backend)."""
    s = sinks.to(o.device, torch.float32).view(1, -1, 1)
    return o.float() * torch.sigmoid(lse - s).unsqueeze(-1), torch.logaddexp(lse, s)


def fused(
    device_type: str,
    grouped: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    part: Part,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused call: ``[B, Hq, n, e]`` out and ``[B, Hq, n]`` float32 LSE (natural log;
    None when not asked for on CUDA). Rows in ``part.empty`` come back as an empty state.

    On CPU every call is ``aten._scaled_dot_product_flash_attention_for_cpu`` (the op the
    public function runs there), which returns the LSE. On CUDA calls that need no LSE go to
    ``scaled_dot_product_attention`` (FlashAttention, cuDNN or memory-efficient, chosen by
    PyTorch); calls that need it to the memory-efficient op.
    """
    lse: torch.Tensor | None
    if device_type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, part.causal, attn_mask=part.mask, scale=scale
        )
        lse = lse.float()
    elif not need_lse:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=part.mask, is_causal=part.causal, scale=scale, enable_gqa=grouped
        )
        lse = None
    else:
        # CUDA with the LSE: the memory-efficient op returns it (natural log, padded to 32
        # query rows). It takes no grouped heads: repeat K/V per query head.
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        mask = part.mask
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], *mask.shape)
        out, lse_p, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, part.causal, scale=scale
        )
        lse = lse_p[..., : q.shape[2]].float()
    if part.empty is not None:
        # The kernels give such a row LSE 0 (CPU) or NaN (CUDA): make it the empty state.
        out = out.masked_fill(part.empty[:, None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(part.empty, NEG_INF)
    return out, lse
