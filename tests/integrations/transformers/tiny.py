"""The tiny random transformers models of the integration tests (no downloads), built in one
place: tests/integrations/transformers/ and tests/testing/test_isolation_transformers.py draw
from here. Each builder seeds torch first, so a model is the same in every test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def llama(seed: int = 0, layers: int = 2) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": layers}, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def qwen2(seed: int = 0, **config: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**{**COMMON, "num_key_value_heads": 2, **config})
    return transformers.Qwen2ForCausalLM(cfg).eval()


def deepseek_v3(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        **COMMON,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
    )
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


MODELS: dict[str, Callable[..., Any]] = {"llama": llama, "qwen2": qwen2, "deepseek_v3": deepseek_v3}


WINDOW = 3  # transformers' sliding_window: 3 keys, the query's own included
VARIANT = dict(COMMON, num_key_value_heads=2, initializer_range=0.2)
MIXED = ["sliding_attention", "full_attention"]


def mistral(seed: int = 0, window: int | None = WINDOW, **config: Any) -> Any:
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(**VARIANT, sliding_window=window, **config)
    ).eval()


def qwen2_sliding(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        **VARIANT, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def gemma2(seed: int = 0, cap: float | None = 0.5) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(
        **VARIANT,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=cap,
        tie_word_embeddings=False,  # tied + scaled embeddings echo the input token
    )
    return transformers.Gemma2ForCausalLM(cfg).eval()


def gemma3(seed: int = 0, **config: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        **VARIANT,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=MIXED,
        tie_word_embeddings=False,
        **config,
    )
    return transformers.Gemma3ForCausalLM(cfg).eval()


def cohere2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Cohere2Config(**VARIANT, sliding_window=WINDOW, layer_types=MIXED)
    return transformers.Cohere2ForCausalLM(cfg).eval()


def gpt_oss(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        **VARIANT, head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.GptOssForCausalLM(cfg).eval()


FAMILIES: dict[str, Callable[..., Any]] = {
    "mistral": mistral,
    "qwen2_sliding": qwen2_sliding,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "cohere2": cohere2,
    "gpt_oss": gpt_oss,
}


CHUNK = 8  # prompts of 13 and 8 tokens plus 10 new ones cross the boundaries at 8 and 16


def llama4_config(chunk: int | None = CHUNK) -> Any:
    # no_rope_layer_interval=2: layers 0, 2 use RoPE and are chunked, layers 1, 3 are NoPE
    # (with attention temperature tuning) and full, as Llama 4 interleaves them.
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=chunk,
        max_position_embeddings=256,
        no_rope_layer_interval=2,
        initializer_range=0.2,
    )


def llama4(seed: int = 0, chunk: int | None = CHUNK) -> Any:
    torch.manual_seed(seed)
    return transformers.Llama4ForCausalLM(llama4_config(chunk)).eval()


# test_cache_ops: its own vocabulary, two layer groups over a window of WINDOW keys.
CACHE_OPS_VOCAB = 96


def qwen2_two_groups(seed: int = 0, sliding: bool = True) -> Any:
    """Qwen2, two layers: layer 0 full attention, layer 1 a window of 3 keys (two groups,
    so every operation runs over two page allocators)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=CACHE_OPS_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        use_sliding_window=sliding,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()
