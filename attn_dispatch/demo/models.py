"""The demo's two models (torch is imported here).

Target: a DeepSeek-style model whose attention is MLA. Per layer ``wq`` gives ``q_nope``/
``q_rope`` per head, ``wdkv`` gives the latent ``c_kv`` (``kv_lora_rank`` wide) and one shared
``k_rope``; the cache row of a token is ``[c_kv, k_rope]``. Decode and verify run absorbed
(``q_nope`` mapped into latent space by ``wuk``, attention over the latent cache with
``V = c_kv``, ``wuv`` maps the result back per head); prefill runs in the form the runner's
backend picks (``attention_form()``).

Draft: a GQA MHA model with its own K/V cache, derived from the target at start-up. The
target's LM head reads ``head_rank`` directions of its residual stream (``Shared.proj``); the
draft lives in those directions: its embedding is the target's projected onto them and its LM
head is the target's restricted to them, so with no context at all both predict the same next
token. The target's layers refine that prediction from the context (small residual updates),
which the draft, one narrow layer, mostly cannot see: it agrees with the target often, not
always, for a small fraction of the cost.

Weights are seeded random numbers: start-up is one ``randn`` per matrix, no training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import InvalidBatchError
from attn_dispatch.demo.shapes import DraftShape
from attn_dispatch.demo.shapes import TargetShape

AttendFn = Callable[..., torch.Tensor]
Caches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]


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


#: Largest finite value of each FP8 cache format.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _kv_scale(bound: float, kv_dtype: torch.dtype) -> float | None:
    """The per-layer scale of an FP8 cache whose values never exceed ``bound`` (None when the
    cache is not FP8): the cache holds ``x / scale``, so ``bound`` maps onto the format's max."""
    if kv_dtype not in FP8_MAX:
        return None
    return max(bound, 1e-6) / FP8_MAX[kv_dtype]


def _row_bound(w: torch.Tensor, width: int, pairs: bool) -> float:
    """A bound on ``|h @ w.T|`` per element for an RMS-normalised ``h`` (``||h|| = sqrt(width)``):
    Cauchy-Schwarz, times sqrt(2) when rotary pairs mix two rows, plus 5% for rounding."""
    row = float(w.float().norm(dim=-1).max())
    bound: float = row * width**0.5 * (2**0.5 if pairs else 1.0) * 1.05
    return bound


