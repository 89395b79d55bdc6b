"""vLLM's CPU engine: tokens/s with attn_dispatch ``native`` vs vLLM's own CPU attention.

    .venv-vllm/bin/python bench/vllm_cpu.py [--rounds 2] [--layers 4]
    .venv-vllm/bin/python bench/vllm_cpu.py --quick   # smoke run, writes nothing

One process, one random Llama-shaped model (bf16, saved with transformers at start), the
same prompts for every contender: batch 8 x 128-token prompts, 64 new tokens each, greedy.
The contenders take turns (round 1: each once, round 2: each again, ...) and the best round of
each is reported, so a burst of other load lands on all of them alike. tokens/s = new tokens
/ wall time of ``llm.generate`` (start-up excluded; each engine generates once before it is
timed). ``attention s``: the time spent in the attention layers (KV writes and forwards) during
that generate, measured the same way for every contender. ``tokens as vllm's``: tokens equal
to vLLM's up to each request's first difference (in bf16 a near-tie may flip and greedy
decoding diverges from there; the fp32 tests check identity).

Rows:

- ``vllm``: vLLM's CPU attention (its kernel ISA named: "vec" on AVX2 x86, "amx" with AMX).
- ``native``: ``additional_config={"attn_dispatch": {"target": "native"}}``.
- ``*, mixed``: the same with ``max_num_batched_tokens=256``, so the 128-token prompts prefill
  in chunks while earlier requests decode: steps mix phases. ``native split`` makes one call
  per phase per layer, ``native extend`` one prefill call for the whole step.

Writes ``bench/results/vllm_cpu.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, PROMPT, NEW = 8, 128, 64


def make_model(root: Path, layers: int) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    path = root / "llama_bench"
    model.save_pretrained(path)
    return str(path)


def isa_names() -> tuple[str, str]:
    """(vLLM's CPU attention kernel ISA and library build, native's ISA path)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from attn_dispatch.backends.native._lib import load

    vllm_isa = _get_attn_isa(torch.bfloat16, 128, 64)
    if torch.cpu._is_avx512_bf16_supported():
        build = "_C"
    elif torch.cpu._is_avx512_supported():
        build = "_C_AVX512"
    else:
        build = "_C_AVX2"
    lib = load()
    native = lib if isinstance(lib, str) else lib.isa
    return f"{vllm_isa} ({build})", native


class AttentionClock:
    """Seconds spent in the attention layers' KV writes and forwards (both contenders run
    through ``AttnDispatchCPUImpl``: the plugin is registered, and without the config key it
    hands each call to vLLM's own implementation)."""

    def __init__(self) -> None:
        from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

        self.seconds = 0.0
        for name in ("forward", "do_kv_cache_update"):
            setattr(AttnDispatchCPUImpl, name, self._timed(getattr(AttnDispatchCPUImpl, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def run(contenders: dict[str, dict[str, Any]], model: str, rounds: int) -> dict[str, Any]:
    import vllm
    from vllm.inputs import TokensPrompt

    from attn_dispatch.integrations.vllm import register

    register()  # what the entry point does; here even without an installed package
    clock = AttentionClock()

    prompts = [
        TokensPrompt(prompt_token_ids=[(31 * i + 7 * j) % 2000 + 1 for j in range(PROMPT)])
        for i in range(BATCH)
    ]
    warm = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8])]
    params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    best: dict[str, float] = {}
    attn: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name, extra in contenders.items():
            llm = vllm.LLM(
                model=model,
                skip_tokenizer_init=True,
                dtype="bfloat16",
                enforce_eager=True,
                max_model_len=512,
                seed=0,
                **extra,
            )
            llm.generate(warm, vllm.SamplingParams(max_tokens=4), use_tqdm=False)
            clock.seconds = 0.0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            attn[name] = min(attn.get(name, clock.seconds), clock.seconds)
            got = [list(o.outputs[0].token_ids) for o in outs]
            assert all(len(t) == NEW for t in got), name
            tokens.setdefault(name, got)
            best[name] = min(best.get(name, dt), dt)
            print(
                f"round {r + 1}: {name:<22} {BATCH * NEW / dt:8.1f} tokens/s, "
                f"attention {clock.seconds:.2f} s of {dt:.2f} s",
                flush=True,
            )
            del llm
            gc.collect()
    return {"seconds": best, "attention": attn, "tokens": tokens}


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    """Tokens equal to the reference's, counted up to each request's first difference (bf16
    sums in another order can flip a near-tie, and greedy decoding diverges from there)."""
    agree = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        agree += n
    total = sum(len(x) for x in a)
    return "all" if agree == total else f"{agree}/{total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 layer, 2 contenders, nothing written"
    )
    args = parser.parse_args()
    global BATCH, PROMPT, NEW
    if args.quick:  # checks the script runs; the figures are not comparable
        args.rounds, args.layers = 1, 1
        BATCH, PROMPT, NEW = 2, 16, 4
    import torch

    from attn_dispatch._table import format_table

    ad = "additional_config"
    mixed = {"max_num_batched_tokens": 256}
    contenders: dict[str, dict[str, Any]] = {
        "vllm": {},
        "native": {ad: {"attn_dispatch": {"target": "native"}}},
        "vllm, mixed": dict(mixed),
        "native split, mixed": {**mixed, ad: {"attn_dispatch": {"target": "native"}}},
        "native extend, mixed": {
            **mixed,
            ad: {"attn_dispatch": {"target": "native", "mixed": "extend"}},
        },
    }
    if args.quick:
        contenders = {name: contenders[name] for name in ("vllm", "native")}
    vllm_isa, native_isa = isa_names()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp), args.layers)
        res = run(contenders, model, args.rounds)
    secs, attn, toks = res["seconds"], res["attention"], res["tokens"]
    rows = []
    for name in contenders:
        ref = "vllm, mixed" if "mixed" in name else "vllm"
        isa = vllm_isa if name.startswith("vllm") else native_isa
        rows.append(
            [
                name,
                isa,
                f"{BATCH * NEW / secs[name]:.1f}",
                f"{secs[ref] / secs[name]:.2f}",
                f"{attn[name]:.2f}",
                f"{attn[ref] / attn[name]:.2f}",
                _same(toks[name], toks[ref]),
            ]
        )
    print()
    print(
        f"vLLM {__import__('vllm').__version__} CPU engine, bf16 Llama ({args.layers} layers, "
        f"hidden 1024, GQA 16/4 x 64), batch {BATCH} x {PROMPT}-token prompts, {NEW} new "
        f"tokens, greedy; torch threads {torch.get_num_threads()}; best of {args.rounds} rounds"
    )
    print(
        format_table(
            [
                "attention",
                "isa",
                "tokens/s",
                "x vllm",
                "attention s",
                "x vllm (attention)",
                "tokens as vllm's",
            ],
            rows,
        )
    )
    if args.quick:
        return
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "vllm_cpu.json").write_text(
        json.dumps(
            {
                "vllm_isa": vllm_isa,
                "native_isa": native_isa,
                "seconds": secs,
                "attention_seconds": attn,
                "rows": rows,
                "layers": args.layers,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
