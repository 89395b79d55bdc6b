"""Layer variants and FP8 caches on the CPU, side by side in one run (no assertions).

    python bench/variants_cpu.py [--backends torch] [--repeats 5] [--context 8192]
                                 [--window 1024] [--json PATH] [--quick]

1. Sliding-window decode vs full decode at the same context (GQA 32/8 x 128, bf16, page 64):
   interleaved repeats, median ms, and window / full. A backend that does not declare the
   window prints its bind reason instead.
   The same for chunked local attention (``attention_chunk_size``, Llama 4) at a longer
   context: chunked / full, pages before the query's chunk skipped.
2. FP8 accuracy: max |error| against a float64 reference computed on the unquantised values,
   for a bf16 cache and for FP8 caches (e4m3fn, e5m2) with per-layer scales calibrated as
   SGLang does (amax / format max), MHA/GQA and MLA, every phase, on the torch backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._table import format_table

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def isa() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        pass
    path = torch.backends.cpu.get_cpu_capability()
    extra = " +AVX512_BF16" if "avx512_bf16" in flags else ""
    return f"torch CPU kernels: {path}{extra}"


# -- 1. window vs full decode -------------------------------------------------------------------


def backend_label(name: str) -> str:
    """The backend with the instruction-set path it runs (native's kernels pick one)."""
    if name == "native":
        from attn_dispatch.backends.native._lib import load

        lib = load()
        return f"native ({lib.isa})" if not isinstance(lib, str) else "native"
    return name


def decode_rows(
    backends: list[str],
    context: int,
    window: int,
    repeats: int,
    batch: int,
    *,
    variant: str = "window",
) -> list[dict[str, Any]]:
    """``variant`` "window" (``window_left=window``) or "chunked" (``attention_chunk_size=
    window``) against full attention on the same context, interleaved."""
    ps, hq, hkv, d = 64, 32, 8, 128
    pages = batch * math.ceil(context / ps)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, ps, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(pages, ps, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, hq, d, generator=g).to(torch.bfloat16)
    per = pages // batch
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    b = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * batch,
        kv_lens=[context] * batch,
        page_tables=tables,
        page_size=ps,
        num_pages=pages,
    )
    base = AttnConfig("mha", hq, hkv, d, dtype="bfloat16", page_size=ps, sm_scale=d**-0.5)
    rows = []
    for name in backends:
        runs: dict[str, Any] = {}
        limited = (
            base.replace(window_left=window)
            if variant == "window"
            else base.replace(attention_chunk_size=window)
        )
        for label, cfg in (("full", base), ("window", limited)):
            try:
                binding = bind(name, cfg)
            except IncompatibleBackendError as exc:
                why = exc.reasons.get(Phase.DECODE, next(iter(exc.reasons.values())))[1][0]
                runs[label] = why
                continue
            runs[label] = binding
        if not all(not isinstance(r, str) for r in runs.values()):
            reason = next(r for r in runs.values() if isinstance(r, str))
            rows.append({"backend": backend_label(name), "skipped": reason})
            continue
        times: dict[str, list[float]] = {"full": [], "window": []}
        for _ in range(repeats + 1):  # the first round warms up
            for label, binding in runs.items():
                with attn_scope(binding, b):
                    t0 = time.perf_counter()
                    attention(q, k, v)
                    times[label].append(time.perf_counter() - t0)
        full = statistics.median(times["full"][1:]) * 1e3
        win = statistics.median(times["window"][1:]) * 1e3
        rows.append(
            {
                "backend": backend_label(name),
                "variant": variant,
                "context": context,
                "window_left": window,
                "batch": batch,
                "full_ms": full,
                "window_ms": win,
                "window/full": win / full,
            }
        )
    return rows


# -- 2. FP8 accuracy ----------------------------------------------------------------------------


def _naive(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    vals: list[torch.Tensor],
    q_lens: list[int],
    group: int,
    scale: float,
) -> torch.Tensor:
    outs = []
    at = 0
    for kk, vv, ql in zip(keys, vals, q_lens, strict=True):
        kl = kk.shape[0]
        qi = q[at : at + ql].double()  # [ql, Hq, D]
        at += ql
        kd = kk.double().repeat_interleave(group, dim=1)  # [kl, Hq, D]
        vd = vv.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, kd) * scale
        causal = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
        s = s.masked_fill(~causal, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd))
    return torch.cat(outs)


