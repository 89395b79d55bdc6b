"""The PagedCache use() installs: pages read in place, window pages freed, caches converted or
refused, and the options transformers offers that a paged cache cannot serve (tiny models)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attn_dispatch.integrations.transformers._attention as tf_attention  # noqa: E402
from attn_dispatch import InvalidSpecError  # noqa: E402
from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch.integrations.transformers import PagedCache  # noqa: E402
from attn_dispatch.integrations.transformers import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from tests.integrations.transformers.test_transformers import eager  # noqa: E402
from tests.integrations.transformers.test_transformers import generate  # noqa: E402
from tests.integrations.transformers.test_transformers import left_padded  # noqa: E402
from tests.integrations.transformers.tiny import VOCAB  # noqa: E402
from tests.integrations.transformers.tiny import WINDOW  # noqa: E402
from tests.integrations.transformers.tiny import gemma2  # noqa: E402
from tests.integrations.transformers.tiny import gpt_oss  # noqa: E402
from tests.integrations.transformers.tiny import llama  # noqa: E402
from tests.integrations.transformers.tiny import mistral  # noqa: E402
from tests.integrations.transformers.tiny import qwen2  # noqa: E402
from tests.integrations.transformers.tiny import qwen2_sliding  # noqa: E402


def test_generate_runs_on_a_paged_cache_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    model = llama()
    bound = use(model, "torch", page_size=4)
    seen: list[tuple[int, int, int]] = []
    from attn_dispatch import attention as real_attention

    def spy(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        seen.append((q.shape[0], k.data_ptr(), v.data_ptr()))
        return real_attention(q, k, v, **kw)

    monkeypatch.setattr(tf_attention, "attention", spy)
    ids, mask, _ = left_padded([9, 5])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            return_dict_in_generate=True,
        )
    cache = out.past_key_values
    assert isinstance(cache, PagedCache) and cache.owner is model
    layers = cache.paged_layers
    pools = set()
    for la in layers:
        assert la.keys is not None and la.values is not None
        assert tuple(la.keys.shape[1:]) == (4, 2, 16)  # pages of 4, Hkv 2
        pools.add((la.keys.data_ptr(), la.values.data_ptr()))
    # Every attention call, decode included, read the layer's own pools: no copy of past K/V.
    assert seen and {(k, v) for _, k, v in seen} <= pools
    assert [n for n, _, _ in seen[2:]] == [2] * 10  # 5 decode steps x 2 layers, one row each
    # Only real tokens are stored: 9 + 5 (prompts without padding) + 5 decoded per row... the
    # last generated token is never fed back, so each row holds prompt + 5.
    assert cache.lens == [9 + 5, 5 + 5]
    assert [len(t) for t in cache.groups["full"].tables] == [4, 3]  # ceil(14/4), ceil(10/4)
    bound.remove()


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize(("name", "make"), [("gemma2", gemma2), ("gpt_oss", gpt_oss)])
def test_sliding_pages_are_freed_and_tokens_stay_eagers(
    name: str, make: Any, page_size: int
) -> None:
    model = eager(make())
    ids, mask, _ = left_padded([11, 6], seed=3)
    expected = generate(model, ids, mask, new=14)
    use(model, "native", page_size=page_size)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=14,
            do_sample=False,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences[:, ids.shape[1] :], expected)
    cache = out.past_key_values
    sliding, full = cache.groups["sliding"], cache.groups["full"]
    for b, length in enumerate(cache.lens):
        # The next query needs WINDOW - 1 earlier keys: pages wholly before them are gone.
        first_needed = max(0, length - (WINDOW - 1)) // page_size
        assert sliding.skips[b] == first_needed, (b, sliding.skips[b])
        assert len(sliding.tables[b]) == -(-length // page_size) - first_needed
        assert len(full.tables[b]) == -(-length // page_size)
    # Freed pages are reused and the pools shrink once the prompt's pages are behind the
    # window: the sliding pools end smaller than the full ones.
    assert sliding.fresh < full.fresh
    if page_size <= 2:
        assert (
            cache.layers_of("sliding")[0].keys.shape[0]
            < cache.layers_of("full")[0].keys.shape[0] // 2
        )


def test_a_long_prompt_leaves_the_sliding_pools_small() -> None:
    model = eager(gemma2())
    ids = torch.randint(1, VOCAB, (2, 96), generator=torch.Generator().manual_seed(4))
    expected = generate(model, ids, new=4)
    use(model, "native", page_size=4)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences[:, 96:], expected)
    cache = out.past_key_values
    sliding = cache.groups["sliding"]
    assert cache.layers_of("full")[0].keys.shape[0] >= 2 * 99 // 4  # every token of both rows
    # The prefill wrote 96 tokens per row; the window (3 keys) needs one or two pages a row.
    assert cache.layers_of("sliding")[0].keys.shape[0] <= 8, sliding.capacity
    assert all(len(t) <= 2 for t in sliding.tables)


def test_fp8_pages_are_stored_once_with_scales_fixed_at_prefill() -> None:
    model = mistral()
    use(model, "torch", kv_dtype="float8_e4m3fn")
    ids, mask, _ = left_padded([8, 5])
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = first.past_key_values
        scales = [(la.k_scale, la.v_scale) for la in cache.paged_layers]
        assert all(la.keys.dtype == torch.float8_e4m3fn for la in cache.paged_layers)
        # A decode token much larger than the prefill's: stored saturated, scales unchanged.
        nxt = torch.randint(0, VOCAB, (2, 1))
        model(
            input_ids=nxt,
            attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
            cache=cache,
        )
    assert [(la.k_scale, la.v_scale) for la in cache.paged_layers] == scales
    assert all(s is not None and s > 0 for pair in scales for s in pair)


def test_a_dynamic_cache_is_converted_once_then_refused() -> None:
    ids, mask, _ = left_padded([9, 6], seed=3)  # row 1: three padding positions first
    model = llama()
    model.set_attn_implementation("sdpa")

    def prefix() -> Any:
        return model(input_ids=ids[:, :5], attention_mask=mask[:, :5], use_cache=True)

    with torch.no_grad():
        expected = model(input_ids=ids[:, 5:], attention_mask=mask, cache=prefix().past_key_values)
        dense = prefix().past_key_values
    assert type(dense).__name__ == "DynamicCache"
    use(model, "torch")
    with torch.no_grad():
        out = model(input_ids=ids[:, 5:], attention_mask=mask, cache=dense)
        real = mask.bool()
        torch.testing.assert_close(
            out.logits[real[:, 5:]], expected.logits[real[:, 5:]], rtol=1e-4, atol=1e-4
        )
        assert isinstance(out.past_key_values, PagedCache)
        assert out.past_key_values.lens == [9, 6]  # real tokens only
        # The DynamicCache was not updated: using it again would silently drop 4 tokens.
        with pytest.raises(UnsupportedModelError, match="converted into a PagedCache"):
            model(input_ids=ids[:, 5:], attention_mask=mask, cache=dense)


def test_a_sliding_dynamic_cache_past_its_window_is_refused() -> None:
    model = eager(mistral())
    with torch.no_grad():
        dense = model(input_ids=torch.randint(0, VOCAB, (1, 6)), use_cache=True).past_key_values
    use(model, "torch")
    with pytest.raises(UnsupportedModelError, match="do not hold all 6 cached positions"):
        with torch.no_grad():
            model(input_ids=torch.randint(0, VOCAB, (1, 1)), cache=dense)


def test_caches_of_other_kinds_and_models_are_refused() -> None:
    from transformers.cache_utils import StaticCache

    model, other = llama(), llama(seed=1)
    use(model, "torch")
    bound_other = use(other, "torch")
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        static = StaticCache(config=model.config, max_cache_len=16)
        with pytest.raises(UnsupportedModelError, match="a StaticCache cannot be served"):
            model(input_ids=ids, cache=static)
        with pytest.raises(UnsupportedModelError, match="belongs to another model"):
            model(input_ids=ids, cache=bound_other.new_cache())


def test_static_and_quantized_cache_implementations_are_refused() -> None:
    model = llama()
    use(model, "torch")
    for implementation in ("static", "offloaded_static", "quantized", "offloaded"):
        with pytest.raises(UnsupportedModelError, match=f"cache_implementation='{implementation}'"):
            generate(
                model, torch.randint(0, VOCAB, (1, 4)), new=2, cache_implementation=implementation
            )


def test_output_attentions_is_refused() -> None:
    model = llama()
    use(model, "torch")
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(UnsupportedModelError, match="output_attentions"):
        generate(model, ids, new=2, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(UnsupportedModelError, match="output_attentions"), torch.no_grad():
        model(input_ids=ids, output_attentions=True)


def test_continuous_batching_is_refused_with_our_error() -> None:
    model = llama()
    bound = use(model, "torch")
    with pytest.raises(UnsupportedModelError, match="continuous batching"):
        model.generate_batch(inputs=[[1, 2, 3]])
    with pytest.raises(UnsupportedModelError, match="continuous batching"):
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), cache_implementation="paged")
    bound.remove()
    assert "generate_batch" not in model.__dict__


def test_a_mask_that_changes_cached_positions_is_refused() -> None:
    model = llama()
    use(model, "torch")
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        hide_one = torch.tensor([[1, 0, 1, 1, 1, 1]])
        with pytest.raises(UnsupportedModelError, match="changed for cached positions"):
            model(input_ids=ids[:, :1], attention_mask=hide_one, cache=cache)
        # Refused before any write: the cache still continues correctly.
        assert cache.lens == [5] and cache.dense_len == 5
        model(input_ids=ids[:, :1], cache=cache)
        assert cache.lens == [6]


def test_a_failing_forward_leaves_the_cache_as_it_was() -> None:
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    model = llama()
    use(model, "torch")

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        expected = model(input_ids=ids[:, 5:6], cache=model(input_ids=ids[:, :5]).past_key_values)
        handle = model.model.layers[1].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids[:, 5:], cache=cache)  # layer 0 wrote its two tokens already
        handle.remove()
        assert cache.lens == [5, 5] and cache.dense_len == 5
        got = model(input_ids=ids[:, 5:6], cache=cache)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)


def test_beam_search_and_sampling_give_eagers_tokens() -> None:
    model = eager(qwen2_sliding())
    ids, mask, _ = left_padded([7, 4], seed=9)
    with torch.no_grad():
        beams = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False
        )
        torch.manual_seed(5)
        sampled = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True
        )
    use(model, "torch", page_size=2)
    with torch.no_grad():
        got_beams = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False
        )
        torch.manual_seed(5)
        got_sampled = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True
        )
    assert torch.equal(got_beams, beams)
    assert torch.equal(got_sampled, sampled)


def test_assisted_generation_rolls_back_sliding_pages() -> None:
    # Page size 1: the target's sliding pages would be freed after each forward if the
    # rollback (crop) of rejected candidates could not bring them back.
    target, assistant = eager(gemma2(seed=0)), eager(gemma2(seed=1))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    plain = generate(target, ids, new=14)
    use(target, "torch", label="target", page_size=1)
    use(assistant, "native", label="assistant", page_size=1)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    with record_dispatch() as rec:
        assisted = generate(target, ids, new=14, assistant_model=assistant)
    assert torch.equal(assisted, plain)
    assert ("target", "sliding", "verify", "torch") in set(rec.group_counts())


def test_page_size_is_checked() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidSpecError, match="page_size"):
            use(llama(), "torch", page_size=bad)  # type: ignore[arg-type]


def test_configs_transformers_cannot_read_per_layer_are_refused_by_name() -> None:
    model = mistral(per_layer_config={1: {"sliding_window": 5}})
    with pytest.raises(UnsupportedModelError, match=r"\['sliding_window'\] per layer"):
        use(model, "torch")
    model = qwen2()
    model.config.layer_types = ["full_attention"]  # 1 entry for 2 layers
    with pytest.raises(UnsupportedModelError, match="layer_types lists 1 layers"):
        use(model, "torch")


def test_a_grouped_scope_plans_each_group_with_its_own_batch() -> None:
    # The core hook the paged cache relies on: a batch carrying group_batches gives each
    # group its own pages (here: the "b" group sees only the last 3 of 7 keys).
    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch.integrations.transformers import GroupedBatches

    cfg = AttnConfig(
        kind="mha", num_q_heads=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=1
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, generator=gen)
    k = torch.randn(7, 1, 1, 8, generator=gen)
    v = torch.randn(7, 1, 1, 8, generator=gen)

    def batch(pages: list[int]) -> Any:
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1], kv_lens=[len(pages)], page_tables=[pages], page_size=1
        )

    full, tail = batch(list(range(7))), batch([4, 5, 6])
    grouped = bind("torch", {"a": cfg, "b": cfg})
    with attn_scope(grouped, GroupedBatches(Phase.DECODE, {"a": full, "b": tail})):
        got_a = attention(q, k, v, sm_scale=0.5, group="a")
        got_b = attention(q, k, v, sm_scale=0.5, group="b")
    plain = bind("torch", cfg)
    with attn_scope(plain, full):
        want_a = attention(q, k, v, sm_scale=0.5)
    with attn_scope(plain, tail):
        want_b = attention(q, k, v, sm_scale=0.5)
    torch.testing.assert_close(got_a, want_a)
    torch.testing.assert_close(got_b, want_b)
    assert not torch.allclose(got_a, got_b)


@pytest.mark.parametrize("page_size", [3, 16])
@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize(("name", "make"), [("llama", llama), ("gemma2", gemma2)])
def test_a_forward_without_cache_gives_eagers_logits(
    name: str, make: Any, backend: str, page_size: int
) -> None:
    """use_cache=False runs the dense path: K/V gathered into pages of the bound page size (it
    once built one-token pages and was refused against the bound page size)."""
    ids, mask, _ = left_padded([WINDOW + 7, 4, 11])
    ref_model = eager(make())
    model = make()
    use(model, backend, page_size=page_size)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)


def test_a_forwards_batch_and_slots_match_the_checked_builder() -> None:
    """begin() makes the batch from int32 tensors of the allocator's lists and a decode
    step's slots in Python: the same batch as ``AttnBatch.build`` and the same slots as the
    tensor path; values past int32 still go through ``build``, which refuses them."""
    from attn_dispatch import AttnBatch
    from attn_dispatch import InvalidBatchError
    from attn_dispatch import Phase
    from attn_dispatch.integrations.transformers import _cache

    tables = [[7, 2, 9], [4], [0, 5]]
    q_lens, kv_lens = [1, 3, 2], [9, 4, 6]
    for phase in (Phase.DECODE, Phase.VERIFY):
        if phase is Phase.DECODE:
            q_lens = [1, 1, 1]
        got = _cache._batch(phase, q_lens, kv_lens, tables, 4, 10, "cpu")
        want = AttnBatch.build(
            phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=4, num_pages=10
        )
        for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_lens"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (got.num_tokens, got.max_kv_len, got.num_pages) == (
            want.num_tokens, want.max_kv_len, want.num_pages,
        )  # fmt: skip
    firsts, counts = [8, 1, 4], [1, 3, 2]
    small = _cache._slots(tables, firsts, counts, 4, sum(counts))
    large = _cache._slots(tables, firsts, counts, 4, _cache._PY_SLOTS + 1)
    assert small.tolist() == large.tolist() == [9 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3,
                                                5 * 4 + 0, 5 * 4 + 1]  # fmt: skip
    with pytest.raises(InvalidBatchError):  # a page past the pools: the contract check
        _cache._batch(Phase.DECODE, [1], [4], [[10]], 4, 10, "cpu")
    with pytest.raises(InvalidBatchError):  # past int32: build's own error
        _cache._batch(Phase.DECODE, [1], [2**31], [[0]], 4, 10, "cpu")
