"""Building blocks of the demo's two models: norm, rotary embedding, MLP, seeded weights, the
FP8 cache's storage rule, the target's embedding and LM head that the draft derives its own
from, and the deterministic greedy / top-k choice of tokens."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm

AttendFn = Callable[..., torch.Tensor]
Cache = tuple[torch.Tensor, torch.Tensor | None]  # (k_cache, v_cache or None: MLA)
Caches = Sequence[Cache]


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) over the last dim of ``x [T, ..., R]`` at ``pos [T]``."""
    half = x.shape[-1] // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(shape).to(x.dtype), ang.sin().view(shape).to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


#: Largest finite value of each FP8 cache format.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_scale(bound: float, kv_dtype: torch.dtype) -> float | None:
    """The per-layer scale of an FP8 cache whose values never exceed ``bound`` (None when the
    cache is not FP8): the cache holds ``x / scale``, so ``bound`` maps onto the format's max."""
    if kv_dtype not in FP8_MAX:
        return None
    return max(bound, 1e-6) / FP8_MAX[kv_dtype]


def row_bound(w: torch.Tensor, width: int, pairs: bool) -> float:
    """A bound on ``|h @ w.T|`` per element for an RMS-normalised ``h`` (``||h|| = sqrt(width)``):
    Cauchy-Schwarz, times sqrt(2) when rotary pairs mix two rows, plus 5% for rounding."""
    row = float(w.float().norm(dim=-1).max())
    bound: float = row * width**0.5 * (2**0.5 if pairs else 1.0) * 1.05
    return bound


def store(x: torch.Tensor, scale: float | None, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: ``x / scale`` in FP8 (clamped to the format), else ``x``."""
    if scale is None:
        return x.to(kv_dtype)
    limit = FP8_MAX[kv_dtype]
    return (x.float() / scale).clamp_(-limit, limit).to(kv_dtype)


def load(x: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """What the cache's rows mean in ``dtype`` (dequantised when FP8)."""
    return x.to(dtype) if scale is None else (x.float() * scale).to(dtype)


def norm_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RMS-normalised residual (fp32) as the input of the next matmuls (``dtype``)."""
    return rms(x).to(dtype)


def mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    h = norm_in(x, up.dtype)
    return F.linear(F.silu(F.linear(h, up)), down).float()


def weights(gen: torch.Generator, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """A seeded initialiser ``w(out, in, scale=1.0)`` scaled by the fan-in (the last dim).

    Matrices are ``[out, in]`` (``F.linear``'s layout: torch's fastest small-batch path)."""

    def w(*dims: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*dims, generator=gen)
        return t.mul_(scale / math.sqrt(dims[-1])).to(dtype)

    return w


class Shared:
    """The target's token embedding and LM head, and the directions the head reads.

    ``lm_head`` (``[vocab, hidden]``, fp32) is ``H @ proj`` for a random ``H [vocab, rank]``
    and orthonormal rows ``proj [rank, hidden]``: what the draft takes from the target."""

    def __init__(
        self, vocab: int, hidden: int, rank: int, gen: torch.Generator, dtype: torch.dtype
    ) -> None:
        self.embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
        q, _ = torch.linalg.qr(torch.randn(hidden, rank, generator=gen))
        self.proj = q.t().contiguous()
        # A wide logit spread keeps the greedy choice far from ties, so the verify path and
        # the decode path (different reduction orders) pick the same token. fp32 for the same
        # reason: bf16 logits of this size are rounded to whole numbers.
        self.lm_head = (torch.randn(vocab, rank, generator=gen) * 2.0) @ self.proj


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row; ties go to the lowest token id (``torch.argmax`` does not promise it)."""
    best = logits.max(dim=-1, keepdim=True).values
    ids = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    masked = torch.where(logits == best, ids, logits.shape[-1])
    return [int(i) for i in masked.min(dim=-1).values.tolist()]


def top_k(logits: torch.Tensor, k: int) -> list[list[int]]:
    """The ``k`` best ids per row, ties broken by the lower id (deterministic).

    Sorts the ``k + 4`` best of each row, not the whole vocabulary: a tie across more than
    four ids at the k-th place does not happen with these float logits."""
    vals, ids = logits.topk(min(k + 4, logits.shape[-1]), dim=-1)
    out = []
    for v, i in zip(vals.tolist(), ids.tolist(), strict=True):
        out.append([j for _, j in sorted(zip(v, i, strict=True), key=lambda p: (-p[0], p[1]))][:k])
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """What every layer of one forward shares: the new tokens' rope positions and cache rows,
    the attention call, and the form the runner's backend chose (with its batch)."""

    positions: torch.Tensor
    rows: torch.Tensor
    attend: AttendFn
    form: AttnForm
    batch: AttnBatch | None


class PagedModel(abc.ABC):
    """What both demo models are: token embedding, blocks of attention over the model's own
    paged cache plus an MLP (the residual stream in fp32), an LM head. Each model defines its
    attention (``_attention``), its cache rows (``_cache_rows``) and its attention shape
    (``_attn_shape``); the rest is here."""

    kind: str
    dtype: torch.dtype  # weights and matmuls
    attn_dtype: torch.dtype  # q, and the cache unless kv_dtype says otherwise
    kv_dtype: torch.dtype
    sm_scale: float
    embed: torch.Tensor
    lm_head: torch.Tensor  # fp32
    layers: list[dict[str, torch.Tensor]]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        caches: Caches,
        attend: AttendFn,
        form: AttnForm = AttnForm.MLA,
        batch: AttnBatch | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` (fp32) of ``tokens`` at rope ``positions``, whose K/V go to
        the flat cache ``rows``; ``form`` (MLA only) is what the runner's backend chose."""
        step = Step(positions, rows, attend, form, batch)
        x = self.embed[tokens].float()
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            o = self._attention(i, norm_in(x, self.dtype), cache, step)
            x = x + F.linear(o.reshape(tokens.numel(), -1).to(self.dtype), layer["wo"]).float()
            x = x + mlp(x, layer["up"], layer["down"])
        return F.linear(rms(x), self.lm_head)

    @abc.abstractmethod
    def _attention(self, i: int, h: torch.Tensor, cache: Cache, step: Step) -> torch.Tensor:
        """Layer ``i``'s attention output ``[T, heads, v]`` for its normalised input ``h``
        (writing the new tokens' K/V into ``cache`` first: the data contract)."""
        raise NotImplementedError

    @abc.abstractmethod
    def _cache_rows(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The shape of one token's row in the K cache and in the V cache (None: no V cache)."""
        raise NotImplementedError

    @abc.abstractmethod
    def _attn_shape(self) -> dict[str, Any]:
        """The ``AttnConfig`` fields that describe this model's attention layers."""
        raise NotImplementedError

    def attn_config(self, *, page_size: int, device: str) -> AttnConfig:
        return AttnConfig(
            dtype=dtype_name(self.attn_dtype),
            kv_dtype=dtype_name(self.kv_dtype),
            page_size=page_size,
            device=device,
            sm_scale=self.sm_scale,
            **self._attn_shape(),
        )

    def make_caches(self, num_pages: int, page_size: int, device: str) -> list[Cache]:
        """One zeroed paged cache per layer, in ``kv_dtype``."""
        k_row, v_row = self._cache_rows()

        def zeros(row: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros((num_pages, page_size, *row), dtype=self.kv_dtype, device=device)

        return [(zeros(k_row), None if v_row is None else zeros(v_row)) for _ in self.layers]

    def to(self, device: str) -> None:
        self.embed, self.lm_head = self.embed.to(device), self.lm_head.to(device)
        self.layers = [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]
