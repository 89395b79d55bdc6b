"""The demo's two models, their paged caches and their runners (torch is imported here).

Target: a small DeepSeek-style model whose attention is MLA in the absorbed form: per layer
``W_q`` gives ``q_nope``/``q_rope`` per head, ``W_dkv`` gives the latent ``c_kv``
(``kv_lora_rank`` wide) and one shared ``k_rope``; the cache row of a token is
``[c_kv, k_rope]`` and ``q_nope`` is absorbed into latent space with ``W_uk``, so attention
runs over the latent cache with ``V = c_kv`` and ``W_uv`` maps the result back per head.

Draft: a small GQA MHA model (its own K/V cache) that shares the target's embedding and LM
head, the way EAGLE/MTP drafts do, so its guesses are often the target's.

Both call ``attn_dispatch.attention`` in every layer: which kernel runs is the binding of the
runner whose ``attn_scope`` is open, never a global.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._forms import AttnForm
from attn_dispatch._scope import attention
from attn_dispatch._scope import attention_form
from attn_dispatch._scope import attn_scope

AttendFn = Callable[..., torch.Tensor]


class CacheFullError(AttnDispatchError, MemoryError):
    """The demo's page pool has no free page left."""


@dataclasses.dataclass(frozen=True, slots=True)
class TargetShape:
    """Sizes of the MLA target (a DeepSeek-V3 layer shrunk: latent 512 -> 64, rope 64 -> 16)."""

    vocab: int = 96
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    qk_nope: int = 32
    qk_rope: int = 16
    kv_lora_rank: int = 64
    v_head: int = 32
    mlp: int = 128
    # Small output projections: the residual stream stays close to the token embedding, so
    # the draft (same embedding and head) guesses the target's next token often, not always.
    out_scale: float = 0.25
    mlp_scale: float = 0.05

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope


