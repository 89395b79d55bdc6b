"""CPU attention kernels through the public API, side by side with a memory-read bandwidth.

    python bench/kernels_cpu.py [--backends torch,native] [--repeats 7] [--json PATH]

Every row is measured in this one run next to a plain memory read (summing a large bf16
tensor), so the GB/s ratios hold on a noisy machine; absolute times mean little.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Binding
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import list_backends
from attn_dispatch._table import format_table


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    phase: Phase
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    batch: int
    context: int
    q_len: int
    page_size: int


WORKLOADS = [
    Workload("mla-decode", "mla", Phase.DECODE, 16, 1, 576, 512, 8, 2048, 1, 64),
    Workload("gqa-decode", "mha", Phase.DECODE, 32, 8, 128, 128, 8, 2048, 1, 64),
    Workload("gqa-prefill+prefix", "mha", Phase.PREFILL, 32, 8, 128, 128, 2, 1024, 128, 64),
]


def kv_bytes(w: Workload) -> int:
    """Bytes of KV cache a kernel must read once per layer (bf16)."""
    per_token = w.head_dim * 2 if w.kind == "mla" else 2 * w.kv_heads * w.head_dim * 2
    return w.batch * w.context * per_token


def setup(
    w: Workload,
) -> tuple[AttnConfig, AttnBatch, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    pages_per = math.ceil(w.context / w.page_size)
    total = pages_per * w.batch
    perm = torch.randperm(total, generator=g).tolist()
    tables = [perm[i * pages_per : (i + 1) * pages_per] for i in range(w.batch)]
    config = AttnConfig(
        kind=w.kind,  # type: ignore[arg-type]
        num_q_heads=w.heads,
        num_kv_heads=w.kv_heads,
        head_dim=w.head_dim,
        v_head_dim=w.v_head_dim,
        dtype="bfloat16",
        page_size=w.page_size,
    )
    batch = AttnBatch.build(
        w.phase,
        q_lens=[w.q_len] * w.batch,
        kv_lens=[w.context] * w.batch,
        page_tables=tables,
        page_size=w.page_size,
        num_pages=total,
    )
    q = torch.randn(w.batch * w.q_len, w.heads, w.head_dim, generator=g).bfloat16()
    if w.kind == "mla":
        k = torch.randn(total, w.page_size, w.head_dim, generator=g).bfloat16()
        v = None
    else:
        k = torch.randn(total, w.page_size, w.kv_heads, w.head_dim, generator=g).bfloat16()
        v = torch.randn(total, w.page_size, w.kv_heads, w.v_head_dim, generator=g).bfloat16()
    return config, batch, q, k, v


def forward(
    binding: Binding, batch: AttnBatch, q: Tensor, k: Tensor, v: Tensor | None, scale: float
) -> None:
    with attn_scope(binding, batch):
        attention(q, k, v, sm_scale=scale)


def median_time(fn: object, repeats: int) -> float:
    fn()  # type: ignore[operator]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(repeats: int) -> float:
    """GB/s of summing a 512 MiB bf16 tensor (torch's own threads), a plain memory read."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)
    t = median_time(lambda: x.sum(), repeats)
    return x.numel() * 2 / t / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--backends", default=None, help="comma list (default: every available CPU backend)"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(__file__), "results", "kernels_cpu.json")
    )
    args = p.parse_args(argv)

    registered = list_backends()
    names = (
        args.backends.split(",")
        if args.backends
        else [n for n in ("torch", "native") if n in registered]
    )
    bw = read_bandwidth(args.repeats)
    print(f"threads={torch.get_num_threads()}  memory read (sum of 512 MiB bf16): {bw:.2f} GB/s\n")
    rows, records = [], []
    for w in WORKLOADS:
        config, batch, q, k, v = setup(w)
        base = None
        for name in names:
            caps = registered.get(name)
            why = [] if caps is None else caps.reasons(config, w.phase)
            if caps is None or why:
                rows.append(
                    (
                        w.name,
                        name,
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "skipped: " + ("; ".join(why) or "not registered"),
                    )
                )
                continue
            binding = bind(name, config)
            scale = 1 / math.sqrt(w.head_dim)

            t = median_time(
                functools.partial(forward, binding, batch, q, k, v, scale), args.repeats
            )
            gbs = kv_bytes(w) / t / 1e9
            if name == "torch":
                base = t
            speedup = f"{base / t:.2f}x" if base else "-"
            tokens = w.batch * w.q_len / t
            rows.append(
                (
                    w.name,
                    name,
                    f"{t * 1e3:.2f}",
                    f"{tokens:,.0f}",
                    f"{gbs:.2f}",
                    f"{gbs / bw:.2f}",
                    speedup,
                    "",
                )
            )
            records.append(
                dict(
                    workload=w.name,
                    backend=name,
                    seconds=t,
                    tokens_per_s=tokens,
                    kv_gbs=gbs,
                    ratio_to_read_bw=gbs / bw,
                    speedup_vs_torch=(base / t) if base else None,
                )
            )
    print(
        format_table(
            ("workload", "backend", "ms", "tokens/s", "KV GB/s", "of read bw", "vs torch", "note"),
            rows,
        )
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            dict(read_bandwidth_gbs=bw, threads=torch.get_num_threads(), rows=records), f, indent=2
        )
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
