"""Runs SGLang 0.5.23's offline engine on tiny random Llama models, one engine after another,
and prints one JSON line per run (``RESULT {...}``). Started by test_engine.py in a child
process whose PYTHONPATH holds the test-only shims (``shims/``), with
``SGLANG_USE_CPU_ENGINE=1`` and ``TRITON_INTERPRET=1``.

    python engine_run.py WORKDIR RUNS_JSON
    python engine_run.py WORKDIR --gpu      # bench/gpu.sh's SGLang check (a CUDA machine)

Each run: ``{"name", "backend", "env" (ATTN_DISPATCH_SGLANG or null), "spec" (null or
{"algorithm", "draft": "target" | "draft" | "head", "topk", "steps", "tokens"}), "page",
"sglang_env" (SGLang's own environment variables for this run)}``.
Every engine serves the same two rounds of greedy requests: two prompts, then two that share a
prefix with the first (SGLang's radix cache turns those into an extend over a cached prefix).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

VOCAB = 512
PROMPTS = [list(range(1, 14)), [7, 8, 9]]
SHARED = [[*list(range(1, 14)), 40, 41, 42], [*list(range(1, 14)), 50]]
NEW_TOKENS = 10


def make_models(work: str) -> dict[str, str]:
    """A 2-layer GQA target, a 1-layer draft (its own random weights) and config-only EAGLE
    and EAGLE-3 heads (SGLang fills them with dummy weights)."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    paths = {}
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        path = os.path.join(work, name)
        paths[name] = path
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            torch_dtype="float32",
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
    with open(os.path.join(paths["target"], "config.json"), encoding="utf-8") as f:
        base = json.load(f)
    for name, arch in (("EAGLE", "LlamaForCausalLMEagle"), ("EAGLE3", "LlamaForCausalLMEagle3")):
        path = paths[name] = os.path.join(work, f"head_{name}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            # EAGLE-3 heads read draft_vocab_size (their own, possibly smaller, vocabulary).
            json.dump(
                {
                    **base,
                    "num_hidden_layers": 1,
                    "architectures": [arch],
                    "draft_vocab_size": VOCAB,
                },
                f,
            )
    _make_mla_models(work, paths)
    return paths


# MLA models: DeepSeek-V2's layout (no q LoRA, dense MLPs), latent 256 + rope 32 (a width
# SGLang's triton MLA decode kernel takes: 576, 288 or a power of two), decompressed 32 + 32 /
# 32 per head.
MLA = {"kv_lora_rank": 256, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32}
MLA_HEADS, MLA_HIDDEN, MLA_INTER = 4, 64, 128


def _mla_config(layers: int, arch: str) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": "deepseek_v2",
        "vocab_size": VOCAB,
        "hidden_size": MLA_HIDDEN,
        "intermediate_size": MLA_INTER,
        "moe_intermediate_size": MLA_INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": MLA_HEADS,
        "num_key_value_heads": MLA_HEADS,
        # Every layer dense (first_k_dense_replace = layers): no MoE kernels on a CPU.
        "first_k_dense_replace": layers,
        "moe_layer_freq": 1,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts": 2,
        "num_shared_experts": 1,
        "num_experts_per_tok": 1,
        "q_lora_rank": None,
        **MLA,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # SGLang's DeepSeek layers on a CPU take only DeepSeek's YaRN rope (factor 1: plain).
        "rope_scaling": None
        if arch == "SarvamMLAForCausalLM"
        else {
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "torch_dtype": "float32",
    }


def _mla_weights(layers: int, seed: int) -> dict[str, Any]:
    """Random weights by DeepSeek-V2's checkpoint names (SarvamMLA loads the same names); a
    0.2 scale keeps attention sharp, so a wrong key or mask changes the greedy tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Any:
        return torch.randn(*shape, generator=g) * 0.2

    d, h, lat = MLA_HIDDEN, MLA_HEADS, MLA["kv_lora_rank"]
    nope, rope, v = MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"], MLA["v_head_dim"]
    w = {
        "model.embed_tokens.weight": torch.randn(VOCAB, d, generator=g),
        "model.norm.weight": torch.ones(d),
        "lm_head.weight": r(VOCAB, d),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
        w[p + "self_attn.q_proj.weight"] = r(h * (nope + rope), d)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = r(lat + rope, d)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(lat)
        w[p + "self_attn.kv_b_proj.weight"] = r(h * (nope + v), lat)
        w[p + "self_attn.o_proj.weight"] = r(d, h * v)
        w[p + "mlp.gate_proj.weight"] = r(MLA_INTER, d)
        w[p + "mlp.up_proj.weight"] = r(MLA_INTER, d)
        w[p + "mlp.down_proj.weight"] = r(d, MLA_INTER)
    return w


def _make_mla_models(work: str, paths: dict[str, str]) -> None:
    """A 2-layer DeepSeek-V2 MLA target, a 1-layer DeepSeek MLA draft and a 1-layer Sarvam MLA
    draft (SarvamMLAForCausalLM, its own random weights)."""
    from safetensors.torch import save_file

    for name, layers, seed, arch in (
        ("mla_target", 2, 10, "DeepseekV2ForCausalLM"),
        ("mla_draft", 1, 11, "DeepseekV2ForCausalLM"),
        ("sarvam_draft", 1, 12, "SarvamMLAForCausalLM"),
    ):
        path = paths[name] = os.path.join(work, name)
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        os.makedirs(path, exist_ok=True)
        save_file(_mla_weights(layers, seed), os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(_mla_config(layers, arch), f)


def engine_kwargs(run: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model_path": paths[run.get("model", "target")],
        "device": run.get("device", "cpu"),
        "disable_cuda_graph": True,
        "grammar_backend": "none",
        "skip_tokenizer_init": True,
        "attention_backend": run["backend"],
        "page_size": run.get("page", 1),
        "dtype": run.get("dtype", "float32"),
        "mem_fraction_static": 0.3,
        "max_total_tokens": 2048,
        "log_level": "error",
    }
    spec = run.get("spec")
    if spec:
        algo = spec["algorithm"]
        kw.update(
            speculative_algorithm=algo,
            speculative_num_steps=spec.get("steps", 3),
            speculative_eagle_topk=spec.get("topk", 1),
            speculative_num_draft_tokens=spec.get("tokens", 4),
        )
        if spec.get("draft_backend"):  # the draft on one of SGLang's own backends
            kw["speculative_draft_attention_backend"] = spec["draft_backend"]
        if algo == "STANDALONE":
            kw["speculative_draft_model_path"] = paths[spec.get("draft", "draft")]
        else:
            kw["speculative_draft_model_path"] = paths[algo]
            kw["speculative_draft_load_format"] = "dummy"
    return kw


def one_run(run: dict[str, Any], paths: dict[str, str], work: str) -> dict[str, Any]:
    import sglang

    record = os.path.join(work, f"record_{run['name']}.json")
    if os.path.exists(record):
        os.remove(record)
    if run.get("env") is not None:
        env = dict(run["env"])
        if env.get("record") == "auto":
            env["record"] = record
        os.environ["ATTN_DISPATCH_SGLANG"] = json.dumps(env)
    else:
        os.environ.pop("ATTN_DISPATCH_SGLANG", None)
    # SGLang's own environment variables for this run (its scheduler subprocess inherits
    # them), put back afterwards.
    saved = {k: os.environ.get(k) for k in run.get("sglang_env", {})}
    os.environ.update(run.get("sglang_env", {}))
    try:
        return _run_engine(sglang, run, paths, record)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_engine(sglang: Any, run: dict[str, Any], paths: dict[str, str], record: str) -> Any:
    out: dict[str, Any] = {"name": run["name"]}
    t0 = time.perf_counter()
    try:
        engine = sglang.Engine(**engine_kwargs(run, paths))
    except Exception as exc:  # the refusal test reads this
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        return out
    out["setup_s"] = round(time.perf_counter() - t0, 1)
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
        first = engine.generate(input_ids=PROMPTS, sampling_params=params)
        second = engine.generate(input_ids=SHARED, sampling_params=params)
        results = first + second
        out["tokens"] = [r["output_ids"] for r in results]
        meta = [r["meta_info"] for r in results]
        out["cached_tokens"] = [m.get("cached_tokens", 0) for m in meta]
        out["verify_ct"] = [m.get("spec_verify_ct", 0) for m in meta]
        out["completion_tokens"] = [m.get("completion_tokens", 0) for m in meta]
    finally:
        engine.shutdown()
    if os.path.exists(record):
        with open(record, encoding="utf-8") as f:
            out["record"] = json.load(f)
    return out


# On a GPU: SGLang's own FlashInfer target alone, then the target on attn_dispatch's flashinfer
# (then fa3) with a STANDALONE draft on SGLang's own triton backend: the GQA draft, then the
# DeepSeek and Sarvam MLA drafts (the pattern: an MLA draft on its own backend beside a
# target on another; the same vocabulary, so the target's greedy tokens must come out).
GPU_RUNS: list[dict[str, Any]] = [
    {"name": "gpu_alone", "backend": "flashinfer", "env": None},
    *(
        {
            "name": f"gpu_{name}_{draft}",
            "backend": "attn_dispatch",
            "env": {"target": name, "record": "auto"},
            "spec": {"algorithm": "STANDALONE", "draft": draft, "draft_backend": "triton"},
        }
        for name in ("flashinfer", "fa3")
        for draft in ("draft", "mla_draft", "sarvam_draft")
    ),
]


def gpu_check(work: str) -> int:
    paths = make_models(work)
    results = []
    for run in GPU_RUNS:
        results.append(one_run({**run, "device": "cuda", "dtype": "bfloat16"}, paths, work))
        print("RESULT " + json.dumps(results[-1]), flush=True)
    alone = results[0].get("tokens")
    failed = 0
    for r in results[1:]:
        same = r.get("tokens") == alone and alone is not None
        failed += not same
        print(
            f"SUMMARY sglang engine {r['name']}: tokens {'equal' if same else 'DIFFER'} to "
            f"SGLang's flashinfer alone; setup {r.get('setup_s')} s; dispatch {r.get('record')}; "
            f"error {r.get('error')}"
        )
    return 1 if failed else 0


def main() -> None:
    work = sys.argv[1]
    if sys.argv[2] == "--gpu":
        sys.exit(gpu_check(work))
    runs = json.loads(sys.argv[2])
    paths = make_models(work)
    for run in runs:
        print("RESULT " + json.dumps(one_run(run, paths, work)), flush=True)


if __name__ == "__main__":
    main()
