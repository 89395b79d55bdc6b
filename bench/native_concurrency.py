"""Two threads serving two native runners at once against one thread with one runner.

    python bench/native_concurrency.py [--threads-per-call 1] [--calls 200] [--rounds 5]
    python bench/native_concurrency.py --quick   # smoke run

What a serving process with two engines (or a target and a draft runner) in two threads does:
each thread calls ``na_run`` through its own ``NativeBackend`` (its own runner and plan) for
one decode layer, GQA 8/2 x 128, batch 8 x 2048 keys, page 16. Rows, measured side by side
(the two setups alternate round by round, so load changes hit both alike; medians):

- ``1 thread x 1 runner``: one Python thread makes ``--calls`` calls;
- ``2 threads x 2 runners``: two Python threads make ``--calls`` calls each, at once.

The figure is the per-call time of each setup and their ratio (2x2 / 1x1): 1.0 means the two
callers never wait for each other, 2.0 that they run one after the other. Only meaningful
when the machine has a core per calling thread times ``--threads-per-call`` (the default, 1
kernel thread per call, needs 2 cores). The load (``os.getloadavg``), the CPU and the ISA path
are printed with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch.backends.native.backend import NativeBackend


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def make_caller(args: argparse.Namespace, seed: int) -> tuple[NativeBackend, Callable[[], Any]]:
    """One runner (a backend object of its own) and its decode call."""
    hq, hkv, d, ps = 8, 2, 128, 16
    cfg = AttnConfig("mha", hq, hkv, d, d, dtype=args.dtype, page_size=ps, device="cpu")
    be = NativeBackend(cfg, num_threads=args.threads_per_call)
    pages = args.kv // ps
    batch = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * args.batch,
        kv_lens=[args.kv] * args.batch,
        page_tables=[list(range(pages * i, pages * (i + 1))) for i in range(args.batch)],
        page_size=ps,
        num_pages=pages * args.batch,
    )
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(args.batch, hq, d, generator=g).to(dtype)
    k = torch.randn(pages * args.batch, ps, hkv, d, generator=g).to(dtype)
    v = torch.randn(pages * args.batch, ps, hkv, d, generator=g).to(dtype)
    plan = be.plan(batch)
    run = be.handler(Phase.DECODE)
    return be, lambda: run(q, k, v, plan, d**-0.5)


def per_call(calls: list[Callable[[], Any]], n: int) -> float:
    """Seconds per call of each thread (mean over threads), all threads started together."""
    barrier = threading.Barrier(len(calls))
    spent = [0.0] * len(calls)

    def serve(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(n):
            calls[i]()
        spent[i] = (time.perf_counter() - t0) / n

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(spent) / len(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads-per-call", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.rounds, args.kv = 10, 1, 256
    a_be, a = make_caller(args, 0)
    _, b = make_caller(args, 1)
    for f in (a, b):  # warm-up: workers started, per-thread buffers sized
        f()
    one: list[float] = []
    two: list[float] = []
    for _ in range(args.rounds):
        one.append(per_call([a], args.calls))
        two.append(per_call([a, b], args.calls))
    t1, t2 = statistics.median(one), statistics.median(two)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"native concurrency: {cpu_name()}, {os.cpu_count()} CPUs, load {load}, "
        f"ISA {a_be.library.isa}, {args.threads_per_call} kernel thread(s) per call, "
        f"decode GQA 8/2 x 128 {args.dtype}, batch {args.batch} x {args.kv} keys, "
        f"{args.calls} calls x {args.rounds} rounds"
    )
    print(f"{'setup':<24}{'per call (us)':>16}{'ratio':>8}")
    print(f"{'1 thread x 1 runner':<24}{t1 * 1e6:>16.1f}{1.0:>8.2f}")
    print(f"{'2 threads x 2 runners':<24}{t2 * 1e6:>16.1f}{t2 / t1:>8.2f}")


if __name__ == "__main__":
    main()