@dataclasses.dataclass(frozen=True, slots=True)
class DraftShape:
    """Sizes of the GQA MHA draft."""

    hidden: int = 64
    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    out_scale: float = 0.1
    mlp_scale: float = 0.1


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) over the last dim of ``x [T, ..., R]`` at ``pos [T]``."""
    half = x.shape[-1] // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(shape).to(x.dtype), ang.sin().view(shape).to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(_rms(x) @ up) @ down


class Shared:
    """Embedding and LM head shared by target and draft."""

    def __init__(self, vocab: int, hidden: int, gen: torch.Generator, dtype: torch.dtype) -> None:
        self.embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
        # A wide logit spread keeps the greedy choice far from ties, so the verify path and the
        # decode path (different reduction orders) pick the same token.
        self.lm_head = (torch.randn(hidden, vocab, generator=gen) * 2.0).to(dtype)


def _weights(gen: torch.Generator, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """A seeded initialiser ``w(*dims, scale=1.0)`` scaled by the fan-in (``dims[-2]``)."""

    def w(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * scale / math.sqrt(dims[-2])).to(dtype)

    return w


class TargetModel:
    """MLA target: decode and verify absorbed, prefill in the form its backend picks.
    ``cache_rows(P, page)`` -> per layer
    ``[P, page, kv_lora_rank + qk_rope]``; ``v_cache`` is None."""

    kind = "mla"

    def __init__(
        self, shape: TargetShape, shared: Shared, gen: torch.Generator, dtype: torch.dtype
    ) -> None:
        s = shape
        self.shape = s
        self.shared = shared
        self.dtype = dtype
        w = _weights(gen, dtype)

        self.layers = []
        for _ in range(s.layers):
            self.layers.append(
                {
                    "wq": w(s.hidden, s.heads * (s.qk_nope + s.qk_rope)),
                    "wdkv": w(s.hidden, s.kv_lora_rank + s.qk_rope),
                    "wuk": w(s.heads, s.qk_nope, s.kv_lora_rank),
                    "wuv": w(s.heads, s.kv_lora_rank, s.v_head),
                    "wo": w(s.heads * s.v_head, s.hidden, scale=s.out_scale),
                    "up": w(s.hidden, s.mlp),
                    "down": w(s.mlp, s.hidden, scale=s.mlp_scale),
                }
            )
        self.sm_scale = (s.qk_nope + s.qk_rope) ** -0.5

    def attn_config(self, *, page_size: int, device: str) -> AttnConfig:
        s = self.shape
        return AttnConfig(
            kind="mla",
            num_q_heads=s.heads,
            num_kv_heads=1,
            head_dim=s.cache_width,
            v_head_dim=s.kv_lora_rank,
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=page_size,
            device=device,
            tree_verify=True,
            # The decompressed form of the same layers: each backend's form policy may pick it
            # (e.g. for a prefill without cached prefix); the model follows attention_form().
            mha_head_dim=s.qk_nope + s.qk_rope,
            mha_v_head_dim=s.v_head,
        )

    def make_caches(
        self, num_pages: int, page_size: int, device: str
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        width = self.shape.cache_width
        return [
            (torch.zeros(num_pages, page_size, width, dtype=self.dtype, device=device), None)
            for _ in self.layers
        ]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
        attend: AttendFn,
        form: AttnForm = AttnForm.MLA,
        batch: AttnBatch | None = None,
    ) -> torch.Tensor:
        """``form`` is what the runner's backend chose for this batch (``attention_form()``):
        absorbed over the latent cache, or decompressed into per-head K/V (DeepSeek's choice
        for prefill), the same numbers up to rounding."""
        s = self.shape
        t = tokens.numel()
        x = self.shared.embed[tokens]
        for layer, (k_cache, _) in zip(self.layers, caches, strict=True):
            h = _rms(x)
            q = (h @ layer["wq"]).view(t, s.heads, s.qk_nope + s.qk_rope)
            q_nope, q_rope = q[..., : s.qk_nope], _rope(q[..., s.qk_nope :], positions)
            kv = h @ layer["wdkv"]
            c_kv = _rms(kv[:, : s.kv_lora_rank])
            k_rope = _rope(kv[:, None, s.kv_lora_rank :], positions)[:, 0]
            # Write the new tokens' latent rows before attention (the data contract).
            k_cache.view(-1, s.cache_width)[rows] = torch.cat((c_kv, k_rope), dim=-1)
            if form is AttnForm.MLA:
                q_latent = torch.einsum("thn,hnl->thl", q_nope, layer["wuk"])
                q_abs = torch.cat((q_latent, q_rope), dim=-1).contiguous()
                o_latent = attend(q_abs, k_cache, None, sm_scale=self.sm_scale)
                o = torch.einsum("thl,hlv->thv", o_latent, layer["wuv"])
            else:
                o = self._decompressed(
                    layer, q_nope, q_rope, c_kv, k_rope, k_cache, attend, form, batch
                )
            x = x + o.reshape(t, -1) @ layer["wo"]
            x = x + _mlp(x, layer["up"], layer["down"])
        return _rms(x) @ self.shared.lm_head

    def _up_proj(
        self, layer: dict[str, torch.Tensor], latent_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[N, latent + rope]`` -> K ``[N, H, nope + rope]``, V ``[N, H, v]``."""
        s = self.shape
        c, k_rope = latent_rows[:, : s.kv_lora_rank], latent_rows[:, s.kv_lora_rank :]
        k_nope = torch.einsum("tl,hnl->thn", c, layer["wuk"])
        k_rope = k_rope[:, None, :].expand(-1, s.heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1).contiguous()
        v = torch.einsum("tl,hlv->thv", c, layer["wuv"]).contiguous()
        return k, v

    def _decompressed(
        self,
        layer: dict[str, torch.Tensor],
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        k_cache: torch.Tensor,
        attend: AttendFn,
        form: AttnForm,
        batch: AttnBatch | None,
    ) -> torch.Tensor:
        from attn_dispatch.mla import gather_latent
        from attn_dispatch.mla import latent_prefix_chunks

        if batch is None:
            raise InvalidBatchError("batch", f"the {form.value!r} form needs the forward's batch")
        q = torch.cat((q_nope, q_rope), dim=-1).contiguous()
        if form is AttnForm.MHA:
            # Whole sequences (prefix and new tokens), request after request.
            k, v = self._up_proj(layer, gather_latent(k_cache, batch))
            return attend(q, k, v, sm_scale=self.sm_scale)
        k_new, v_new = self._up_proj(layer, torch.cat((c_kv, k_rope), dim=-1))
        chunks = latent_prefix_chunks(k_cache, batch, lambda rows: self._up_proj(layer, rows))
        return attend(q, k_new, v_new, sm_scale=self.sm_scale, prefix=chunks)


class DraftModel:
    """GQA MHA draft with its own paged K/V caches."""

    kind = "mha"

    def __init__(
        self, shape: DraftShape, shared: Shared, gen: torch.Generator, dtype: torch.dtype
    ) -> None:
        s = shape
        self.shape = s
        self.shared = shared
        self.dtype = dtype
        w = _weights(gen, dtype)

        self.layers = []
        for _ in range(s.layers):
            self.layers.append(
                {
                    "wq": w(s.hidden, s.heads * s.head_dim),
                    "wk": w(s.hidden, s.kv_heads * s.head_dim),
                    "wv": w(s.hidden, s.kv_heads * s.head_dim),
                    "wo": w(s.heads * s.head_dim, s.hidden, scale=s.out_scale),
                    "up": w(s.hidden, s.mlp),
                    "down": w(s.mlp, s.hidden, scale=s.mlp_scale),
                }
            )
        self.sm_scale = s.head_dim**-0.5

    def attn_config(self, *, page_size: int, device: str) -> AttnConfig:
        s = self.shape
        return AttnConfig(
            kind="mha",
            num_q_heads=s.heads,
            num_kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=page_size,
            device=device,
        )

    def make_caches(
        self, num_pages: int, page_size: int, device: str
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        s = self.shape
        dims = (num_pages, page_size, s.kv_heads, s.head_dim)
        return [
            (
                torch.zeros(dims, dtype=self.dtype, device=device),
                torch.zeros(dims, dtype=self.dtype, device=device),
            )
            for _ in self.layers
        ]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
        attend: AttendFn,
    ) -> torch.Tensor:
        s = self.shape
        t = tokens.numel()
        x = self.shared.embed[tokens]
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            assert v_cache is not None
            h = _rms(x)
            q = _rope((h @ layer["wq"]).view(t, s.heads, s.head_dim), positions)
            k = _rope((h @ layer["wk"]).view(t, s.kv_heads, s.head_dim), positions)
            v = (h @ layer["wv"]).view(t, s.kv_heads, s.head_dim)
            k_cache.view(-1, s.kv_heads, s.head_dim)[rows] = k
            v_cache.view(-1, s.kv_heads, s.head_dim)[rows] = v
            o = attend(q.contiguous(), k_cache, v_cache, sm_scale=self.sm_scale)
            x = x + o.reshape(t, -1) @ layer["wo"]
            x = x + _mlp(x, layer["up"], layer["down"])
        return _rms(x) @ self.shared.lm_head