def accuracy_rows(seeds: int) -> list[dict[str, Any]]:
    rows = []
    shapes = {
        "mha": dict(hq=8, hkv=2, d=128, dv=128),
        "mla": dict(hq=16, hkv=1, d=576, dv=512),
    }
    for kind, sh in shapes.items():
        for phase in Phase:
            errs: dict[str, float] = {"bfloat16": 0.0, **dict.fromkeys(FP8_MAX, 0.0)}
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                ps = 16
                q_lens = [1, 1, 1] if phase is Phase.DECODE else [7, 3, 12]
                kv_lens = [ql + p for ql, p in zip(q_lens, (40, 300, 5), strict=True)]
                need = [math.ceil(k / ps) for k in kv_lens]
                total = sum(need)
                perm = torch.randperm(total, generator=g).tolist()
                tables, at = [], 0
                for n in need:
                    tables.append(perm[at : at + n])
                    at += n
                hq, hkv, d, dv = sh["hq"], sh["hkv"], sh["d"], sh["dv"]
                q = torch.randn(sum(q_lens), hq, d, generator=g).to(torch.bfloat16)
                kf = torch.randn(total, ps, hkv, d, generator=g) * 2.0
                vf = torch.randn(total, ps, hkv, dv, generator=g)
                if kind == "mla":
                    kf = kf[:, :, 0]
                    vf = None
                scale = d**-0.5
                # The reference reads the unquantised values of each request, in order.
                keys, vals = [], []
                for tb, kl in zip(tables, kv_lens, strict=True):
                    kk = kf[tb].reshape(-1, *kf.shape[2:])[:kl]
                    if kind == "mla":
                        keys.append(kk[:, None, :])
                        vals.append(kk[:, None, :dv])
                    else:
                        assert vf is not None
                        keys.append(kk)
                        vals.append(vf[tb].reshape(-1, *vf.shape[2:])[:kl])
                ref = _naive(q, keys, vals, q_lens, hq // hkv, scale)
                batch = AttnBatch.build(
                    phase,
                    q_lens=q_lens,
                    kv_lens=kv_lens,
                    page_tables=tables,
                    page_size=ps,
                    num_pages=total,
                )
                for fmt in errs:
                    cfg = AttnConfig(
                        kind,  # type: ignore[arg-type]
                        hq,
                        hkv,
                        d,
                        dv,
                        dtype="bfloat16",
                        kv_dtype=fmt,
                        page_size=ps,
                        sm_scale=scale,
                    )
                    kw: dict[str, float] = {}
                    if fmt == "bfloat16":
                        kc = kf.to(torch.bfloat16)
                        vc = None if vf is None else vf.to(torch.bfloat16)
                    else:
                        ks = float(kf.abs().amax()) / FP8_MAX[fmt]
                        kc = (kf / ks).to(getattr(torch, fmt))
                        kw["k_scale"] = ks
                        vc = None
                        if vf is not None:
                            vs = float(vf.abs().amax()) / FP8_MAX[fmt]
                            vc = (vf / vs).to(getattr(torch, fmt))
                            kw["v_scale"] = vs
                    with attn_scope(bind("torch", cfg), batch):
                        out = attention(q, kc, vc, **kw)  # type: ignore[arg-type]
                    errs[fmt] = max(errs[fmt], float((out.double() - ref).abs().max()))
            rows.append({"kind": kind, "phase": phase.name.lower(), **errs})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="torch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=8192, help="attention_chunk_size (Llama 4)")
    ap.add_argument("--chunk-context", type=int, default=32768)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny contexts, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:  # checks the script runs; the figures are not comparable
        args.repeats, args.context, args.window, args.batch, args.seeds = 1, 256, 64, 1, 1
        args.chunk, args.chunk_context = 128, 512
    print(
        isa(), f"| threads {torch.get_num_threads()} | {platform.processor() or platform.machine()}"
    )
    drows = decode_rows(
        args.backends.split(","), args.context, args.window, args.repeats, args.batch
    )
    print(
        f"\nDecode, GQA 32/8 x 128, bf16, page 64, batch {args.batch}, context {args.context}: "
        f"window_left {args.window} vs full (median of {args.repeats})"
    )
    body = []
    for r in drows:
        if "skipped" in r:
            body.append((r["backend"], "-", "-", f"refused: {r['skipped']}"))
        else:
            body.append(
                (
                    r["backend"],
                    f"{r['full_ms']:.2f}",
                    f"{r['window_ms']:.2f}",
                    f"{r['window/full']:.3f}",
                )
            )
    print(format_table(("backend", "full ms", "window ms", "window/full"), body))
    crows = decode_rows(
        args.backends.split(","), args.chunk_context, args.chunk, args.repeats, args.batch,
        variant="chunked",
    )  # fmt: skip
    last = args.chunk_context - 1
    print(
        f"\nDecode, same shapes, context {args.chunk_context}: attention_chunk_size "
        f"{args.chunk} (the query at {last} reads {last % args.chunk + 1} keys) vs full "
        f"(median of {args.repeats})"
    )
    body = []
    for r in crows:
        if "skipped" in r:
            body.append((r["backend"], "-", "-", f"refused: {r['skipped']}"))
        else:
            body.append(
                (
                    r["backend"],
                    f"{r['full_ms']:.2f}",
                    f"{r['window_ms']:.2f}",
                    f"{r['window/full']:.3f}",
                )
            )
    print(format_table(("backend", "full ms", "chunked ms", "chunked/full"), body))
    arows = accuracy_rows(args.seeds)
    print(
        "\nMax |error| vs float64 on the unquantised cache (torch backend, bf16 compute; FP8 "
        "scales = amax / format max)"
    )
    print(
        format_table(
            ("kind", "phase", "bf16 cache", "fp8 e4m3fn", "fp8 e5m2"),
            [
                (
                    r["kind"],
                    r["phase"],
                    f"{r['bfloat16']:.4f}",
                    f"{r['float8_e4m3fn']:.4f}",
                    f"{r['float8_e5m2']:.4f}",
                )
                for r in arows
            ],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"isa": isa(), "decode": drows, "chunked": crows, "accuracy": arows}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
