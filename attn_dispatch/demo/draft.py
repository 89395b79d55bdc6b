"""The draft: a GQA MHA model with its own paged K/V cache, derived from the target at start-up
(see ``models``): it lives in the directions of the residual stream the target's LM head reads."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch.demo.layers import Cache
from attn_dispatch.demo.layers import PagedModel
from attn_dispatch.demo.layers import Shared
from attn_dispatch.demo.layers import Step
from attn_dispatch.demo.layers import kv_scale
from attn_dispatch.demo.layers import rope
from attn_dispatch.demo.layers import row_bound
from attn_dispatch.demo.layers import store
from attn_dispatch.demo.layers import weights
from attn_dispatch.demo.shapes import DraftShape


class DraftModel(PagedModel):
    """GQA MHA draft with its own paged K/V caches, in the directions the target's head reads.

    Its embedding and LM head are the target's projected onto ``shared.proj`` (computed once
    here, not shared tensors): ``head_rank`` wide instead of ``hidden``, so its head costs
    ``head_rank / hidden`` of the target's."""

    kind = "mha"

    def __init__(
        self,
        shape: DraftShape,
        shared: Shared,
        gen: torch.Generator,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        s = shape
        self.shape = s
        self.dtype = self.attn_dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.width = shared.proj.shape[0]
        self.embed = (shared.embed.float() @ shared.proj.t()).to(dtype)
        self.lm_head = (shared.lm_head @ shared.proj.t()).contiguous()
        w = weights(gen, dtype)
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
                kv_scale(row_bound(layer["wk"], self.width, True), self.kv_dtype),
                kv_scale(row_bound(layer["wv"], self.width, False), self.kv_dtype),
            )
            for layer in self.layers
        ]

    @property
    def params(self) -> int:
        return self.shape.params(self.width, self.lm_head.shape[0])

    def _attn_shape(self) -> dict[str, Any]:
        s = self.shape
        return dict(kind="mha", num_q_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim)

    def _cache_rows(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        row = (self.shape.kv_heads, self.shape.head_dim)
        return row, row

    def _attention(self, i: int, h: torch.Tensor, cache: Cache, step: Step) -> torch.Tensor:
        s, layer, (k_cache, v_cache) = self.shape, self.layers[i], cache
        k_scale, v_scale = self.kv_scales[i]
        assert v_cache is not None
        t, pos = h.shape[0], step.positions
        q = rope(F.linear(h, layer["wq"]).view(t, s.heads, s.head_dim), pos)
        k = rope(F.linear(h, layer["wk"]).view(t, s.kv_heads, s.head_dim), pos)
        v = F.linear(h, layer["wv"]).view(t, s.kv_heads, s.head_dim)
        k_cache.view(-1, s.kv_heads, s.head_dim)[step.rows] = store(k, k_scale, self.kv_dtype)
        v_cache.view(-1, s.kv_heads, s.head_dim)[step.rows] = store(v, v_scale, self.kv_dtype)
        scales: dict[str, float] = {}
        if k_scale is not None and v_scale is not None:
            scales = {"k_scale": k_scale, "v_scale": v_scale}
        return step.attend(q.contiguous(), k_cache, v_cache, sm_scale=self.sm_scale, **scales)
