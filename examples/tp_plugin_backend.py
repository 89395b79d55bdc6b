"""A tiny third-party attention backend, found through the entry point group.

A plugin distribution declares, in its metadata (``entry_points.txt`` of its ``.dist-info``,
written from ``[project.entry-points."attn_dispatch.backends"]`` in its pyproject)::

    [attn_dispatch.backends]
    tpdemo = tp_plugin_backend:register

attn_dispatch calls ``register(registry)`` the first time a registry is used in a process, so every
process of a distributed job that has the plugin installed knows the name ``tpdemo`` without
any code of its own. The kernel is deliberately naive (one request at a time); its numbers
match the ``torch`` reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import Registry

NAME = "tpdemo"
CAPABILITIES = Capabilities(
    kinds={"mha"},
    devices={"cpu", "cuda"},
    dtypes={"float32", "float16", "bfloat16"},
    custom_mask=False,
    requires=("torch",),
    description="example plugin: naive per-request paged attention (causal only)",
)


def register(registry: Registry) -> None:
    """The entry point: called with the registry that loads it (once per registry)."""
    registry.register(NAME, capabilities=CAPABILITIES, factory=NaiveBackend, replace=True)


@dataclasses.dataclass(frozen=True, slots=True)
class NaivePlan:
    batch: AttnBatch
    qo: list[int]
    kv: list[int]
    lens: list[int]


class NaiveBackend(BackendBase):
    """Causal paged attention, one request at a time (host lists come from the batch)."""

    name = NAME

    def __init__(self, config: AttnConfig) -> None:
        self.config = config

    def plan(self, batch: AttnBatch) -> NaivePlan:
        # Host copies only: planning never waits on the device.
        return NaivePlan(
            batch,
            batch.qo_indptr_host.tolist(),
            batch.kv_indptr_host.tolist(),
            batch.kv_lens_host.tolist(),
        )

    def handler(self, phase: Phase) -> Callable[..., torch.Tensor]:
        return self.run

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: Any, plan: NaivePlan, scale: float
    ) -> torch.Tensor:
        c = self.config
        group = c.num_q_heads // c.num_kv_heads
        outs = []
        for i in range(len(plan.lens)):
            n, q0, q1 = plan.lens[i], plan.qo[i], plan.qo[i + 1]
            pages = plan.batch.kv_indices[plan.kv[i] : plan.kv[i + 1]].long()
            k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
            v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
            qi = q[q0:q1].float()
            s = torch.einsum("qhd,khd->hqk", qi, k) * scale
            pos = torch.arange(n - (q1 - q0), n, device=q.device)
            s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos[:, None], -math.inf)
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(dim=-1), v))
        return torch.cat(outs).to(q.dtype)
