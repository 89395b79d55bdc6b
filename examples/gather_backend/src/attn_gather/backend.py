"""The kernel: for each request, gather its pages into dense K/V and run PyTorch's
``scaled_dot_product_attention`` with the request's mask (causal, bottom-right aligned, or
its tree-verify mask).

Everything a backend needs comes from ``attn_dispatch`` and ``attn_dispatch.backend``:
``BackendBase`` (the optional members' defaults), ``PlanBase`` / ``issue_plan`` /
``check_plan`` (a handler takes only the plan its backend issued), ``BatchSnapshot`` (a checked
private copy of the batch's index tensors) and ``TensorChecks`` (the per-call shape, dtype,
device and page-range checks, raising ``InvalidBatchError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backend import check_plan
from attn_dispatch.backend import issue_plan
from attn_gather.plugin import NAME


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request of a planned batch: its query rows, its pages and, per query, the keys it
    sees (bool ``[q_len, kv_len]``)."""

    rows: slice
    pages: torch.Tensor
    kv_len: int
    visible: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GatherPlan(PlanBase):
    snapshot: BatchSnapshot
    requests: tuple[Request, ...]


class GatherBackend(BackendBase):
    """Paged attention, one request at a time: gather, then dense SDPA."""

    name = NAME

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        if options:
            raise TypeError(f"{NAME}: takes no options, got {sorted(options)!r}")
        self.config = config
        self.checks = TensorChecks.of(config, backend=NAME)

    def plan(self, batch: Any) -> GatherPlan:
        """Once per forward, on the host: each request's pages and mask."""
        snap = BatchSnapshot.of(batch, self.config.page_size)
        qo = snap.qo_indptr_host.tolist()
        kv = snap.kv_indptr_host.tolist()
        lens = snap.kv_lens_host.tolist()
        indices = snap.kv_indices.cpu()
        masks = snap.custom_mask.cpu() if snap.custom_mask is not None else None
        mask_at = snap.mask_indptr.cpu().tolist() if snap.mask_indptr is not None else None
        requests = []
        for i, kv_len in enumerate(lens):
            q_len = qo[i + 1] - qo[i]
            if masks is not None and mask_at is not None:
                visible = masks[mask_at[i] : mask_at[i + 1]].view(q_len, kv_len).clone()
            else:  # causal: query j sits at position kv_len - q_len + j
                keys = torch.arange(kv_len)
                visible = keys[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
            pages = indices[kv[i] : kv[i + 1]].clone()
            requests.append(Request(slice(qo[i], qo[i + 1]), pages, kv_len, visible))
        return issue_plan(self, GatherPlan(snap, tuple(requests)))

    def handler(self, phase: Phase) -> Callable[..., torch.Tensor]:
        return self.run

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: GatherPlan,
        sm_scale: float,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[tokens, num_q_heads, v_head_dim]``; written into ``out`` when the caller gave
        one (``Capabilities(out_buffer=True)``), and ``out`` returned."""
        check_plan(plan, self, NAME)
        self.checks.check(plan.snapshot, q, k_cache, v_cache)
        assert v_cache is not None  # TensorChecks refuses a missing v_cache for MHA
        if out is None:
            c = self.config
            out = q.new_zeros(q.shape[0], c.num_q_heads, c.v_head_dim or c.head_dim)
        else:  # the core checked it already; a call without a binding did not
            self.checks.check_out(out, q, k_cache, v_cache)
        for r in plan.requests:
            if r.rows.stop == r.rows.start:
                continue
            k = k_cache[r.pages].flatten(0, 1)[: r.kv_len]  # [kv_len, Hkv, D]
            v = v_cache[r.pages].flatten(0, 1)[: r.kv_len]
            o = F.scaled_dot_product_attention(
                q[r.rows].transpose(0, 1),  # [Hq, q_len, D]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=r.visible,
                scale=sm_scale,
                enable_gqa=True,
            )
            seen = r.visible.any(-1)  # a row that sees no key gives zeros, not NaN
            out[r.rows] = torch.where(seen[:, None, None], o.transpose(0, 1), 0)
        return out  # every row written: each belongs to one request
