"""CUDA-graph replay check and timing: one captured decode step per runner and backend.

For each backend (torch, triton, flashinfer) and kind (MHA/GQA, MLA) that can bind here, it
captures a decode step of a few layers with ``capture_decode``, replays it on new batches of
the same shape (pages reshuffled, lengths moved), compares every replay with the eager step,
and times eager steps (scope + plan + layers) against replays (host re-plan + copies + one
graph launch), side by side in one run. A failure in one backend is a row, not a crash.

    python bench/gpu_graphs.py                 # on a CUDA machine
    python bench/gpu_graphs.py --device cpu    # smoke run of the same code (no graph)
    python bench/gpu_graphs.py --quick         # tiny shapes on whichever device
    python bench/gpu_graphs.py --grow 256      # one graph, 256 steps of growing sequences

``--grow N`` captures one decode graph per backend and kind with a fixed page-table capacity
(``max_pages_per_request``) and replays it for N steps while every sequence grows by one token
per step, crossing page boundaries (new pages come from a shuffled pool), comparing each replay
with the eager step.

Lines starting with ``SUMMARY`` are collected by bench/gpu.sh into its final table.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._table import format_table
from attn_dispatch.cuda_graph import capture_decode


def configs(device: str, small: bool) -> list[AttnConfig]:
    dt = "bfloat16" if device == "cuda" else "float32"
    if small:
        return [
            AttnConfig(
                kind="mha",
                num_q_heads=4,
                num_kv_heads=2,
                head_dim=16,
                dtype=dt,
                page_size=4,
                device=device,
            ),
            AttnConfig(
                kind="mla",
                num_q_heads=2,
                num_kv_heads=1,
                head_dim=24,
                v_head_dim=16,
                dtype=dt,
                page_size=4,
                device=device,
            ),
        ]
    return [
        AttnConfig(
            kind="mha",
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=dt,
            page_size=16,
            device=device,
        ),
        AttnConfig(
            kind="mla",
            num_q_heads=16,
            num_kv_heads=1,
            head_dim=576,
            v_head_dim=512,
            dtype=dt,
            page_size=64,
            device=device,
        ),
    ]


def make_step(cfg: AttnConfig, layers: int) -> Callable[..., torch.Tensor]:
    scale = cfg.head_dim**-0.5
    dv = int(cfg.v_head_dim or cfg.head_dim)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        h = q
        for _ in range(layers):
            out = attention(h, k, v, sm_scale=scale)
            h = h + torch.nn.functional.pad(out, (0, h.shape[-1] - dv)) * 0.5
        return h

    return step


def batches(
    cfg: AttnConfig, n: int, requests: int, ctx: int, num_pages: int, device: str
) -> list[tuple[AttnBatch, torch.Tensor]]:
    ps = cfg.page_size
    pages_each = -(-ctx // ps)
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        perm = torch.randperm(num_pages, generator=g)[: requests * pages_each].tolist()
        tables = [perm[i * pages_each : (i + 1) * pages_each] for i in range(requests)]
        # Same page count per request every step; the length moves inside the last page.
        lens = [ctx - int(torch.randint(0, ps, (1,), generator=g)) for _ in range(requests)]
        lens = [max(n_, (pages_each - 1) * ps + 1) for n_ in lens]
        batch = AttnBatch.build(
            Phase.DECODE,
            q_lens=[1] * requests,
            kv_lens=lens,
            page_tables=tables,
            page_size=ps,
            num_pages=num_pages,
            device=device,
        )
        q = torch.randn(requests, cfg.num_q_heads, cfg.head_dim, generator=g)
        out.append((batch, q.to(device, getattr(torch, cfg.dtype))))
    return out


def timed(fn: Callable[[], Any], iters: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def _one_line(exc: BaseException, width: int = 110) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def run_one(name: str, cfg: AttnConfig, args: argparse.Namespace) -> tuple[str, ...]:
    kind = f"{cfg.kind} h{cfg.num_q_heads}/{cfg.num_kv_heads} d{cfg.head_dim}"
    num_pages = args.requests * (-(-args.ctx // cfg.page_size)) + 8
    options: dict[str, Any] = {}
    if name == "flashinfer":
        # FlashInfer is capturable in its graph mode only (persistent wrapper buffers).
        fi = {"use_cuda_graph": True, "max_num_pages": num_pages, "sm_scale": cfg.head_dim**-0.5}
        options = {name: fi}
    try:
        binding = bind(name, cfg, label=f"{name}-graph", options=options or None)
    except Exception as exc:
        return (name, kind, "skip", f"cannot bind: {_one_line(exc)}", "-", "-", "-", "-")
    dev = args.device
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, cfg.dtype)
    if cfg.kind == "mla":
        k = torch.randn(num_pages, cfg.page_size, cfg.head_dim, generator=g).to(dev, dt)
        v = None
    else:
        shape = (num_pages, cfg.page_size, cfg.num_kv_heads)
        k = torch.randn(*shape, cfg.head_dim, generator=g).to(dev, dt)
        v = torch.randn(*shape, int(cfg.v_head_dim or 0), generator=g).to(dev, dt)
    steps = batches(cfg, 4, args.requests, args.ctx, num_pages, dev)
    step = make_step(cfg, args.layers)
    try:
        graphed = capture_decode(binding, steps[0][0], step, steps[0][1].clone(), k, v)
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        return (
            name,
            kind,
            "FAIL",
            f"capture: {type(exc).__name__}: {_one_line(exc)}",
            "-",
            "-",
            "-",
            "-",
        )
    worst = 0.0
    for batch, q in steps[1:]:
        got = graphed.replay(batch, q).float().clone()
        with attn_scope(binding, batch):
            want = step(q, k, v).float()
        worst = max(worst, float((got - want).abs().max()))
    ok = worst <= (3e-2 if cfg.dtype != "float32" else 1e-4)
    batch, q = steps[1]

    def eager_step() -> Any:
        with attn_scope(binding, batch):
            return step(q, k, v)

    eager_ms = timed(eager_step, args.iters, dev)
    replay_ms = timed(lambda: graphed.replay(batch, q), args.iters, dev)
    update_ms = timed(lambda: graphed.update(batch), args.iters, dev)
    return (
        name,
        kind,
        "ok" if ok else "MISMATCH",
        f"max|diff| {worst:.2e}",
        f"{eager_ms:.3f}",
        f"{replay_ms:.3f}",
        f"{update_ms:.3f}",
        f"{eager_ms / replay_ms:.2f}x",
    )


def run_grow(name: str, cfg: AttnConfig, args: argparse.Namespace) -> tuple[str, ...]:
    """One graph replayed for ``args.grow`` steps of growing sequences, each checked."""
    kind = f"{cfg.kind} h{cfg.num_q_heads}/{cfg.num_kv_heads} d{cfg.head_dim}"
    ps, dev, steps_n = cfg.page_size, args.device, args.grow
    start = max(1, args.ctx // 2)
    capacity = -(-(start + steps_n + ps) // ps)
    num_pages = args.requests * capacity + 8
    options: dict[str, Any] = {}
    if name == "flashinfer":
        fi = {"use_cuda_graph": True, "max_num_pages": num_pages, "sm_scale": cfg.head_dim**-0.5}
        options = {name: fi}
    try:
        binding = bind(name, cfg, label=f"{name}-grow", options=options or None)
    except Exception as exc:
        return (name, kind, "skip", f"cannot bind: {_one_line(exc)}", "-", "-")
    g = torch.Generator().manual_seed(1)
    dt = getattr(torch, cfg.dtype)
    if cfg.kind == "mla":
        k = torch.randn(num_pages, ps, cfg.head_dim, generator=g).to(dev, dt)
        v = None
    else:
        shape = (num_pages, ps, cfg.num_kv_heads)
        k = torch.randn(*shape, cfg.head_dim, generator=g).to(dev, dt)
        v = torch.randn(*shape, int(cfg.v_head_dim or 0), generator=g).to(dev, dt)
    free = torch.randperm(num_pages, generator=g).tolist()
    lens = [start + int(torch.randint(0, ps, (1,), generator=g)) for _ in range(args.requests)]
    tables: list[list[int]] = [[] for _ in lens]

    def batch_for() -> AttnBatch:
        for i, n in enumerate(lens):
            while len(tables[i]) * ps < n:
                tables[i].append(free.pop())
        return AttnBatch.build(
            Phase.DECODE,
            q_lens=[1] * len(lens),
            kv_lens=lens,
            page_tables=tables,
            page_size=ps,
            device=dev,
        )

    def q_for() -> torch.Tensor:
        q = torch.randn(len(lens), cfg.num_q_heads, cfg.head_dim, generator=g)
        return q.to(dev, dt)

    step = make_step(cfg, args.layers)
    try:
        graphed = capture_decode(
            binding, batch_for(), step, q_for(), k, v, max_pages_per_request=capacity
        )
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        return (name, kind, "FAIL", f"capture: {type(exc).__name__}: {_one_line(exc)}", "-", "-")
    worst, crossings = 0.0, 0
    try:
        for _ in range(steps_n):
            before = sum(len(t) for t in tables)
            for i in range(len(lens)):
                lens[i] += 1
            batch, q = batch_for(), q_for()
            crossings += sum(len(t) for t in tables) - before
            got = graphed.replay(batch, q).float().clone()
            with attn_scope(binding, batch):
                want = step(q, k, v).float()
            worst = max(worst, float((got - want).abs().max()))
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        return (name, kind, "FAIL", f"replay: {type(exc).__name__}: {_one_line(exc)}", "-", "-")
    ok = worst <= (3e-2 if cfg.dtype != "float32" else 1e-4)
    return (
        name,
        kind,
        "ok" if ok else "MISMATCH",
        f"max|diff| {worst:.2e}",
        f"{steps_n} steps, {crossings} page crossings",
        f"capacity {capacity} pages/request",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", default="torch,triton,flashinfer")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--grow", type=int, default=0, help="steps of growing sequences")
    parser.add_argument("--quick", action="store_true", help="smoke run: --small, one iteration")
    args = parser.parse_args()
    if args.quick or (args.device == "cpu" and not args.small):
        args.small, args.requests, args.ctx, args.layers, args.iters = True, 3, 10, 2, 3
    if args.grow:
        grow_rows = [
            run_grow(name.strip(), cfg, args)
            for cfg in configs(args.device, args.small)
            for name in args.backends.split(",")
        ]
        print(
            f"one captured decode graph, {args.grow} steps of growing sequences, "
            f"{args.requests} requests, {args.layers} layers, device {args.device}"
            + (" (no graph off CUDA)" if args.device != "cuda" else "")
        )
        header_g = ("backend", "config", "status", "check", "steps", "capacity")
        print(format_table(header_g, grow_rows))
        for r in grow_rows:
            print(f"SUMMARY graph-grow {r[0]} {r[1]} | {r[2]} | {r[3]}; {r[4]}")
        return 1 if any(r[2] in ("FAIL", "MISMATCH") for r in grow_rows) else 0
    rows = []
    for cfg in configs(args.device, args.small):
        for name in args.backends.split(","):
            rows.append(run_one(name.strip(), cfg, args))
    header = (
        "backend",
        "config",
        "status",
        "check",
        "eager ms",
        "replay ms",
        "update ms",
        "speedup",
    )
    print(
        f"decode step of {args.layers} layers, {args.requests} requests x {args.ctx} tokens, "
        f"device {args.device}" + (" (no graph off CUDA)" if args.device != "cuda" else "")
    )
    print(format_table(header, rows))
    for r in rows:
        timing = f"; eager {r[4]} ms, replay {r[5]} ms ({r[7]})" if r[4] != "-" else ""
        print(f"SUMMARY graph {r[0]} {r[1]} | {r[2]} | {r[3]}{timing}")
    return 1 if any(r[2] in ("FAIL", "MISMATCH") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
