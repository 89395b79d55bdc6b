"""The vLLM plugin's own per-step work, without an engine (issue 47, item 2).

    PYTHONPATH=$PWD .venv-vllm/bin/python bench/vllm_step_cost.py [--reps 15] [--pieces]
        [--sections] [--handler] [--contiguous-q] [--kv 150] [--quick]

vLLM's classes as the engine drives them, on hand-made steps: ``AttnDispatchCPUBuilder.build``
once per step, then for each of 4 layers ``AttnDispatchCPUImpl.do_kv_cache_update`` and
``forward`` (target ``native``). The tiny model's layers: GQA 4/2 x 64, bf16, block 128;
8 decode requests of ``--kv``..``--kv``+7 tokens (and a prefill step of 8 x 128 new tokens).
q, k and v are the column slices of one ``[tokens, q + k + v]`` projection, as vLLM's Llama
hands them (q's rows are not contiguous; ``--contiguous-q`` gives a contiguous q instead).

Timing: CPU time of the calling thread (``time.thread_time_ns``), best of ``--reps`` x N
steps; 1 torch thread, native ``num_threads`` 1. ``kernels`` is ``na_run`` alone with
prebuilt arguments for the same plans (one call per layer), subtracted from the step:
``plugin`` is the plugin's own work (Python and torch ops around the kernels).

``--pieces``: per-piece figures (one layer's forward, KV write, build, plan, the kernel).
``--sections``: the decode step split by section, each timed inside the step (the build;
the 4 KV writes; the 4 output buffers; the first layer's forward, which plans and makes
the scope; the other 3 forwards): a piece costs more there than in a tight loop, as the
kernels between the pieces evict the interpreter's working set. Each section's clock reads
add ~0.3 us to it.
``--handler``: the native handler called alone outside vLLM, the way a binding's call
reaches it (its core-checked variant, ``out=``), minus ``na_run`` alone, per call.
The load (``/proc/loadavg``) is printed with the figures: compare old and new code in
alternating processes (run this file from each tree), never bare absolute times.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

B, QH, KVH, D, BS, LAYERS, BLOCKS = 8, 4, 2, 64, 128, 4, 64


def best(f: Callable[[], Any], n: int, reps: int) -> float:
    """Per-call CPU time of this thread, us: the best of ``reps`` rounds of ``n`` calls."""
    b = float("inf")
    for _ in range(reps):
        t0 = time.thread_time_ns()
        for _ in range(n):
            f()
        b = min(b, (time.thread_time_ns() - t0) / n)
    return b / 1e3


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def prebuilt_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> Any:
    """``na_run``'s arguments for these tensors, in this tree's ABI (``run_args`` describes
    the tensors since ABI 9; before, ``NaRunArgs`` took element counts)."""
    from attn_dispatch.backends.native import backend as nb

    if hasattr(nb, "run_args"):
        return nb.run_args(q, k, v, out, sm_scale=D**-0.5, num_threads=1)
    from attn_dispatch.backends.native._lib import NaRunArgs

    return NaRunArgs(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), q_numel=q.numel(),
        k_numel=k.numel(), v_numel=v.numel(), out_numel=out.numel(), sm_scale=D**-0.5,
        k_scale=1.0, v_scale=1.0, num_threads=1,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv", type=int, default=150)
    ap.add_argument("--pieces", action="store_true")
    ap.add_argument("--sections", action="store_true")
    ap.add_argument("--handler", action="store_true")
    ap.add_argument("--contiguous-q", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: one decode round, no prefill")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.no_prefill = 1, True
    torch.set_num_threads(1)
    torch.manual_seed(0)

    from vllm import forward_context as fc
    from vllm.config import set_current_vllm_config

    from attn_dispatch.backends.native._lib import load as load_lib
    from attn_dispatch.integrations.vllm import backend as be
    from attn_dispatch.integrations.vllm._settings import settings_of

    class CC:
        pass

    config = SimpleNamespace(
        additional_config={"attn_dispatch": {"target": "native"}},
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        cache_config=SimpleNamespace(block_size=BS),
        speculative_config=None,
        compilation_config=CC(),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, cp_kv_cache_interleave_size=1
        ),
    )
    with set_current_vllm_config(config):
        impls = [
            be.AttnDispatchCPUImpl(QH, D, D**-0.5, KVH, None, None, "auto") for _ in range(LAYERS)
        ]
    # The builder's state as its __init__ sets it for this config (without a vLLM config's
    # KV-cache spec and device).
    builder = object.__new__(be.AttnDispatchCPUBuilder)
    builder._settings = settings_of(config)
    builder.block_size = BS
    builder.num_speculative_tokens = 0
    builder.mixed = "split"
    builder.draft = False
    builder.dcp_world = 1
    builder.dcp_rank = 0
    builder.interleave = 1
    caches = [torch.zeros(BLOCKS, KVH, BS, 2 * D, dtype=torch.bfloat16) for _ in range(LAYERS)]
    layers = [
        SimpleNamespace(layer_name=f"l{i}", _k_scale_float=1.0, _v_scale_float=1.0)
        for i in range(LAYERS)
    ]
    bt = torch.arange(B * 4, dtype=torch.int32).view(B, 4)

    def step_inputs(kind: str) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        if kind == "decode":
            q_lens, seq = [1] * B, [args.kv + i for i in range(B)]
        else:
            q_lens, seq = [128] * B, [128] * B
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        tokens = starts[-1]
        slots = [
            int(bt[i, t // BS]) * BS + t % BS
            for i, (n, s) in enumerate(zip(q_lens, seq, strict=True))
            for t in range(s - n, s)
        ]
        cm = SimpleNamespace(
            causal=True,
            num_reqs=B,
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            num_actual_tokens=tokens,
            max_query_len=max(q_lens),
            max_seq_len=max(seq),
            block_table_tensor=bt,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        # vLLM's Llama: q, k, v = qkv.split(...), each then viewed as [tokens, heads, dim].
        qkv = torch.randn(tokens, (QH + 2 * KVH) * D, dtype=torch.bfloat16)
        q, k, v = qkv.split([QH * D, KVH * D, KVH * D], dim=-1)
        q, k, v = q.view(-1, QH, D), k.view(-1, KVH, D), v.view(-1, KVH, D)
        if args.contiguous_q:
            q = q.contiguous()
        return cm, q, k, v

    def one_step(cm: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        md = builder.build(0, cm)
        fc._forward_context = SimpleNamespace(attn_metadata={x.layer_name: md for x in layers})
        for impl, layer, cache in zip(impls, layers, caches, strict=True):
            impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
            out = torch.empty(q.shape[0], QH, D, dtype=torch.bfloat16)
            impl.forward(layer, q, k, v, cache, md, out)
        fc._forward_context = None
        return md

    def kernel_calls(md: Any, q: torch.Tensor) -> list[tuple[Any, ...]]:
        """``na_run`` with prebuilt arguments for each layer and part of the step."""
        d = impls[0].dispatch
        calls = []
        for i in range(LAYERS):
            kc, vc = impls[i]._pages(caches[i], d)
            for p in md.parts_for(False):
                plan = md.prepared(d.binding, False, p)[0]
                nb = d.binding.backend(p.batch.phase)
                qq = q[p.rows].contiguous()
                o = torch.empty(qq.shape[0], QH, D, dtype=torch.bfloat16)
                a = prebuilt_args(qq, kc, vc, o)
                plan_id = nb._record(plan).plan_id
                calls.append((nb._run, nb._runner, plan_id, ctypes.byref(a), qq, o, a))
        return calls

    def run_calls(calls: list[tuple[Any, ...]]) -> Callable[[], None]:
        def run() -> None:
            for f, r, pid, ref, *_ in calls:
                if f(r, pid, ref) != 0:
                    raise RuntimeError("na_run refused the prebuilt call")

        return run

    lib = load_lib()
    isa = lib if isinstance(lib, str) else lib.isa
    q_kind = "contiguous" if args.contiguous_q else "a column slice of qkv"
    print(
        f"vLLM plugin per-step work, engine-less: {B} requests x {LAYERS} layers, GQA {QH}/{KVH} "
        f"x {D}, bf16, block {BS}; q {q_kind}; native ISA {isa}; 1 thread; best of "
        f"{args.reps}; load {load()}"
    )
    kinds = [("decode", 5 if args.quick else 100)] + ([] if args.no_prefill else [("prefill", 10)])
    for kind, n in kinds:
        inputs = step_inputs(kind)
        step = best(lambda: one_step(*inputs), n, args.reps)  # noqa: B023 (called here)
        md = one_step(*inputs)
        kern = best(run_calls(kernel_calls(md, inputs[1])), n, args.reps)
        cm = inputs[0]
        build = best(lambda: builder.build(0, cm).parts_for(False), n, args.reps)  # noqa: B023
        print(
            f"{kind:8s} step {step:8.1f} us  kernels {kern:8.1f} us  plugin {step - kern:7.1f} us"
            f"  (build {build:6.1f} us)"
        )
    cm, q, k, v = step_inputs("decode")
    md = one_step(cm, q, k, v)
    if args.pieces:
        fc._forward_context = SimpleNamespace(attn_metadata={x.layer_name: md for x in layers})
        out = torch.empty(q.shape[0], QH, D, dtype=torch.bfloat16)
        impl, layer, cache = impls[0], layers[0], caches[0]
        d = impl.dispatch
        part = md.parts_for(False)[0]
        from attn_dispatch.integrations.vllm._metadata import kv_rows

        fwd = best(lambda: impl.forward(layer, q, k, v, cache, md, out), 200, args.reps)
        kern1 = best(run_calls(kernel_calls(md, q)[:1]), 200, args.reps)
        r = args.reps
        print(f"forward/layer          {fwd:7.2f} us")
        print(f"kernel/layer (na_run)  {kern1:7.2f} us")
        print(f"forward minus kernel   {fwd - kern1:7.2f} us")
        kvw = best(lambda: impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping), 200, r)
        print(f"kv write/layer         {kvw:7.2f} us")
        plan_us = best(lambda: d.binding.prepare(part.batch), 200, r)
        rows_us = best(lambda: kv_rows(cm.slot_mapping, BS), 200, r)
        print(f"plan                   {plan_us:7.2f} us")
        print(f"kv_rows                {rows_us:7.2f} us")
        fc._forward_context = None
    if args.sections:
        tt = time.thread_time_ns
        acc = dict.fromkeys(("build", "kv writes", "buffers", "forward 1", "forwards 2-4"), 0)

        def step_sections() -> None:
            t0 = tt()
            md = builder.build(0, cm)
            acc["build"] += tt() - t0
            fc._forward_context = SimpleNamespace(attn_metadata={x.layer_name: md for x in layers})
            for i, (impl, layer, cache) in enumerate(zip(impls, layers, caches, strict=True)):
                a = tt()
                impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
                b = tt()
                out = torch.empty(q.shape[0], QH, D, dtype=torch.bfloat16)
                c = tt()
                impl.forward(layer, q, k, v, cache, md, out)
                e = tt()
                acc["kv writes"] += b - a
                acc["buffers"] += c - b
                acc["forward 1" if i == 0 else "forwards 2-4"] += e - c
            fc._forward_context = None

        n = 5 if args.quick else 300
        for _ in range(n):
            step_sections()
        rounds = []
        for _ in range(args.reps):
            acc.update(dict.fromkeys(acc, 0))
            t0 = tt()
            for _ in range(n):
                step_sections()
            rounds.append(((tt() - t0) / n / 1e3, {key: t / n / 1e3 for key, t in acc.items()}))
        total, parts = min(rounds, key=lambda r: r[0])
        print(f"decode step by section (best of {args.reps} x {n} steps), us:")
        print(f"step (clock reads included)  {total:7.1f}")
        for key, t in parts.items():
            print(f"{key:28s} {t:7.1f}")
    if args.handler:
        # The native handler alone, as a binding's call with out= reaches it.
        d = impls[0].dispatch
        part = md.parts_for(False)[0]
        plan = md.prepared(d.binding, False, part)[0]
        nb = d.binding.backend(part.batch.phase)
        run = nb.handler(part.batch.phase)
        launch = getattr(run, "attn_dispatch_core_checked", run)
        kc, vc = impls[0]._pages(caches[0], d)
        qc = q.contiguous()
        out = torch.empty(q.shape[0], QH, D, dtype=torch.bfloat16)
        scale = D**-0.5
        kern1 = best(run_calls(kernel_calls(md, q)[:1]), 1000, args.reps)
        h = best(lambda: launch(qc, kc, vc, plan, scale, out=out), 1000, args.reps)
        print(f"handler (core-checked, contiguous q)  {h:7.2f} us  - na_run {h - kern1:6.2f} us")
        try:
            hs = best(lambda: launch(q, kc, vc, plan, scale, out=out), 1000, args.reps)
            print(
                f"handler (core-checked, q a qkv slice) {hs:7.2f} us  - na_run {hs - kern1:6.2f} us"
            )
        except Exception as exc:  # the old tree refuses a q whose rows are not contiguous
            print(f"handler (core-checked, q a qkv slice) refused: {type(exc).__name__}")
        f = best(lambda: run(qc, kc, vc, plan, scale, out=out), 1000, args.reps)
        print(f"handler (full checks, contiguous q)   {f:7.2f} us  - na_run {f - kern1:6.2f} us")
        print(f"na_run alone                          {kern1:7.2f} us")
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
