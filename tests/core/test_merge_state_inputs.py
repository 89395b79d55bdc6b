"""merge_state / merge_states at their edges: what they accept and what they refuse.

Accepted: any iterable of parts (list, tuple, generator), one part (a copy of itself), parts
of any floating dtype with float32 lse. Refused with ``InvalidBatchError`` naming the field:
one tensor where a sequence is due (iterating it would merge tokens), a string, parts whose
shapes, dtypes or devices differ, an lse of the wrong shape or dtype, a non-tensor part.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from attn_dispatch import InvalidBatchError
from attn_dispatch.state import merge_state
from attn_dispatch.state import merge_states
from tests import oracle


def _states(n_parts: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """States of attention over ``n_parts`` disjoint key slices, and the union's state."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 8, generator=g)
    k = torch.randn(4 * n_parts, 2, 8, generator=g)
    v = torch.randn(4 * n_parts, 2, 5, generator=g)
    outs, lses = [], []
    for i in range(n_parts):
        o, lse = oracle.reference_state(
            q, k[None, 4 * i : 4 * i + 4], v[None, 4 * i : 4 * i + 4], q_lens=[3], kv_lens=[4],
            page_tables=[[0]], sm_scale=0.3, causal=False,
        )  # fmt: skip
        outs.append(o.float())
        lses.append(lse.float())
    union = oracle.reference_state(
        q, k[None], v[None], q_lens=[3], kv_lens=[4 * n_parts], page_tables=[[0]], sm_scale=0.3,
        causal=False,
    )  # fmt: skip
    return outs, lses, union


def test_generators_are_accepted() -> None:
    outs, lses, (want_out, want_lse) = _states(3)
    out, lse = merge_states((o for o in outs), (x for x in lses))
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)


def test_one_part_is_itself() -> None:
    outs, lses, _ = _states(1)
    out, lse = merge_states(outs, lses)
    torch.testing.assert_close(out, outs[0])
    torch.testing.assert_close(lse, lses[0])
    assert out.data_ptr() != outs[0].data_ptr()  # a new tensor, not the part itself


def test_one_empty_part_gives_zeros_and_minus_inf() -> None:
    outs, lses, _ = _states(1)
    out, lse = merge_states(
        [torch.full_like(outs[0], math.nan)], [torch.full_like(lses[0], -math.inf)]
    )
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("which", ["outs", "lses"])
def test_one_tensor_instead_of_a_sequence_is_refused(which: str) -> None:
    outs, lses, _ = _states(2)
    args: dict[str, Any] = {"outs": outs, "lses": lses}
    args[which] = torch.stack(args[which])  # one tensor: its rows are not parts
    with pytest.raises(InvalidBatchError) as info:
        merge_states(args["outs"], args["lses"])
    assert info.value.field == which and "one tensor" in str(info.value)


@pytest.mark.parametrize("bad", ["outs", 3, None], ids=["str", "int", "None"])
def test_a_non_sequence_is_refused(bad: Any) -> None:
    _, lses, _ = _states(1)
    with pytest.raises(InvalidBatchError) as info:
        merge_states(bad, lses)
    assert info.value.field == "outs"


def _bad_pairs() -> list[tuple[Any, ...]]:
    (a, b), (la, lb), _ = _states(2)
    return [
        ("dtype of out", a, la, b.double(), lb, "out[1]"),
        ("shape of out", a, la, b[:, :, :4], lb, "out[1]"),
        ("tokens of out", a, la, b[:2], lb[:2], "out[1]"),
        ("lse float64", a, la, b, lb.double(), "lse[1]"),
        ("lse shape", a, la, b, lb[:, :1], "lse[1]"),
        ("lse not a tensor", a, la, b, [0.0], "parts[1]"),
        ("out integer", a.long(), la, b.long(), lb, "out[0]"),
    ]


BAD = _bad_pairs()


@pytest.mark.parametrize(
    ("what", "out_a", "lse_a", "out_b", "lse_b", "field"), BAD, ids=[p[0] for p in BAD]
)
def test_mismatched_parts_are_refused_naming_the_field(
    what: str, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, field: str
) -> None:
    with pytest.raises(InvalidBatchError) as info:
        merge_state(out_a, lse_a, out_b, lse_b)
    assert info.value.field == field, what
    with pytest.raises(InvalidBatchError) as info:
        merge_states(iter([out_a, out_b]), iter([lse_a, lse_b]))
    assert info.value.field == field, what