class PageAllocator:
    """A free list of page ids. ``alloc`` hands out the lowest free ids first."""

    def __init__(self, num_pages: int, label: str) -> None:
        self.num_pages = num_pages
        self.label = label
        self._free = list(range(num_pages - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"runner {self.label!r}: {n} pages requested, {len(self._free)} of "
                f"{self.num_pages} free; pass a larger --num-pages or fewer tokens"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        # Keep the list sorted high -> low so the lowest id is reused first (deterministic).
        self._free.extend(pages)
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)


@dataclasses.dataclass(slots=True)
class SeqKV:
    """One request's pages in one runner's cache and the number of tokens they hold."""

    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0


class Runner:
    """One model runner: a model, its own paged cache and its own ``attn_binding``."""

    def __init__(
        self,
        label: str,
        model: TargetModel | DraftModel,
        binding: Binding,
        *,
        num_pages: int,
        attend: AttendFn | None = None,
    ) -> None:
        self.label = label
        self.model = model
        self.attn_binding = binding
        cfg = binding.config
        self.page_size = cfg.page_size
        self.device = cfg.device
        self.num_pages = num_pages
        self.caches = model.make_caches(num_pages, cfg.page_size, cfg.device)
        self.allocator = PageAllocator(num_pages, label)
        # How layers reach a kernel: the scoped `attention` (the library's way) unless the demo
        # swaps in the legacy global lookup to show what that does.
        self.attend: AttendFn = attention if attend is None else attend
        self.scope: Callable[[Any, AttnBatch], AbstractContextManager[Any]] = attn_scope
        self.forwards = 0

    def reset(self) -> None:
        self.allocator = PageAllocator(self.num_pages, self.label)

    def reserve(self, seq: SeqKV, length: int) -> None:
        """Make ``seq`` own enough pages for ``length`` tokens (its length is the caller's)."""
        need = -(-length // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.allocator.alloc(need))

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Keep ``length`` tokens; pages past them go back to the free list."""
        keep = -(-length // self.page_size)
        if keep < len(seq.pages):
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
        seq.length = length

    def release(self, seq: SeqKV) -> None:
        self.truncate(seq, 0)

    def rows(self, pages: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Flat cache rows (page * page_size + slot) of token positions in a page table."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in positions]

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move cached tokens (every layer) from rows ``src`` to rows ``dst``."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.caches:
            for cache in (k_cache, v_cache):
                if cache is not None:
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[d] = flat[s]

    def forward(
        self,
        batch: AttnBatch,
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: Sequence[int],
    ) -> torch.Tensor:
        """One forward of this runner: logits ``[T, vocab]`` (fp32)."""
        dev = self.device
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        row = torch.tensor(rows, dtype=torch.long, device=dev)
        self.forwards += 1
        with self.scope(self, batch):
            if isinstance(self.model, TargetModel):
                # The backend's choice for this batch; the legacy pattern has no scope to ask.
                form = attention_form() if self.scope is attn_scope else AttnForm.MLA
                logits = self.model.forward(
                    tok, pos, row, self.caches, self.attend, form=form, batch=batch
                )
            else:
                logits = self.model.forward(tok, pos, row, self.caches, self.attend)
        return logits.float()


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row; ties go to the lowest token id (``torch.argmax`` does not promise it)."""
    best = logits.max(dim=-1, keepdim=True).values
    ids = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    masked = torch.where(logits == best, ids, logits.shape[-1])
    return masked.min(dim=-1).values.tolist()


def top_k(logits: torch.Tensor, k: int) -> list[list[int]]:
    """The ``k`` best ids per row, ties broken by the lower id (deterministic)."""
    vals = logits.tolist()
    return [sorted(range(len(r)), key=lambda i: (-r[i], i))[:k] for r in vals]
