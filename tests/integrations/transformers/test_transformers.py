"""transformers models dispatching through attn_dispatch (tiny random models, no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch import IncompatibleBackendError  # noqa: E402
from attn_dispatch import InvalidSpecError  # noqa: E402
from attn_dispatch import UnknownBackendError  # noqa: E402
from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch.integrations.transformers import FP8_MAX  # noqa: E402
from attn_dispatch.integrations.transformers import IMPLEMENTATION  # noqa: E402
from attn_dispatch.integrations.transformers import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.transformers import attn_config_for  # noqa: E402
from attn_dispatch.integrations.transformers import attn_configs_for  # noqa: E402
from attn_dispatch.integrations.transformers import dispatch_mask  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from tests.integrations.transformers.tiny import FAMILIES  # noqa: E402
from tests.integrations.transformers.tiny import MODELS  # noqa: E402
from tests.integrations.transformers.tiny import VOCAB  # noqa: E402
from tests.integrations.transformers.tiny import deepseek_v3  # noqa: E402
from tests.integrations.transformers.tiny import gemma2  # noqa: E402
from tests.integrations.transformers.tiny import gemma3  # noqa: E402
from tests.integrations.transformers.tiny import gpt_oss  # noqa: E402
from tests.integrations.transformers.tiny import llama  # noqa: E402
from tests.integrations.transformers.tiny import mistral  # noqa: E402
from tests.integrations.transformers.tiny import qwen2  # noqa: E402


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


@pytest.mark.parametrize(
    ("name", "backend"), [(n, "torch") for n in sorted(MODELS)] + [("llama", "native")]
)
def test_greedy_generate_matches_sdpa_with_left_padding(name: str, backend: str) -> None:
    model = MODELS[name]()
    model.set_attn_implementation("sdpa")
    ids, mask, _ = left_padded([7, 4])
    expected = generate(model, ids, mask)
    bound = use(model, backend, label=name)
    assert model.config._attn_implementation == IMPLEMENTATION
    with record_dispatch() as rec:
        got = generate(model, ids, mask)
    assert torch.equal(got, expected)
    layers = model.config.num_hidden_layers
    assert rec.counts() == {
        (name, "prefill", backend): layers,
        (name, "decode", backend): 5 * layers,
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


def test_mask_function_refuses_patterns_it_cannot_represent() -> None:
    from transformers.masking_utils import bidirectional_mask_function
    from transformers.masking_utils import causal_mask_function
    from transformers.masking_utils import or_masks

    for pattern in (
        bidirectional_mask_function,
        or_masks(causal_mask_function, lambda b, h, q, k: k == 0),  # a custom overlay
    ):
        with pytest.raises(UnsupportedModelError, match="beyond causal"):
            dispatch_mask(1, 4, 4, mask_function=pattern)


def test_calling_outside_a_wrapped_forward_is_an_error() -> None:
    from transformers.masking_utils import causal_mask_function

    from attn_dispatch import NoActiveScopeError

    with pytest.raises(NoActiveScopeError, match="use\\(model, spec\\)"):
        dispatch_mask(1, 4, 4, mask_function=causal_mask_function)


# --- Layer variants: sliding windows, soft-caps, sinks, mixed layer groups -------------------

# What each family's binding must say: groups, and the variants of each.
EXPECTED_GROUPS = {
    "mistral": {"sliding": (2, None, False)},
    "qwen2_sliding": {"sliding": (2, None, False), "full": (None, None, False)},
    "gemma2": {"sliding": (2, 0.5, False), "full": (None, 0.5, False)},
    "gemma3": {"sliding": (2, None, False), "full": (None, None, False)},
    "cohere2": {"sliding": (2, None, False), "full": (None, None, False)},
    "gpt_oss": {"sliding": (2, None, True), "full": (None, None, True)},
}


def eager(model: Any) -> Any:
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_variant_family_generates_eagers_tokens_on_a_left_padded_batch(
    name: str, backend: str
) -> None:
    model = eager(FAMILIES[name]())
    ids, mask, _ = left_padded([8, 4])
    expected = generate(model, ids, mask, new=8)
    configs = attn_configs_for(model.config, dtype=torch.float32, device="cpu", sinks=True)
    got_groups = {g: (c.window_left, c.logit_cap) for g, c in configs.items()}
    assert got_groups == {g: v[:2] for g, v in EXPECTED_GROUPS[name].items()}
    bound = use(model, backend, label=name)
    groups = bound.binding.groups
    if len(EXPECTED_GROUPS[name]) > 1:  # one grouped binding, a group per layer type
        cfgs = {g: b.config for g, b in groups.items()}
    else:  # every layer alike (Mistral: all sliding): a plain binding
        assert not groups
        cfgs = {"sliding": bound.binding.config}
    got_cfgs = {g: (c.window_left, c.logit_cap, c.sinks) for g, c in cfgs.items()}
    assert got_cfgs == EXPECTED_GROUPS[name]
    with record_dispatch() as rec:
        got = generate(model, ids, mask, new=8)
    assert torch.equal(got, expected)
    # Every layer dispatched in its own group: each group once per layer of its type and forward.
    layer_types = list(getattr(model.config, "layer_types", None) or ["sliding_attention"] * 2)
    per_group = {g: layer_types.count(f"{g}_attention") for g in EXPECTED_GROUPS[name]}
    want = {}
    for g, n in per_group.items():
        key = g if groups else None
        want[(name, key, "prefill", backend)] = n
        want[(name, key, "decode", backend)] = 7 * n
    assert rec.group_counts() == want
    bound.remove()


def test_the_variants_change_these_tiny_models_tokens() -> None:
    # So the test above can fail: without its window / cap / sinks each model decodes otherwise.
    ids, mask, _ = left_padded([8, 4])
    assert not torch.equal(
        generate(eager(mistral()), ids, mask, new=8),
        generate(eager(mistral(window=None)), ids, mask, new=8),
    )
    assert not torch.equal(
        generate(eager(gemma2()), ids, mask, new=8),
        generate(eager(gemma2(cap=None)), ids, mask, new=8),
    )
    with_sinks, without = eager(gpt_oss()), eager(gpt_oss())
    with torch.no_grad():
        for m in without.modules():
            if hasattr(m, "sinks"):
                m.sinks.fill_(-1e4)  # e^(sink) = 0: no sink at all
    assert not torch.equal(
        generate(with_sinks, ids, mask, new=8), generate(without, ids, mask, new=8)
    )


def test_assisted_generation_with_sliding_window_models(torch2: str) -> None:
    target, assistant = eager(gemma2(seed=0)), eager(gemma2(seed=1))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    plain = generate(target, ids, new=10)
    use(target, "torch", label="target")
    use(assistant, torch2, label="assistant")
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    with record_dispatch() as rec:
        assisted = generate(target, ids, new=10, assistant_model=assistant)
    assert torch.equal(assisted, plain)
    seen = {(str(label), group, phase, b) for label, group, phase, b in rec.group_counts()}
    for group in ("sliding", "full"):
        assert {("target", group, "prefill", "torch"), ("target", group, "verify", "torch")} <= seen
        assert ("assistant", group, "decode", torch2) in seen


def test_a_backend_without_a_variant_is_refused_at_bind_with_the_reason() -> None:
    # FlashInfer 0.7.4 serves no sinks (gpt-oss has them): refused with that reason, and the
    # model is left as it was.
    model = gpt_oss()
    before = model.config._attn_implementation
    with pytest.raises(IncompatibleBackendError, match="sinks"):
        use(model, "flashinfer")
    assert model.config._attn_implementation == before
    assert "forward" not in model.__dict__


def test_padding_inside_a_row_is_refused_for_windowed_models() -> None:
    model = mistral()
    use(model, "torch")
    ids = torch.randint(0, VOCAB, (1, 6))
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(UnsupportedModelError, match="padding between real tokens"):
        generate(model, ids, mask, new=2)


def test_sliding_mask_of_another_width_is_refused() -> None:
    from transformers.masking_utils import sliding_window_causal_mask_function

    model = mistral()
    use(model, "torch")
    seen: list[BaseException] = []

    def probe(*args: Any, **kwargs: Any) -> Any:
        try:
            dispatch_mask(
                1, 4, 4, mask_function=sliding_window_causal_mask_function(5), local_size=5
            )
        except UnsupportedModelError as err:
            seen.append(err)
        return None

    # A mask request is only valid inside a wrapped forward: check from within one.
    handle = model.model.layers[0].register_forward_pre_hook(probe)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 4)))
    handle.remove()
    assert seen and "sliding_window=3" in str(seen[0])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: gemma3(use_bidirectional_attention=True), "bidirectional"),
        (
            lambda: qwen2(layer_types=["full_attention", "chunked_attention"]),
            "'chunked_attention' layers but attention_chunk_size=None",
        ),
    ],
)
def test_what_is_not_served_is_refused_by_name(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        use(make().eval(), "torch")


def last_logits(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        first = model(input_ids=ids[:, :-3], attention_mask=mask[:, :-3], use_cache=True)
        return model(input_ids=ids[:, -3:], attention_mask=mask, cache=first.past_key_values).logits


# Max |logit difference| / max |logit| against the same model with full-precision pages, on
# these deliberately sensitive tiny models (initializer_range 0.2: errors grow layer to layer).
# Measured with scales fixed at the prefill (later tokens may saturate): e4m3fn 0.138, e5m2
# 0.239 (with a scale per forward, as before the paged cache: 0.081, 0.141).
FP8_TOLERANCE = {"float8_e4m3fn": 0.16, "float8_e5m2": 0.28}


def register_fp8_eager(kv_dtype: str) -> str:
    """transformers' eager attention on K/V rounded as use(kv_dtype=...) documents it: one
    scale for K and one for V per layer, amax / FP8_MAX of the prefill's tensors (padding
    included), fixed from then on; the values stored as x / scale in FP8, saturating."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    from transformers.models.mistral.modeling_mistral import eager_attention_forward

    limit, fp8 = FP8_MAX[kv_dtype], getattr(torch, kv_dtype)
    scales: dict[tuple[int, str], float] = {}

    def rounded(x: Any, layer: int, which: str, prefill: bool) -> Any:
        if prefill:
            scales[layer, which] = float(x.abs().amax()) / limit
        scale = scales[layer, which]
        return ((x / scale).clamp(-limit, limit).to(fp8).float() * scale).to(x.dtype)

    def fn(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        prefill = key.shape[2] == query.shape[2]  # nothing cached before this forward
        k = rounded(key, module.layer_idx, "k", prefill)
        v = rounded(value, module.layer_idx, "v", prefill)
        return eager_attention_forward(module, query, k, v, mask, **kw)

    name = f"eager_{kv_dtype}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, eager_mask)
    return name


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("kv_dtype", sorted(FP8_TOLERANCE))
def test_fp8_pages_are_eager_on_rounded_kv_and_close_to_full_precision(
    kv_dtype: str, backend: str
) -> None:
    ids, mask, _ = left_padded([10, 6], seed=4)
    model = mistral()
    model.set_attn_implementation(register_fp8_eager(kv_dtype))
    expected = last_logits(model, ids, mask)
    bound = use(model, "torch")
    full = last_logits(model, ids, mask)
    bound.remove()
    bound = use(model, backend, kv_dtype=kv_dtype)
    assert bound.binding.config.kv_dtype == kv_dtype
    got = last_logits(model, ids, mask)
    # Exactly what the documented rounding gives (up to fp32 summation order)...
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # ...which is a real rounding, within the stated tolerance of full precision.
    rel = float((got - full).abs().max() / full.abs().max())
    assert 0.0 < rel <= FP8_TOLERANCE[kv_dtype], rel


def test_each_group_may_have_its_own_spec(torch2: str) -> None:
    model = eager(gemma2())
    ids, mask, _ = left_padded([8, 4])
    expected = generate(model, ids, mask, new=4)
    use(model, {"sliding": "torch", "full": torch2}, label="g")
    with record_dispatch() as rec:
        got = generate(model, ids, mask, new=4)
    assert torch.equal(got, expected)
    assert {(group, backend) for _, group, _, backend in rec.group_counts()} == {
        ("sliding", "torch"),
        ("full", torch2),
    }
    with pytest.raises(InvalidSpecError, match="one group"):
        use(mistral(), {"full": "torch"})


def test_a_layer_that_differs_from_its_group_config_is_refused() -> None:
    # The binding is made from the config; a layer changed after use() cannot be served.
    model = gemma2()
    use(model, "torch")
    model.model.layers[1].self_attn.attn_logit_softcapping = 7.0
    with pytest.raises(UnsupportedModelError, match=r"layer 1: softcap=7\.0"):
        generate(model, torch.randint(0, VOCAB, (1, 4)), new=1)
