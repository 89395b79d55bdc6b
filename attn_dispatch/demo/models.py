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

from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch import AttnForm
from attn_dispatch import InvalidBatchError
from attn_dispatch.demo.draft import DraftModel
from attn_dispatch.demo.layers import Cache
from attn_dispatch.demo.layers import PagedModel
from attn_dispatch.demo.layers import Shared
from attn_dispatch.demo.layers import Step
from attn_dispatch.demo.layers import kv_scale
from attn_dispatch.demo.layers import load
from attn_dispatch.demo.layers import norm_in
from attn_dispatch.demo.layers import rope
from attn_dispatch.demo.layers import row_bound
from attn_dispatch.demo.layers import store
from attn_dispatch.demo.layers import weights
from attn_dispatch.demo.shapes import DraftShape
from attn_dispatch.demo.shapes import TargetShape


class TargetModel(PagedModel):
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
        self.embed, self.lm_head = self.shared.embed, self.shared.lm_head
        w = weights(gen, dtype)
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
            kv_scale(
                max(
                    s.kv_lora_rank**0.5 * 1.05,
                    row_bound(layer["wdkv"][s.kv_lora_rank :], s.hidden, True),
                ),
                self.kv_dtype,
            )
            for layer in self.layers
        ]

    def _attn_shape(self) -> dict[str, Any]:
        s = self.shape
        return dict(
            kind="mla",
            num_q_heads=s.heads,
            num_kv_heads=1,
            head_dim=s.cache_width,
            v_head_dim=s.kv_lora_rank,
            tree_verify=True,
            # The decompressed form of the same layers: each backend's form policy may pick it
            # (e.g. for a prefill without cached prefix); the model follows attention_form().
            mha_head_dim=s.qk_nope + s.qk_rope,
            mha_v_head_dim=s.v_head,
        )

    def _cache_rows(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        return (self.shape.cache_width,), None

    def _attention(self, i: int, h: torch.Tensor, cache: Cache, step: Step) -> torch.Tensor:
        """Absorbed over the latent cache, or decompressed into per-head K/V (DeepSeek's
        choice for prefill) when the runner's backend picked that form: the same numbers up to
        rounding."""
        s, layer, (k_cache, _), k_scale = self.shape, self.layers[i], cache, self.k_scales[i]
        t, adt = h.shape[0], self.attn_dtype
        q = F.linear(h, layer["wq"]).view(t, s.heads, s.qk_nope + s.qk_rope)
        q_nope, q_rope = q[..., : s.qk_nope], rope(q[..., s.qk_nope :].to(adt), step.positions)
        kv = F.linear(h, layer["wdkv"])
        c_kv = norm_in(kv[:, : s.kv_lora_rank].float(), adt)
        k_rope = rope(kv[:, None, s.kv_lora_rank :].to(adt), step.positions)[:, 0]
        # Write the new tokens' latent rows before attention (the data contract).
        stored = store(torch.cat((c_kv, k_rope), dim=-1), k_scale, self.kv_dtype)
        k_cache.view(-1, s.cache_width)[step.rows] = stored
        scales: dict[str, float] = {} if k_scale is None else {"k_scale": k_scale}
        if k_scale is not None:  # the decompressed forms see what the cache holds
            latent = load(stored, k_scale, adt)
            c_kv, k_rope = latent[:, : s.kv_lora_rank], latent[:, s.kv_lora_rank :]
        if step.form is AttnForm.MLA:
            q_latent = torch.einsum("thn,hnl->thl", q_nope, layer["wuk"])
            q_abs = torch.cat((q_latent.to(adt), q_rope), dim=-1).contiguous()
            o_latent = step.attend(q_abs, k_cache, None, sm_scale=self.sm_scale, **scales)
            return torch.einsum("thl,hvl->thv", o_latent.to(self.dtype), layer["wuv"])
        return self._decompressed(layer, q_nope, q_rope, c_kv, k_rope, k_cache, step, k_scale)

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
        step: Step,
        k_scale: float | None = None,
    ) -> torch.Tensor:
        from attn_dispatch.mla import gather_latent
        from attn_dispatch.mla import latent_prefix_chunks

        attend, form, batch = step.attend, step.form, step.batch
        if batch is None:
            raise InvalidBatchError("batch", f"the {form.value!r} form needs the forward's batch")
        q = torch.cat((q_nope.to(self.attn_dtype), q_rope), dim=-1).contiguous()
        if form is AttnForm.MHA:
            # Whole sequences (prefix and new tokens), request after request.
            latent = load(gather_latent(k_cache, batch), k_scale, self.attn_dtype)
            k, v = self._up_proj(layer, latent)
            return attend(q, k, v, sm_scale=self.sm_scale)
        k_new, v_new = self._up_proj(layer, torch.cat((c_kv, k_rope), dim=-1))
        chunks = latent_prefix_chunks(
            k_cache,
            batch,
            lambda rows: self._up_proj(layer, load(rows, k_scale, self.attn_dtype)),
        )
        return attend(q, k_new, v_new, sm_scale=self.sm_scale, prefix=chunks)


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
    draft = DraftModel(draft_shape, target.shared, gen, dtype, kv_dtype)
    if device != "cpu":
        target.to(device)
        draft.to(device)
    return target, draft


__all__ = ["DraftModel", "TargetModel", "build_models"]
