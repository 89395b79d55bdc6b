"""Probe of the native CPU kernels: GB/s of KV read vs a read bandwidth measured in the same run.

    PYTHONPATH=$PWD python bench/native_probe.py [--threads 1 2] [--layers 4]

Cases (issue 6): MLA decode, 16 heads, 576/512, bf16 q and cache, batch 8, context 2048,
page 64; GQA decode 32/8 x 128, bf16. "cold" rotates through --layers caches (more bytes than
the L3 holds, as a model's layers are); "hot" repeats one cache. The read bandwidth is
torch summing a 1 GiB fp32 tensor. Ratios only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch.backends.native._lib import load
from attn_dispatch.backends.native.backend import NativeBackend
from attn_dispatch.backends.reference.backend import TorchBackend


def best_of(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(threads: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    return x.numel() * 4 / best_of(lambda: x.sum(), 5) / 1e9


def naive_torch(q, k_cache, v_cache, batch, cfg, scale):  # type: ignore[no-untyped-def]
    """A simple torch implementation: gather each request's pages, fp32 matmuls, softmax."""
    outs = []
    qo = batch.qo_indptr_host.tolist()
    kvp = batch.kv_indptr_host.tolist()
    lens = batch.kv_lens_host.tolist()
    for i in range(batch.num_requests):
        pages = batch.kv_indices[kvp[i] : kvp[i + 1]].long()
        k = k_cache[pages].flatten(0, 1)[: lens[i]].float()
        qi = q[qo[i] : qo[i + 1]].float()  # [1, H, D]
        if cfg.kind == "mla":
            v = k[:, : cfg.v_head_dim]
            s = torch.einsum("thd,kd->htk", qi, k) * scale
            outs.append(torch.einsum("htk,kd->thd", s.softmax(-1), v))
        else:
            v = v_cache[pages].flatten(0, 1)[: lens[i]].float()
            g = cfg.num_q_heads // cfg.num_kv_heads
            qg = qi.view(qi.shape[0], cfg.num_kv_heads, g, -1)
            s = torch.einsum("tkgd,nkd->kgtn", qg, k) * scale
            o = torch.einsum("kgtn,nkd->tkgd", s.softmax(-1), v)
            outs.append(o.reshape(qi.shape[0], cfg.num_q_heads, -1))
    return torch.cat(outs).to(q.dtype)


def case(kind: str, layers: int):  # type: ignore[no-untyped-def]
    b, ctx = 8, 2048
    if kind == "mla":
        cfg = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64, device="cpu")
        bytes_per_token = 576 * 2
    else:
        cfg = AttnConfig("mha", 32, 8, 128, 128, dtype="bfloat16", page_size=64, device="cpu")
        bytes_per_token = 2 * 8 * 128 * 2
    ps = cfg.page_size
    per = ctx // ps
    pages = torch.randperm(b * per).tolist()
    tables = [pages[i * per : (i + 1) * per] for i in range(b)]
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * b, kv_lens=[ctx] * b, page_tables=tables, page_size=ps
    )
    q = torch.randn(b, cfg.num_q_heads, cfg.head_dim).bfloat16()
    caches = []
    for _ in range(layers):
        if kind == "mla":
            caches.append((torch.randn(b * per, ps, 576).bfloat16(), None))
        else:
            shape = (b * per, ps, 8, 128)
            caches.append((torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()))
    return cfg, batch, q, caches, b * ctx * bytes_per_token


def measure(kind: str, threads: int, layers: int, repeat: int) -> None:
    cfg, batch, q, caches, kv_bytes = case(kind, layers)
    scale = cfg.head_dim**-0.5
    bw = read_bandwidth(threads)
    torch.set_num_threads(threads)
    be = NativeBackend(cfg, num_threads=threads)
    plan = be.plan(batch)
    h = be.handler(Phase.DECODE)
    k0, v0 = caches[0]
    out = h(q, k0, v0, plan, scale)
    ref = naive_torch(q, k0, v0, batch, cfg, scale)
    err = (out.float() - ref.float()).abs().max().item()
    counter = [0]

    def cold() -> None:
        k, v = caches[counter[0] % len(caches)]
        counter[0] += 1
        h(q, k, v, plan, scale)

    t_cold = best_of(cold, repeat * len(caches))
    t_hot = best_of(functools.partial(h, q, k0, v0, plan, scale), repeat)
    t_naive = best_of(functools.partial(naive_torch, q, k0, v0, batch, cfg, scale), 3, 1)
    rb = TorchBackend(cfg)
    t_ref = best_of(
        functools.partial(rb.handler(Phase.DECODE), q, k0, v0, rb.plan(batch), scale), 3, 1
    )
    for mode, t in (("cold", t_cold), ("hot", t_hot)):
        gbs = kv_bytes / t / 1e9
        print(
            f"{kind:<6}{threads:>4}{bw:>10.1f}{mode:>6}{t * 1e3:>10.3f}{gbs:>9.1f}"
            f"{100 * gbs / bw:>7.0f}%{t_naive * 1e3:>9.2f}{t_naive / t:>8.1f}"
            f"{t_ref * 1e3:>12.2f}{t_ref / t:>11.1f}"
        )
    print(f"{'':<6}max |native - naive| = {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 thread, 1 layer, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.threads, args.layers, args.repeat = [1], 1, 1
    lib = load()
    assert not isinstance(lib, str), lib
    print(f"native ISA path: {lib.isa} (available: {', '.join(lib.isa_list)})")
    print(
        f"{'case':<6}{'thr':>4}{'read GB/s':>10}{'mode':>6}{'native ms':>10}{'KV GB/s':>9}"
        f"{'% read':>8}{'naive ms':>9}{'x naive':>8}{'torch-be ms':>12}{'x torch-be':>11}"
    )
    for kind in ("mla", "gqa"):
        for threads in args.threads:
            measure(kind, threads, args.layers, args.repeat)


if __name__ == "__main__":
    main()
