"""merge_state / merge_states: merging attention over disjoint key sets equals attention over
their union (the float64 oracle), empty parts contribute nothing, bad input is refused."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from attn_dispatch import InvalidBatchError
from attn_dispatch.state import merge_state
from attn_dispatch.state import merge_states
from tests import oracle


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention state of q [T, H, D] over k/v [N, H, D]: (out [T, H, Dv], lse [T, H]);
    the oracle (tests/oracle.py) with the N keys as one page every query sees."""
    t, h = q.shape[:2]
    if k.shape[0] == 0:  # no key: out 0, lse -inf (a page of 0 slots cannot hold them)
        empty = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
        return empty, torch.full((t, h), -math.inf, dtype=torch.float64)
    n = k.shape[0]
    return oracle.reference_state(
        q, k[None], v[None], q_lens=[t], kv_lens=[n], page_tables=[[0]], sm_scale=1.0,
        causal=False,
    )  # fmt: skip


def _parts(seed: int, n: int, cuts: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 8, generator=g)
    k = torch.randn(n, 2, 8, generator=g) * 2
    v = torch.randn(n, 2, 5, generator=g)
    return q, k, v, torch.tensor(cuts)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 40),
    parts=st.integers(1, 5),
    data=st.data(),
)
def test_merge_of_split_key_sets_equals_union(
    seed: int, n: int, parts: int, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    q, k, v, _ = _parts(seed, n, cuts)
    bounds = [0, *cuts, n]
    outs, lses = [], []
    for a, b in itertools.pairwise(bounds):
        o, lse = _attend(q, k[a:b], v[a:b])
        outs.append(o.float())
        lses.append(lse.float())
    out, lse = merge_states(outs, lses)
    ref_out, ref_lse = _attend(q, k, v)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)


def test_two_part_merge_is_the_many_part_merge_and_keeps_dtype() -> None:
    q, k, v, _ = _parts(1, 20, [])
    oa, la = _attend(q, k[:7], v[:7])
    ob, lb = _attend(q, k[7:], v[7:])
    out, lse = merge_state(oa.bfloat16(), la.float(), ob.bfloat16(), lb.float())
    assert out.dtype == torch.bfloat16
    ref, ref_lse = _attend(q, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_empty_part_contributes_nothing_even_with_nan_output() -> None:
    q, k, v, _ = _parts(2, 9, [])
    o, lse = _attend(q, k, v)
    empty_out = torch.full_like(o.float(), math.nan)
    empty_lse = torch.full_like(lse.float(), -math.inf)
    out, merged = merge_state(empty_out, empty_lse, o.float(), lse.float())
    assert not out.isnan().any()
    torch.testing.assert_close(out, o.float())
    torch.testing.assert_close(merged, lse.float())
    # Both empty: zeros and -inf, no NaN.
    out, merged = merge_state(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(merged).all()


def test_nan_lse_gives_nan_row_only() -> None:
    q, k, v, _ = _parts(3, 6, [])
    o, lse = _attend(q, k, v)
    bad = lse.float().clone()
    bad[1, 0] = math.nan
    out, merged = merge_state(o.float(), bad, o.float(), lse.float())
    assert out[1, 0].isnan().all() and merged[1, 0].isnan()
    mask = torch.ones(3, 2, dtype=torch.bool)
    mask[1, 0] = False
    assert not out[mask].isnan().any()


def test_posinf_part_dominates() -> None:
    q, k, v, _ = _parts(4, 6, [])
    o, lse = _attend(q, k, v)
    inf_out = torch.ones_like(o.float())
    inf_lse = torch.full_like(lse.float(), math.inf)
    out, merged = merge_state(o.float(), lse.float(), inf_out, inf_lse)
    assert torch.equal(out, inf_out)
    assert torch.isposinf(merged).all()


@pytest.mark.parametrize(
    ("outs", "lses", "field"),
    [
        ([], [], "out"),
        ([torch.zeros(2, 1, 4)], [], "lse"),
        ([torch.zeros(2, 1, 4)], [torch.zeros(2, 1, dtype=torch.float64)], "lse[0]"),
        ([torch.zeros(2, 1, 4)], [torch.zeros(2, 2)], "lse[0]"),
        ([torch.zeros(2, 1, 4), torch.zeros(2, 1, 3)], [torch.zeros(2, 1)] * 2, "out[1]"),
        ([torch.zeros(2, 4)], [torch.zeros(2)], "out[0]"),
        ([torch.zeros(2, 1, 4, dtype=torch.int32)], [torch.zeros(2, 1)], "out[0]"),
        (["x"], [torch.zeros(2, 1)], "parts[0]"),
    ],
)
def test_bad_input_names_the_field(outs: list[object], lses: list[object], field: str) -> None:
    with pytest.raises(InvalidBatchError) as info:
        merge_states(outs, lses)  # type: ignore[arg-type]
    assert info.value.field == field
