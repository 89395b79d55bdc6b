"""transformers models dispatching through attn_dispatch (tiny random models, no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch import UnknownBackendError  # noqa: E402
from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch import register_backend  # noqa: E402
from attn_dispatch import unregister_backend  # noqa: E402
from attn_dispatch.backends.reference import CAPABILITIES as TORCH_CAPS  # noqa: E402
from attn_dispatch.integrations.transformers import IMPLEMENTATION  # noqa: E402
from attn_dispatch.integrations.transformers import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.transformers import attn_config_for  # noqa: E402
from attn_dispatch.integrations.transformers import dispatch_mask  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402

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


def qwen2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**COMMON, num_key_value_heads=2)
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


@pytest.fixture(autouse=True)
def _quiet_one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def torch2() -> Iterator[str]:
    register_backend(
        "torch2",
        capabilities=TORCH_CAPS,
        factory="attn_dispatch.backends.reference.backend:TorchBackend",
        replace=True,
    )
    yield "torch2"
    unregister_backend("torch2")


def left_padded(lengths: list[int], seed: int = 1) -> tuple[Any, Any, list[Any]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask, prompts


def generate(model: Any, ids: Any, mask: Any = None, new: int = 6, **kw: Any) -> Any:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw
        )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generate_matches_sdpa_with_left_padding(name: str) -> None:
    model = MODELS[name]()
    model.set_attn_implementation("sdpa")
    ids, mask, _ = left_padded([7, 4])
    expected = generate(model, ids, mask)
    bound = use(model, "torch", label=name)
    assert model.config._attn_implementation == IMPLEMENTATION
    with record_dispatch() as rec:
        got = generate(model, ids, mask)
    assert torch.equal(got, expected)
    layers = model.config.num_hidden_layers
    assert rec.counts() == {
        (name, "prefill", "torch"): layers,
        (name, "decode", "torch"): 5 * layers,
    }
    bound.remove()
    assert model.config._attn_implementation == "sdpa"
    assert "forward" not in model.__dict__


def test_deepseek_v3_config_is_the_non_absorbed_form() -> None:
    cfg = attn_config_for(deepseek_v3().config, dtype=torch.float32, device="cpu")
    assert (cfg.kind, cfg.num_q_heads, cfg.num_kv_heads) == ("mha", 4, 4)
    assert (cfg.head_dim, cfg.v_head_dim) == (24, 16)  # nope 16 + rope 8 vs v 16
    gqa = attn_config_for(llama().config, dtype=torch.float32, device="cpu")
    assert (gqa.num_q_heads, gqa.num_kv_heads, gqa.head_dim) == (4, 2, 16)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_multi_token_step_on_a_cache_is_causal(name: str) -> None:
    # The case a missing mask function breaks: several new tokens on a cache (VERIFY).
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))

    def logits_of_last_four() -> Any:
        with torch.no_grad():
            first = model(input_ids=ids[:, :5], use_cache=True)
            return model(input_ids=ids[:, 5:], cache=first.past_key_values).logits

    model.set_attn_implementation("sdpa")
    expected = logits_of_last_four()
    use(model, "torch", label="m")
    with record_dispatch() as rec:
        got = logits_of_last_four()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert {phase for _, phase, _ in rec.counts()} == {"prefill", "verify"}


def test_padded_batch_equals_each_prompt_alone() -> None:
    model = qwen2()
    use(model, "torch")
    ids, mask, prompts = left_padded([9, 3, 6], seed=5)
    together = generate(model, ids, mask, new=5)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], torch.ones(1, p.numel(), dtype=torch.long), new=5)
        assert torch.equal(together[i], alone[0]), f"prompt {i}"


def test_assisted_generation_each_model_on_its_own_backend(torch2: str) -> None:
    target, assistant = llama(seed=0), llama(seed=1, layers=1)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    target.set_attn_implementation("sdpa")
    plain = generate(target, ids, new=10)
    use(target, "torch", label="target")
    use(assistant, torch2, label="assistant")
    # A fixed number of candidates per round, so the assistant takes DECODE steps.
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    with record_dispatch() as rec:
        assisted = generate(target, ids, new=10, assistant_model=assistant)
    assert torch.equal(assisted, plain)
    counts = rec.counts()
    by_runner: dict[str, set[tuple[str, str]]] = {}
    for label, phase, backend in counts:
        by_runner.setdefault(str(label), set()).add((phase, backend))
    assert {b for _, b in by_runner["target"]} == {"torch"}
    assert {b for _, b in by_runner["assistant"]} == {"torch2"}
    # The target checks candidates in multi-token VERIFY forwards; the assistant drafts them
    # in DECODE steps. Both prefill the prompt first.
    assert {"prefill", "verify"} <= {p for p, _ in by_runner["target"]}
    assert {"prefill", "decode"} <= {p for p, _ in by_runner["assistant"]}


def test_spec_per_phase_is_followed(torch2: str) -> None:
    model = llama()
    use(model, f"prefill=torch,decode={torch2}", label="m")
    with record_dispatch() as rec:
        generate(model, torch.randint(0, VOCAB, (1, 4)), new=3)
    assert set(rec.counts()) == {("m", "prefill", "torch"), ("m", "decode", torch2)}


def test_unknown_backend_raises_before_touching_the_model() -> None:
    model = llama()
    before = model.config._attn_implementation
    with pytest.raises(UnknownBackendError):
        use(model, "flashinfr")
    assert model.config._attn_implementation == before
    assert "forward" not in model.__dict__


def test_binding_twice_is_refused() -> None:
    model = llama()
    use(model, "torch")
    with pytest.raises(UnsupportedModelError, match="already bound"):
        use(model, "torch")


def test_sliding_window_models_are_refused() -> None:
    cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="full-attention layers only"):
        use(model, "torch")


def test_mask_function_refuses_patterns_it_cannot_represent() -> None:
    from transformers.masking_utils import sliding_window_causal_mask_function

    with pytest.raises(UnsupportedModelError, match="beyond causal"):
        dispatch_mask(1, 4, 4, mask_function=sliding_window_causal_mask_function(2))


def test_calling_outside_a_wrapped_forward_is_an_error() -> None:
    from transformers.masking_utils import causal_mask_function

    from attn_dispatch import NoActiveScopeError

    with pytest.raises(NoActiveScopeError, match="use\\(model, spec\\)"):
        dispatch_mask(1, 4, 4, mask_function=causal_mask_function)
