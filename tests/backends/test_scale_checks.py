"""``TensorChecks.check_scales``: the per-call scales every built-in handler called without a
binding checks (native and sdpa call it), in one place."""

from __future__ import annotations

import math

import pytest

from attn_dispatch import InvalidBatchError
from attn_dispatch.backend import TensorChecks


def test_valid_scales_come_back_as_floats_in_order() -> None:
    got = TensorChecks.check_scales(0.25, 2, 0.5, fp8=True)
    assert got == (0.25, 2.0, 0.5)
    assert all(type(x) is float for x in got)


def test_kv_scales_other_than_one_are_refused_without_fp8() -> None:
    assert TensorChecks.check_scales(0.125, 1.0, 1.0, fp8=False) == (0.125, 1.0, 1.0)
    with pytest.raises(InvalidBatchError, match="scales apply to FP8 caches only") as e:
        TensorChecks.check_scales(0.125, 1.0, 2.0, fp8=False)
    assert e.value.field == "k_scale"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((math.nan, 1.0, 1.0), "sm_scale"),
        ((0.1, -1.0, 1.0), "k_scale"),
        ((0.1, 1.0, math.inf), "v_scale"),
        ((0.1, "1", 1.0), "k_scale"),
    ],
)
def test_a_bad_scale_is_named(args: tuple[object, object, object], field: str) -> None:
    with pytest.raises(InvalidBatchError) as e:
        TensorChecks.check_scales(*args, fp8=True)
    assert e.value.field == field
    assert field in str(e.value)
