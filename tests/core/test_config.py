"""AttnConfig: validation on construction, normalisation of dtypes and devices."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
from hypothesis import given

from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import InvalidSpecError
from tests.strategies import attn_configs
from tests.strategies import mha_config
from tests.strategies import mla_config


def test_mha_defaults() -> None:
    c = AttnConfig("mha", 8, 2, 128)
    assert c.v_head_dim == 128  # defaults to head_dim for MHA
    assert c.kv_dtype == c.dtype == "bfloat16"
    assert c.device_type == "cpu"
    assert c.group_size == 4
    assert c.out_head_dim == 128


def test_mla_deepseek() -> None:
    c = mla_config(device="CUDA:1")
    assert (c.num_q_heads, c.num_kv_heads, c.head_dim, c.v_head_dim) == (16, 1, 576, 512)
    assert c.device == "cuda:1" and c.device_type == "cuda"
    assert c.out_head_dim == 512


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("torch.bfloat16", "bfloat16"),
        ("FLOAT32", "float32"),
    ],
)
def test_dtype_aliases(alias: str, name: str) -> None:
    c = mha_config(dtype=alias)
    assert c.dtype == name
    assert c.kv_dtype == name


@pytest.mark.parametrize(("alias", "name"), [("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_alias_is_a_kv_dtype_only(alias: str, name: str) -> None:
    assert mha_config(kv_dtype=alias).kv_dtype == name
    with pytest.raises(InvalidSpecError) as info:
        mha_config(dtype=alias)
    assert info.value.field == "dtype" and info.value.value == name


def test_torch_dtypes_and_devices_normalised() -> None:
    torch = pytest.importorskip("torch")
    c = mha_config(dtype=torch.float16, kv_dtype=torch.bfloat16, device=torch.device("cpu"))
    assert (c.dtype, c.kv_dtype, c.device) == ("float16", "bfloat16", "cpu")


def test_kv_dtype_separate() -> None:
    c = mha_config(dtype="bfloat16", kv_dtype="fp8_e4m3")
    assert (c.dtype, c.kv_dtype) == ("bfloat16", "float8_e4m3fn")


def _raises(field: str, value: Any, words: str, **changes: Any) -> InvalidSpecError:
    maker = mla_config if changes.get("kind", "mha") == "mla" else mha_config
    with pytest.raises(InvalidSpecError) as info:
        maker(**changes)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
    assert err.field == field
    assert err.value == value or (err.value is value)
    assert f"{field}={value!r}" in str(err)
    assert words in str(err)
    return err


@pytest.mark.parametrize("field", ["num_q_heads", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8"])
def test_positive_ints(field: str, value: Any) -> None:
    _raises(field, value, "must be a positive int", **{field: value})


def test_v_head_dim_positive() -> None:
    _raises("v_head_dim", 0, "positive int", v_head_dim=0)


def test_gqa_divisibility() -> None:
    err = _raises("num_q_heads", 6, "multiple of num_kv_heads=4", num_q_heads=6, num_kv_heads=4)
    assert "grouped-query" in str(err)


def test_kind_unknown() -> None:
    _raises("kind", "gqa", "choose 'mha' or 'mla'", kind="gqa")


def test_dtype_unknown() -> None:
    err = _raises("dtype", "int8", "unknown dtype", dtype="int8")
    assert "bfloat16" in str(err)
    _raises("kv_dtype", "float64", "unknown dtype", kv_dtype="float64")


def test_mla_needs_one_kv_head() -> None:
    _raises("num_kv_heads", 2, "one latent KV head", kind="mla", num_q_heads=16, num_kv_heads=2)


def test_mla_needs_v_head_dim() -> None:
    _raises("v_head_dim", None, "latent width", kind="mla", v_head_dim=None)


@pytest.mark.parametrize("v", [576, 600])
def test_mla_v_below_head_dim(v: int) -> None:
    _raises("v_head_dim", v, "head_dim=576", kind="mla", v_head_dim=v)


def test_mla_decompressed_form() -> None:
    c = mla_config(mha_head_dim=192, mha_v_head_dim=128)
    assert c.has_decompressed_form
    _raises("mha_head_dim", (192, None), "give both", kind="mla", mha_head_dim=192)
    _raises("mha_head_dim", 192, "only an MLA config", mha_head_dim=192, mha_v_head_dim=128)


def test_empty_device_and_tree_verify_type() -> None:
    _raises("device", "", "name a device", device="  ")
    _raises("tree_verify", 1, "must be a bool", tree_verify=1)


def test_frozen_replace_revalidates() -> None:
    c = mha_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.head_dim = 1  # type: ignore[misc]
    d = c.replace(head_dim=128)
    assert d.head_dim == 128 and c.head_dim == 64 and d.v_head_dim == 64  # v kept from c
    with pytest.raises(InvalidSpecError):
        c.replace(num_kv_heads=3)


@given(attn_configs())
def test_round_trips(config: AttnConfig) -> None:
    assert AttnConfig(**config.to_dict()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config.replace()) == hash(config)


@pytest.mark.parametrize(
    "bad", [0, 0.0, -0.125, float("nan"), float("inf"), -float("inf"), "0.125", True, [0.1]]
)
def test_sm_scale_must_be_finite_and_positive(bad: Any) -> None:
    with pytest.raises(InvalidSpecError) as info:
        mha_config().replace(sm_scale=bad)
    assert info.value.field == "sm_scale"
    assert "finite float > 0" in str(info.value)


def test_sm_scale_stored_as_float_and_carried_to_the_decompressed_form() -> None:
    assert mha_config().sm_scale is None
    cfg = mha_config().replace(sm_scale=1)
    assert cfg.sm_scale == 1.0 and type(cfg.sm_scale) is float
    mla = mla_config().replace(mha_head_dim=6, mha_v_head_dim=4, sm_scale=0.2)
    assert mla.decompressed().sm_scale == 0.2
    assert pickle.loads(pickle.dumps(mla)) == mla


def test_return_lse_flag() -> None:
    c = mha_config(return_lse=True, sinks=True)
    assert c.return_lse and c.variants == {"lse", "sinks"}
    assert "lse" not in mha_config().variants
    assert AttnConfig(**c.to_dict()) == c and pickle.loads(pickle.dumps(c)) == c
    for bad in (1, "yes", None):
        with pytest.raises(InvalidSpecError) as info:
            mha_config(return_lse=bad)
        assert info.value.field == "return_lse"