def _store(x: torch.Tensor, scale: float | None, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: ``x / scale`` in FP8 (clamped to the format), else ``x``."""
    if scale is None:
        return x.to(kv_dtype)
    limit = FP8_MAX[kv_dtype]
    return (x.float() / scale).clamp_(-limit, limit).to(kv_dtype)


def _load(x: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """What the cache's rows mean in ``dtype`` (dequantised when FP8)."""
    return x.to(dtype) if scale is None else (x.float() * scale).to(dtype)


def _norm_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RMS-normalised residual (fp32) as the input of the next matmuls (``dtype``)."""
    return _rms(x).to(dtype)


def _mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    h = _norm_in(x, up.dtype)
    return F.linear(F.silu(F.linear(h, up)), down).float()


def _weights(gen: torch.Generator, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
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


class TargetModel:
    """MLA target: decode and verify absorbed, prefill in the form its backend picks.

    Per layer its cache is ``[pages, page_size, kv_lora_rank + qk_rope]``; ``v_cache`` is None.
    The residual stream is fp32 whatever ``dtype`` (the matmuls' and the cache's) is."""

    kind = "mla"

    def __init__(
        self,
        shape: TargetShape,
        gen: torch.Generator,
        dtype: torch.dtype,
        attn_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        s = shape
        self.shape = s
        self.dtype = dtype
        self.attn_dtype = dtype if attn_dtype is None else attn_dtype
        self.kv_dtype = self.attn_dtype if kv_dtype is None else kv_dtype
        self.shared = Shared(s.vocab, s.hidden, s.rank, gen, dtype)
        w = _weights(gen, dtype)
        self.layers = []
        for _ in range(s.layers):
            self.layers.append(
                {
                    "wq": w(s.heads * (s.qk_nope + s.qk_rope), s.hidden),
                    "wdkv": w(s.kv_lora_rank + s.qk_rope, s.hidden),
                    "wuk": w(s.heads, s.qk_nope, s.kv_lora_rank),
                    "wuv": w(s.heads, s.v_head, s.kv_lora_rank),
                    "wo": w(s.hidden, s.heads * s.v_head, scale=s.out_scale),
                    "up": w(s.mlp, s.hidden),
                    "down": w(s.hidden, s.mlp, scale=s.mlp_scale),
                }
            )
        self.sm_scale = (s.qk_nope + s.qk_rope) ** -0.5
        # FP8 cache: one scale per layer for the latent row (MLA: V is part of it). c_kv is
        # RMS-normalised (|c| <= sqrt(kv_lora_rank)); k_rope is bounded by its weights.
        self.k_scales = [
            _kv_scale(
                max(
                    s.kv_lora_rank**0.5 * 1.05,
                    _row_bound(layer["wdkv"][s.kv_lora_rank :], s.hidden, True),
                ),
                self.kv_dtype,
            )
            for layer in self.layers
        ]

    def attn_config(self, *, page_size: int, device: str) -> AttnConfig:
        s = self.shape
        extra: dict[str, Any] = {}
        if "sm_scale" in AttnConfig.__dataclass_fields__:
            extra["sm_scale"] = self.sm_scale
        if self.kv_dtype in FP8_MAX:
            extra["kv_dtype"] = str(self.kv_dtype).removeprefix("torch.")
        return AttnConfig(
            kind="mla",
            num_q_heads=s.heads,
            num_kv_heads=1,
            head_dim=s.cache_width,
            v_head_dim=s.kv_lora_rank,
            dtype=str(self.attn_dtype).removeprefix("torch."),
            page_size=page_size,
            device=device,
            tree_verify=True,
            # The decompressed form of the same layers: each backend's form policy may pick it
            # (e.g. for a prefill without cached prefix); the model follows attention_form().
            mha_head_dim=s.qk_nope + s.qk_rope,
            mha_v_head_dim=s.v_head,
            **extra,
        )

    def make_caches(self, num_pages: int, page_size: int, device: str) -> Caches:
        width = self.shape.cache_width
        return [
            (torch.zeros(num_pages, page_size, width, dtype=self.kv_dtype, device=device), None)
            for _ in self.layers
        ]

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
        """Logits ``[T, vocab]`` (fp32). ``form`` is what the runner's backend chose for this
        batch: absorbed over the latent cache, or decompressed into per-head K/V (DeepSeek's
        choice for prefill), the same numbers up to rounding."""
        s = self.shape
        t = tokens.numel()
        dt, adt = self.dtype, self.attn_dtype
        x = self.shared.embed[tokens].float()
        for layer, (k_cache, _), k_scale in zip(self.layers, caches, self.k_scales, strict=True):
            h = _norm_in(x, dt)
            q = F.linear(h, layer["wq"]).view(t, s.heads, s.qk_nope + s.qk_rope)
            q_nope, q_rope = q[..., : s.qk_nope], _rope(q[..., s.qk_nope :].to(adt), positions)
            kv = F.linear(h, layer["wdkv"])
            c_kv = _norm_in(kv[:, : s.kv_lora_rank].float(), adt)
            k_rope = _rope(kv[:, None, s.kv_lora_rank :].to(adt), positions)[:, 0]
            # Write the new tokens' latent rows before attention (the data contract).
            stored = _store(torch.cat((c_kv, k_rope), dim=-1), k_scale, self.kv_dtype)
            k_cache.view(-1, s.cache_width)[rows] = stored
            scales: dict[str, float] = {} if k_scale is None else {"k_scale": k_scale}
            if k_scale is not None:  # the decompressed forms see what the cache holds
                latent = _load(stored, k_scale, adt)
                c_kv, k_rope = latent[:, : s.kv_lora_rank], latent[:, s.kv_lora_rank :]
            if form is AttnForm.MLA:
                q_latent = torch.einsum("thn,hnl->thl", q_nope, layer["wuk"])
                q_abs = torch.cat((q_latent.to(adt), q_rope), dim=-1).contiguous()
                o_latent = attend(q_abs, k_cache, None, sm_scale=self.sm_scale, **scales)
                o = torch.einsum("thl,hvl->thv", o_latent.to(dt), layer["wuv"])
            else:
                o = self._decompressed(
                    layer, q_nope, q_rope, c_kv, k_rope, k_cache, attend, form, batch, k_scale
                )
            x = x + F.linear(o.reshape(t, -1).to(dt), layer["wo"]).float()
            x = x + _mlp(x, layer["up"], layer["down"])
        return F.linear(_rms(x), self.shared.lm_head)

    def _up_proj(
        self, layer: dict[str, torch.Tensor], latent_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[N, latent + rope]`` -> K ``[N, H, nope + rope]``, V ``[N, H, v]``."""
        s = self.shape
        c, k_rope = latent_rows[:, : s.kv_lora_rank], latent_rows[:, s.kv_lora_rank :]
        c = c.to(self.dtype)
        k_nope = torch.einsum("tl,hnl->thn", c, layer["wuk"]).to(self.attn_dtype)
        k_rope = k_rope[:, None, :].expand(-1, s.heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1).contiguous()
        v = torch.einsum("tl,hvl->thv", c, layer["wuv"]).to(self.attn_dtype).contiguous()
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
        k_scale: float | None = None,
    ) -> torch.Tensor:
        from attn_dispatch.mla import gather_latent
        from attn_dispatch.mla import latent_prefix_chunks

        if batch is None:
            raise InvalidBatchError("batch", f"the {form.value!r} form needs the forward's batch")
        q = torch.cat((q_nope.to(self.attn_dtype), q_rope), dim=-1).contiguous()
        if form is AttnForm.MHA:
            # Whole sequences (prefix and new tokens), request after request.
            latent = _load(gather_latent(k_cache, batch), k_scale, self.attn_dtype)
            k, v = self._up_proj(layer, latent)
            return attend(q, k, v, sm_scale=self.sm_scale)
        k_new, v_new = self._up_proj(layer, torch.cat((c_kv, k_rope), dim=-1))
        chunks = latent_prefix_chunks(
            k_cache,
            batch,
            lambda rows: self._up_proj(layer, _load(rows, k_scale, self.attn_dtype)),
        )
        return attend(q, k_new, v_new, sm_scale=self.sm_scale, prefix=chunks)


