"""Tiny paged-KV fixtures and a test backend for the compile / CUDA-graph / distributed tests.

``ScaledBackend`` is the torch reference times a constant: two runners bound to "torch" and to
a scaled variant give outputs that differ by exactly that factor, so a test can tell which
runner's kernel served a call from the numbers alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import register_backend
from attn_dispatch.backend import unregister_backend
from attn_dispatch.backends.reference import CAPABILITIES as _REFERENCE_CAPS
from attn_dispatch.backends.reference.backend import TorchBackend

# Its handler takes no out= (the core copies into a caller's buffer), so it does not declare it.
TORCH_CAPS = dataclasses.replace(_REFERENCE_CAPS, out_buffer=False)


class ScaledBackend(BackendBase):
    """The reference backend with its output multiplied by ``factor``; counts plan/run calls."""

    def __init__(self, config: AttnConfig, *, factor: float = 2.0, name: str = "scaled") -> None:
        self.inner = TorchBackend(config)
        self.factor = factor
        self.name = name
        self.plans: list[Any] = []
        self.runs: list[Any] = []

    def plan(self, batch: AttnBatch) -> Any:
        plan = self.inner.plan(batch)
        self.plans.append(plan)
        return plan

    def handler(self, phase: Phase) -> Callable[..., torch.Tensor]:
        def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> torch.Tensor:
            self.runs.append(plan)
            return self.inner.run(q, k, v, plan, sm_scale) * self.factor

        return run


def register_scaled(name: str, factor: float) -> Iterator[str]:
    """Register ``name`` (a ScaledBackend) for one test; unregister it afterwards."""
    register_backend(
        name,
        capabilities=TORCH_CAPS,
        factory=lambda config, **opts: ScaledBackend(config, factor=factor, name=name, **opts),
        replace=True,
    )
    try:
        yield name
    finally:
        unregister_backend(name)


@dataclasses.dataclass
class Paged:
    """A config, a batch and matching tensors."""

    config: AttnConfig
    batch: AttnBatch
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor | None
    sm_scale: float


def mha_config(heads: int = 4, kv_heads: int = 2, dim: int = 8, page_size: int = 4) -> AttnConfig:
    return AttnConfig(
        kind="mha",
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype="float32",
        page_size=page_size,
    )


def mla_config(heads: int = 2, dim: int = 12, v_dim: int = 8, page_size: int = 4) -> AttnConfig:
    return AttnConfig(
        kind="mla",
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=dim,
        v_head_dim=v_dim,
        dtype="float32",
        page_size=page_size,
    )


def make_cache(config: AttnConfig, num_pages: int, seed: int, device: str = "cpu") -> Any:
    g = torch.Generator().manual_seed(seed)
    ps = config.page_size
    dt = getattr(torch, config.dtype)
    if config.kind == "mla":
        k = torch.randn(num_pages, ps, config.head_dim, generator=g).to(device, dt)
        return k, None
    assert config.v_head_dim is not None
    k = torch.randn(num_pages, ps, config.num_kv_heads, config.head_dim, generator=g)
    v = torch.randn(num_pages, ps, config.num_kv_heads, config.v_head_dim, generator=g)
    return k.to(device, dt), v.to(device, dt)


def make_batch(
    config: AttnConfig,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_pages: int,
    seed: int,
    device: str = "cpu",
) -> tuple[AttnBatch, torch.Tensor]:
    """A batch whose page tables are a random permutation of the cache's pages, and its q."""
    g = torch.Generator().manual_seed(seed)
    ps = config.page_size
    need = [-(-k // ps) for k in kv_lens]
    perm = torch.randperm(num_pages, generator=g).tolist()
    assert sum(need) <= num_pages
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    batch = AttnBatch.build(
        phase,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=ps,
        num_pages=num_pages,
        device=device,
    )
    dt = getattr(torch, config.dtype)
    q = torch.randn(sum(q_lens), config.num_q_heads, config.head_dim, generator=g)
    return batch, q.to(device, dt)


def paged(
    config: AttnConfig,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_pages: int = 12,
    seed: int = 0,
    device: str = "cpu",
) -> Paged:
    k, v = make_cache(config, num_pages, seed, device)
    batch, q = make_batch(
        config, phase, q_lens, kv_lens, num_pages=num_pages, seed=seed + 1, device=device
    )
    return Paged(config, batch, q, k, v, config.head_dim**-0.5)
