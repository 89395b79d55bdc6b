"""The context-parallel helpers refuse bad arguments with InvalidBatchError naming the field
(negative, float and duplicate owned positions, q longer than kv, caches and states of the
wrong shape), never a raw torch error or a silently wrong mask."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from attn_dispatch import Phase
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch.distributed import expand_state
from attn_dispatch.distributed import local_verify_mask
from attn_dispatch.distributed import merge_ranks
from attn_dispatch.distributed import shard_for_rank
from tests.contract.cases import materialise
from tests.strategies import KernelCase


@pytest.mark.parametrize(
    "args,field,words",
    [
        ((2, 8, [-1, 3]), "owned", "[0, 8)"),
        ((2, 8, [1.0, 3]), "owned", "positions are ints"),
        ((2, 8, [1.5, 3]), "owned", "positions are ints"),
        ((2, 8, [True, 3]), "owned", "positions are ints"),
        ((2, 8, [3, 5, 3]), "owned", "more than once"),
        ((2, 8, "13"), "owned", "sequence"),
        ((2, 8, 3), "owned", "sequence"),
        ((5, 3, [0, 1, 2]), "q_len", "q_len must be <= kv_len"),
        ((-1, 3, [0]), "q_len", ">= 0"),
        ((1, -3, []), "kv_len", ">= 0"),
        ((1.0, 3, [0]), "q_len", ">= 0"),
    ],
)
def test_local_verify_mask_refuses(args: tuple[Any, ...], field: str, words: str) -> None:
    with pytest.raises(InvalidBatchError) as e:
        local_verify_mask(*args)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_local_verify_mask_refuses_a_tree_that_is_not_a_tensor() -> None:
    with pytest.raises(InvalidBatchError) as e:
        local_verify_mask(2, 4, [0, 2], tree=[[True] * 4] * 2)  # type: ignore[arg-type]
    assert e.value.field == "tree"


def test_integer_positions_of_other_types_are_accepted() -> None:
    got = local_verify_mask(2, 4, [torch.tensor(1), 3])
    assert got.tolist() == [[True, False], [True, True]]


def _global() -> Any:
    case = KernelCase(
        kind="mha",
        phase=Phase.VERIFY,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        v_head_dim=16,
        page_size=4,
        dtype="float32",
        q_lens=(3, 2),
        prefix_lens=(5, 7),
        trees=None,
        extra_pages=1,
        seed=3,
        lse=True,
    )
    return materialise(case)


def test_shard_refuses_caches_of_the_wrong_shape() -> None:
    m = _global()
    k, v = m.k_cache, m.v_cache
    bad: list[tuple[Any, Any, str]] = [
        (k[..., 0], v, "k_cache"),  # 3-D K with a V cache
        (k, v[:, :, :1], "v_cache"),  # another head count
        (k, v[:-1], "v_cache"),  # fewer pages
        (k[:1], v[:1], "kv_indices"),  # the batch names pages past the cache
        ("cache", v, "k_cache"),
        (k, "cache", "v_cache"),
    ]
    for kc, vc, field in bad:
        with pytest.raises(InvalidBatchError) as e:
            shard_for_rank(m.batch, kc, vc, rank=0, world=2)
        assert e.value.field == field, (field, str(e.value))


def test_shard_refuses_a_page_size_other_than_the_batch() -> None:
    m = _global()
    k = m.k_cache.reshape(m.k_cache.shape[0] * 2, 2, *m.k_cache.shape[2:])
    v = m.v_cache.reshape(m.v_cache.shape[0] * 2, 2, *m.v_cache.shape[2:])
    batch = dataclasses.replace(m.batch, page_size=4)
    with pytest.raises(InvalidBatchError) as e:
        shard_for_rank(batch, k, v, rank=0, world=2)
    assert e.value.field == "k_cache" and "page size 2" in str(e.value)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"rank": 2, "world": 2}, "rank"),
        ({"rank": 0, "world": 0}, "world"),
        ({"rank": 0, "world": 2, "layout": "striped"}, "layout"),
        ({"rank": 0, "world": 2, "masks": [None]}, "masks"),
    ],
)
def test_shard_refuses_bad_layout_arguments(kwargs: dict[str, Any], field: str) -> None:
    m = _global()
    with pytest.raises(InvalidBatchError) as e:
        shard_for_rank(m.batch, m.k_cache, m.v_cache, **kwargs)
    assert e.value.field == field


def test_shard_refuses_what_is_not_a_batch() -> None:
    m = _global()
    with pytest.raises(InvalidBatchError) as e:
        shard_for_rank(object(), m.k_cache, m.v_cache, rank=0, world=2)
    assert e.value.field == "batch"


def test_expand_state_refuses_states_of_the_wrong_shape() -> None:
    m = _global()
    shard = shard_for_rank(m.batch, m.k_cache, m.v_cache, rank=0, world=2)
    rows = shard.rows.numel()
    good_out = torch.zeros(rows, 4, 16)
    good_lse = torch.zeros(rows, 4)
    cases: list[tuple[Any, Any, Any, int, str]] = [
        (good_out[:-1], good_lse, m.q, 16, "out"),
        (good_out, good_lse[:, :2], m.q, 16, "lse"),
        (good_out, None, m.q, 16, "lse"),
        (good_out, good_lse, m.q[0], 16, "like"),
        (good_out, good_lse, m.q, 0, "v_head_dim"),
    ]
    for out, lse, like, dv, field in cases:
        with pytest.raises(InvalidBatchError) as e:
            expand_state(out, lse, shard, like=like, v_head_dim=dv)
        assert e.value.field == field, (field, str(e.value))
    with pytest.raises(InvalidBatchError) as e:
        expand_state(good_out, good_lse, "shard", like=m.q, v_head_dim=16)  # type: ignore[arg-type]
    assert e.value.field == "shard"
    full_out, full_lse = expand_state(good_out, good_lse, shard, like=m.q, v_head_dim=16)
    assert full_out.shape == (m.q.shape[0], 4, 16) and full_lse.shape == (m.q.shape[0], 4)


@pytest.mark.parametrize(
    "out,lse,field",
    [
        (torch.zeros(3, 4), torch.zeros(3, 4), "out"),
        (torch.zeros(3, 4, 8), torch.zeros(3, 2), "lse"),
        (torch.zeros(3, 4, 8), torch.zeros(3, 4, dtype=torch.float64), "lse"),
    ],
)
def test_merge_ranks_checks_its_state_before_the_collective(out: Any, lse: Any, field: str) -> None:
    with pytest.raises(InvalidBatchError) as e:
        merge_ranks(out, lse)
    assert e.value.field == field