class DraftModel:
    """GQA MHA draft with its own paged K/V caches, in the directions the target's head reads.

    Its embedding and LM head are the target's projected onto ``shared.proj`` (computed once
    here, not shared tensors): ``head_rank`` wide instead of ``hidden``, so its head costs
    ``head_rank / hidden`` of the target's."""

    kind = "mha"

    def __init__(
        self,
        shape: DraftShape,
        target: TargetModel,
        gen: torch.Generator,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        s = shape
        self.shape = s
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        shared = target.shared
        self.width = shared.proj.shape[0]
        self.embed = (shared.embed.float() @ shared.proj.t()).to(dtype)
        self.lm_head = (shared.lm_head @ shared.proj.t()).contiguous()
        w = _weights(gen, dtype)
        self.layers = []
        for _ in range(s.layers):
            self.layers.append(
                {
                    "wq": w(s.heads * s.head_dim, self.width),
                    "wk": w(s.kv_heads * s.head_dim, self.width),
                    "wv": w(s.kv_heads * s.head_dim, self.width),
                    "wo": w(self.width, s.heads * s.head_dim, scale=s.out_scale),
                    "up": w(s.mlp, self.width),
                    "down": w(self.width, s.mlp, scale=s.mlp_scale),
                }
            )
        self.sm_scale = s.head_dim**-0.5
        # FP8 cache: per-layer K and V scales from bounds on |K|, |V| (RMS-normalised input).
        self.kv_scales = [
            (
                _kv_scale(_row_bound(layer["wk"], self.width, True), self.kv_dtype),
                _kv_scale(_row_bound(layer["wv"], self.width, False), self.kv_dtype),
            )
            for layer in self.layers
        ]

    @property
    def params(self) -> int:
        return self.shape.params(self.width, self.lm_head.shape[0])

    def attn_config(self, *, page_size: int, device: str) -> AttnConfig:
        s = self.shape
        extra: dict[str, Any] = {}
        if "sm_scale" in AttnConfig.__dataclass_fields__:
            extra["sm_scale"] = self.sm_scale
        return AttnConfig(
            kind="mha",
            num_q_heads=s.heads,
            num_kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_dtype=str(self.kv_dtype).removeprefix("torch."),
            page_size=page_size,
            device=device,
            **extra,
        )

    def make_caches(self, num_pages: int, page_size: int, device: str) -> Caches:
        s = self.shape
        dims = (num_pages, page_size, s.kv_heads, s.head_dim)
        return [
            (
                torch.zeros(dims, dtype=self.kv_dtype, device=device),
                torch.zeros(dims, dtype=self.kv_dtype, device=device),
            )
            for _ in self.layers
        ]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        caches: Caches,
        attend: AttendFn,
    ) -> torch.Tensor:
        s = self.shape
        t = tokens.numel()
        x = self.embed[tokens].float()
        for layer, (k_cache, v_cache), (k_scale, v_scale) in zip(
            self.layers, caches, self.kv_scales, strict=True
        ):
            assert v_cache is not None
            h = _norm_in(x, self.dtype)
            q = _rope(F.linear(h, layer["wq"]).view(t, s.heads, s.head_dim), positions)
            k = _rope(F.linear(h, layer["wk"]).view(t, s.kv_heads, s.head_dim), positions)
            v = F.linear(h, layer["wv"]).view(t, s.kv_heads, s.head_dim)
            k_cache.view(-1, s.kv_heads, s.head_dim)[rows] = _store(k, k_scale, self.kv_dtype)
            v_cache.view(-1, s.kv_heads, s.head_dim)[rows] = _store(v, v_scale, self.kv_dtype)
            scales: dict[str, float] = {}
            if k_scale is not None and v_scale is not None:
                scales = {"k_scale": k_scale, "v_scale": v_scale}
            o = attend(q.contiguous(), k_cache, v_cache, sm_scale=self.sm_scale, **scales)
            x = x + F.linear(o.reshape(t, -1), layer["wo"]).float()
            x = x + _mlp(x, layer["up"], layer["down"])
        return F.linear(_rms(x), self.lm_head)

    def to(self, device: str) -> None:
        self.embed, self.lm_head = self.embed.to(device), self.lm_head.to(device)
        self.layers = [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]


def _target_to(model: TargetModel, device: str) -> None:
    sh = model.shared
    sh.embed, sh.lm_head, sh.proj = sh.embed.to(device), sh.lm_head.to(device), sh.proj.to(device)
    model.layers = [{k: v.to(device) for k, v in layer.items()} for layer in model.layers]


def build_models(
    target_shape: TargetShape,
    draft_shape: DraftShape,
    *,
    seed: int,
    dtype: torch.dtype,
    device: str,
    attn_dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[TargetModel, DraftModel]:
    """The seeded target and the draft derived from it, on ``device``; ``kv_dtype`` (e.g.
    ``torch.float8_e4m3fn``) is both runners' cache format (default: their compute dtype)."""
    gen = torch.Generator().manual_seed(seed)
    target = TargetModel(target_shape, gen, dtype, attn_dtype, kv_dtype)
    draft = DraftModel(draft_shape, target, gen, dtype, kv_dtype)
    if device != "cpu":
        _target_to(target, device)
        draft.to(device)
    return target, draft


__all__ = ["DraftModel", "DraftShape", "Shared", "TargetModel", "TargetShape", "greedy", "top_k"]


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
