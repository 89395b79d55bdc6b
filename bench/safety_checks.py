"""What the safety checks cost on the host, side by side in one run.

    python bench/safety_checks.py            # table in microseconds, best of 7 runs
    python bench/safety_checks.py --quick    # a smoke run: few repeats, figures not comparable

Rows: the plan-time snapshot (``BatchSnapshot.of``: private copies of the index tensors plus
the batch-contract checks) at several batch sizes, ``AttnBatch`` construction (the same
checks), and the per-call checks every CPU path runs before a kernel (``check_plan``: the
plan is the very object its backend issued, and ``TensorChecks.check``). The yardstick
column divides by one ``torch.empty(16)`` measured in the same run, so figures from a loaded
or slower machine can be compared. Host-side Python
and small torch CPU ops only: no kernel ISA path is involved (the figures name the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import Phase
from attn_dispatch import bind
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch._snapshot import BatchSnapshot
from attn_dispatch._tensor_checks import TensorChecks

#: Loop sizes: (calls per run, runs, warm-up calls); --quick shrinks them for a smoke run.
SIZES = {"full": (2000, 7, 200), "quick": (20, 2, 2)}
_size = SIZES["full"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Plan(PlanBase):
    num_tokens: int


def best_us(fn: Callable[[], Any], scale: int = 1) -> float:
    """Best per-call time in microseconds over the runs (``scale`` times more calls each for
    the cheapest rows)."""
    n, runs, warm = _size
    n *= scale
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def decode_batch(b: int, ps: int = 16, pages_per: int = 8) -> AttnBatch:
    return AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * b,
        kv_lens=[ps * (pages_per - 1) + 1 + i % ps for i in range(b)],
        page_tables=[[i * pages_per + j for j in range(pages_per)] for i in range(b)],
        page_size=ps,
    )


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    global _size
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few calls per row")
    args = ap.parse_args(argv)
    _size = SIZES["quick" if args.quick else "full"]
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # plans only: no kernel runs here
    unit = best_us(lambda: torch.empty(16))
    rows: list[tuple[str, float]] = []
    for b in (1, 16, 64, 256):
        batch = decode_batch(b)
        rows.append(
            (
                f"BatchSnapshot.of, decode batch {b}",
                best_us(functools.partial(BatchSnapshot.of, batch, 16)),
            )
        )
    for b in (16, 256):
        batch = decode_batch(b)
        build = functools.partial(
            AttnBatch,
            phase=batch.phase,
            qo_indptr=batch.qo_indptr,
            kv_indptr=batch.kv_indptr,
            kv_indices=batch.kv_indices,
            kv_lens=batch.kv_lens,
            page_size=16,
        )
        rows.append((f"AttnBatch(...) construction, batch {b}", best_us(build)))
    cfg = AttnConfig("mha", 32, 8, 128, dtype="bfloat16", page_size=16)
    batch = decode_batch(16)
    # Whole plans at batch 16, for scale: what the snapshot is part of (torch, triton) and
    # what it replaces (the native backend's own checks, on branches where native has them).
    for name in ("torch", "native", "triton"):
        try:
            backend = bind(name, cfg).backend(Phase.DECODE)
        except AttnDispatchError as exc:
            print(f"({name}: {str(exc).splitlines()[0][:90]})")
            continue
        rows.append(
            (f"{name} plan(), decode batch 16", best_us(functools.partial(backend.plan, batch)))
        )
    snap = BatchSnapshot.of(batch, 16)
    q = torch.empty(16, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(16 * 8, 16, 8, 128, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    for layout in ("any", "rows", "contiguous"):
        checks = TensorChecks.of(cfg, backend="bench", layout=layout)
        rows.append(
            (
                f"TensorChecks.check per call (layout {layout!r})",
                best_us(functools.partial(checks.check, snap, q, k, v), 10),
            )
        )

    owner = object()  # stands for the backend object that issued the plan
    plan = issue_plan(owner, _Plan(num_tokens=16))
    rows.append(("check_plan per call", best_us(lambda: check_plan(plan, owner, "bench"), 10)))

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, 1 thread; host-side checks only")
    print(f"yardstick: torch.empty(16) = {unit:.2f} us\n")
    print(f"| {'what':<48} | {'us':>7} | {'x torch.empty':>13} |")
    print(f"| {'-' * 48} | {'-' * 7} | {'-' * 13} |")
    for name, us in rows:
        print(f"| {name:<48} | {us:7.2f} | {us / unit:13.1f} |")


if __name__ == "__main__":
    main()
