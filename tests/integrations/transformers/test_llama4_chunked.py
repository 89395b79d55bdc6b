"""Llama 4 text models through use(): chunked_attention layers as the "chunked" group
(attention_chunk_size), full layers as "full", against transformers' eager attention on tiny
random models whose prompts cross chunk boundaries."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch.integrations.transformers import PagedCache  # noqa: E402
from attn_dispatch.integrations.transformers import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.transformers import attn_configs_for  # noqa: E402
from attn_dispatch.integrations.transformers import dispatch_mask  # noqa: E402
from attn_dispatch.integrations.transformers import layer_groups  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from tests.integrations.transformers.test_transformers import eager  # noqa: E402
from tests.integrations.transformers.test_transformers import generate  # noqa: E402
from tests.integrations.transformers.test_transformers import left_padded  # noqa: E402
from tests.integrations.transformers.tiny import CHUNK  # noqa: E402
from tests.integrations.transformers.tiny import VOCAB  # noqa: E402
from tests.integrations.transformers.tiny import llama4  # noqa: E402
from tests.integrations.transformers.tiny import llama4_config  # noqa: E402


def test_chunked_layers_map_to_a_chunked_group_and_full_layers_to_full() -> None:
    config = llama4_config()
    assert config.layer_types == ["chunked_attention", "full_attention"] * 2  # transformers'
    assert layer_groups(config) == ["chunked", "full", "chunked", "full"]
    configs = attn_configs_for(config, dtype=torch.float32, device="cpu")
    assert sorted(configs) == ["chunked", "full"]
    assert configs["chunked"].attention_chunk_size == CHUNK
    assert configs["full"].attention_chunk_size is None
    assert configs["chunked"].replace(attention_chunk_size=None) == configs["full"]
    assert (configs["full"].num_q_heads, configs["full"].num_kv_heads) == (4, 2)
    assert configs["full"].head_dim == 16


def test_the_chunks_change_this_tiny_models_tokens() -> None:
    # Otherwise the tests below could not tell chunked attention from full attention.
    ids, mask, _ = left_padded([13, 8])
    chunked = generate(eager(llama4()), ids, mask, new=10)
    whole = generate(eager(llama4(chunk=4096)), ids, mask, new=10)
    assert not torch.equal(chunked, whole)


@pytest.mark.parametrize(
    ("backend", "page_size"), [("torch", 3), ("torch", 16), ("native", 3), ("native", 16)]
)
def test_generates_eagers_tokens_on_a_left_padded_batch(backend: str, page_size: int) -> None:
    model = eager(llama4())
    ids, mask, _ = left_padded([13, 8])
    expected = generate(model, ids, mask, new=10)
    bound = use(model, backend, label="llama4", page_size=page_size)
    cfgs = {g: b.config for g, b in bound.binding.groups.items()}
    assert {g: c.attention_chunk_size for g, c in cfgs.items()} == {"chunked": CHUNK, "full": None}
    with record_dispatch() as rec:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences[:, ids.shape[1] :], expected)
    # Two layers per group: one prefill and nine decode steps each.
    assert rec.group_counts() == {
        ("llama4", group, phase, backend): n
        for group in ("chunked", "full")
        for phase, n in (("prefill", 2), ("decode", 18))
    }
    cache = out.past_key_values
    assert isinstance(cache, PagedCache)
    assert cache.lens == [13 + 9, 8 + 9]
    pages = [-(-n // page_size) for n in cache.lens]
    full = cache.groups["full"]
    assert [len(t) for t in full.tables] == pages and full.skips == [0, 0]
    # The chunked group freed the pages before the next query's chunk (it starts at 16 in both
    # rows), in whole multiples of lcm(page_size, 8) tokens: pages of 3 -> 24 (nothing yet),
    # pages of 16 -> 16 (one page).
    chunked = cache.groups["chunked"]
    dropped = {3: 0, 16: 1}[page_size]
    assert chunked.skips == [dropped, dropped]
    assert [len(t) for t in chunked.tables] == [n - dropped for n in pages]
    bound.remove()


def test_chunk_pages_are_freed_in_whole_chunks_and_tokens_stay_eagers() -> None:
    # Pages of 4, chunks of 8: after 30 real tokens the next query's chunk starts at 24, so
    # 6 pages (24 tokens, 3 whole chunks) are freed; positions shift by whole chunks.
    model = eager(llama4())
    ids, mask, _ = left_padded([17, 11], seed=2)
    expected = generate(model, ids, mask, new=14)
    use(model, "native", page_size=4)
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
    assert cache.lens == [17 + 13, 11 + 13]
    chunked = cache.groups["chunked"]
    assert chunked.skips == [24 // 4, 24 // 4]
    assert [len(t) for t in chunked.tables] == [-(-30 // 4) - 6, -(-24 // 4) - 6]
    # Rolling back before the kept pages is refused (no past recorded): one token back, row 1
    # (at 24) would need its chunk from 16 again. A refused crop changes nothing.
    for back in (-7, -1):
        with pytest.raises(UnsupportedModelError, match="before the pages the chunked layers"):
            cache.crop(back)
        assert cache.lens == [30, 24] and chunked.skips == [6, 6]
        assert cache.dense_len == ids.shape[1] + 13


def test_assisted_generation_rolls_back_chunk_pages() -> None:
    # Pages of one token: a chunk's pages would be freed after each forward if the rollback
    # (crop) of rejected candidates could not bring them back.
    target, assistant = eager(llama4(seed=0)), eager(llama4(seed=1))
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
    assert ("target", "chunked", "verify", "torch") in set(rec.group_counts())


def test_a_multi_token_step_across_a_chunk_boundary_is_eagers() -> None:
    # VERIFY: 7 new tokens on a cache of 6 (positions 6..12 cross the boundary at 8), with a
    # left-padded second row whose chunks start at its first real token.
    model = eager(llama4())
    ids, mask, _ = left_padded([13, 10], seed=4)

    def logits() -> Any:
        with torch.no_grad():
            first = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
            return model(
                input_ids=ids[:, 6:], attention_mask=mask, cache=first.past_key_values
            ).logits

    expected = logits()
    use(model, "native", label="l4")
    with record_dispatch() as rec:
        got = logits()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert {phase for _, phase, _ in rec.counts()} == {"prefill", "verify"}


def test_padding_inside_a_row_is_refused_for_chunked_models() -> None:
    model = llama4()
    use(model, "torch")
    ids = torch.randint(0, VOCAB, (1, 10))
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(UnsupportedModelError, match=r"padding between real tokens.*chunked"):
        generate(model, ids, mask, new=2)


def test_a_chunked_mask_of_another_size_is_refused() -> None:
    from transformers.masking_utils import chunked_causal_mask_function

    model = llama4()
    use(model, "torch")
    seen: list[BaseException] = []

    def probe(*_: Any) -> None:
        # A mask request is only valid inside a wrapped forward: check from within one.
        for size in (CHUNK // 2, CHUNK):
            try:
                dispatch_mask(
                    1,
                    4,
                    4,
                    mask_function=chunked_causal_mask_function(size, torch.zeros(1, dtype=int)),
                    local_size=size,
                )
            except UnsupportedModelError as err:
                seen.append(err)

    handle = model.model.layers[0].register_forward_pre_hook(probe)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 4)))
    handle.remove()
    assert len(seen) == 1 and "chunked attention of 4 tokens" in str(seen[0])
    assert f"attention_chunk_size={CHUNK}" in str(seen[0])


def test_a_model_that_asks_for_no_chunked_mask_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A chunked layer's attention call carries no sign of its pattern: a model whose code
    # builds a plain causal mask for the layers its config calls chunked is not served.
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama4 import modeling_llama4

    model = llama4()
    use(model, "torch")
    monkeypatch.setattr(modeling_llama4, "create_chunked_causal_mask", create_causal_mask)
    with pytest.raises(UnsupportedModelError, match="asked for no chunked mask"):
        generate(model, torch.randint(0, VOCAB, (1, 5)), new=1)


def test_chunked_layers_without_a_chunk_size_are_refused() -> None:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["full_attention", "chunked_attention"],
    )
    with pytest.raises(UnsupportedModelError, match="attention_chunk_size=None"):
        attn_configs_for(config, dtype=torch.float32, device="cpu")
