"""KV layout descriptors: derived from a binding, bytes round trip, refusals naming each
difference (two FP8 layouts of different byte sizes differ: SGLang 37838), bad bytes refused
with our error, torch-free."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import bind
from attn_dispatch.kv_layout import FORMAT
from attn_dispatch.kv_layout import MAX_BYTES
from attn_dispatch.kv_layout import IncompatibleKVLayoutError
from attn_dispatch.kv_layout import InvalidKVLayoutError
from attn_dispatch.kv_layout import KVLayout
from attn_dispatch.kv_layout import assert_kv_compatible
from attn_dispatch.kv_layout import kv_differences
from attn_dispatch.kv_layout import kv_layout

FP8 = AttnConfig(
    "mha",
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    kv_dtype="float8_e4m3fn",
    page_size=16,
)
MLA = AttnConfig(
    "mla", num_q_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=16, dtype="float32", page_size=8
)

# One changed value per field, each still a valid layout on its own.
BASE = kv_layout(FP8)
CHANGED = {
    "kind": dict(kind="mla", num_kv_heads=1, v_head_dim=32, bytes_per_page=16 * 64),
    "page_size": dict(page_size=32, bytes_per_page=8192),
    "head_layout": dict(head_layout="HND"),
    "num_kv_heads": dict(num_kv_heads=4, bytes_per_page=8192),
    "head_dim": dict(head_dim=128, bytes_per_page=6144),
    "v_head_dim": dict(v_head_dim=32, bytes_per_page=4096),
    "kv_dtype": dict(kv_dtype="float8_e5m2"),
    "scale_kind": dict(scale_kind="per_token"),
    "bytes_per_page": dict(bytes_per_page=4096 + 16 * 2 * 4),  # per-token scales inline
    "lse_base": dict(lse_base="2"),
}


def test_layout_of_a_binding_says_what_its_pages_hold() -> None:
    layout = kv_layout(bind("torch", FP8, label="prefill"))
    assert layout == BASE
    assert (layout.kind, layout.head_layout, layout.scale_kind, layout.lse_base) == (
        "mha", "NHD", "per_tensor", "e",
    )  # fmt: skip
    assert layout.bytes_per_page == 16 * 2 * (64 + 64) * 1
    mla = kv_layout(MLA)
    assert (mla.bytes_per_page, mla.scale_kind) == (8 * 24 * 4, "none")


def test_layout_of_a_grouped_binding_names_its_group() -> None:
    full = dataclasses.replace(FP8, kv_dtype="bfloat16")
    binding = bind("torch", {"sliding": FP8, "full": full}, label="target")
    assert kv_layout(binding, group="full").kv_dtype == "bfloat16"
    assert kv_layout(binding, group="sliding") == BASE
    with pytest.raises(InvalidKVLayoutError, match="groups") as e:
        kv_layout(binding)
    assert e.value.field == "group"


@pytest.mark.parametrize("layout", [BASE, kv_layout(MLA), *(
    dataclasses.replace(BASE, **c) for c in CHANGED.values())])  # fmt: skip
def test_bytes_round_trip(layout: KVLayout) -> None:
    data = layout.to_bytes()
    assert data.startswith(FORMAT + b"\n") and len(data) < MAX_BYTES
    back = KVLayout.from_bytes(data)
    assert back == layout and back.fingerprint() == layout.fingerprint()
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_differing_field_is_refused_and_named(field: str) -> None:
    other = dataclasses.replace(BASE, **CHANGED[field])
    expected = {k for k in CHANGED[field] if getattr(other, k) != getattr(BASE, k)}
    assert field in expected
    with pytest.raises(IncompatibleKVLayoutError) as e:
        assert_kv_compatible(BASE, other.to_bytes())  # bytes from the other instance
    assert set(e.value.differences) == expected
    assert e.value.differences[field] == (getattr(BASE, field), getattr(other, field))
    assert f"{field}: {getattr(BASE, field)!r} != {getattr(other, field)!r}" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, AttnDispatchError)
    again = pickle.loads(pickle.dumps(e.value))  # crosses processes as it is
    assert again.differences == e.value.differences and str(again) == str(e.value)


def test_two_fp8_layouts_of_different_byte_sizes_differ() -> None:
    # SGLang 37838: same KV dtype, one layout with per-token scales inside the page.
    inline = dataclasses.replace(BASE, scale_kind="per_token", bytes_per_page=4096 + 128)
    assert inline.kv_dtype == BASE.kv_dtype
    assert set(kv_differences(BASE, inline)) == {"scale_kind", "bytes_per_page"}
    with pytest.raises(IncompatibleKVLayoutError, match="bytes_per_page: 4096 != 4224"):
        assert_kv_compatible(BASE, inline)


def test_equal_layouts_pass_whatever_the_compute_side() -> None:
    # The reader's compute dtype, query heads and backends are its own business.
    decode = bind("torch", dataclasses.replace(FP8, num_q_heads=16), label="decode")
    assert_kv_compatible(bind("torch", FP8, label="prefill"), decode)
    assert kv_differences(FP8, decode) == {}


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "format"),
        (b"attn_dispatch.kv_layout/2\n{}", "format"),
        (FORMAT + b"\nnot json", "data"),
        (FORMAT + b"\n\xff\xfe", "data"),
        (FORMAT + b"\n[1, 2]", "layout"),
        (FORMAT + b'\n{"kind": "mha"}', "layout"),
        (b"x" * (MAX_BYTES + 1), "data"),
        (BASE.to_bytes().replace(b'"page_size":16', b'"page_size":16.0'), "page_size"),
        (BASE.to_bytes().replace(b'"page_size":16', b'"page_size":-1'), "page_size"),
        (BASE.to_bytes().replace(b'"bytes_per_page":4096', b'"bytes_per_page":4095'),
         "bytes_per_page"),
        (BASE.to_bytes().replace(b'"per_tensor"', b'"none"'), "scale_kind"),
        (BASE.to_bytes().replace(b'"float8_e4m3fn"', b'"int4"'), "kv_dtype"),
        (BASE.to_bytes().replace(b'"e"', b'"10"'), "lse_base"),
        (BASE.to_bytes()[:-1] + b',"extra":1}', "layout"),
    ],
)  # fmt: skip
def test_bad_bytes_are_refused_with_our_error(data: bytes, field: str) -> None:
    with pytest.raises(InvalidKVLayoutError) as e:
        KVLayout.from_bytes(data)
    assert e.value.field == field
    assert pickle.loads(pickle.dumps(e.value)).field == field


def test_not_bytes_nor_a_layout_is_refused() -> None:
    with pytest.raises(InvalidKVLayoutError, match="pass a KVLayout"):
        assert_kv_compatible(BASE, "NHD")
    with pytest.raises(InvalidKVLayoutError):
        KVLayout.from_bytes("text")  # type: ignore[arg-type]


def test_the_module_imports_no_torch() -> None:
    code = (
        "import sys, attn_dispatch.kv_layout as k\n"
        "from attn_dispatch import AttnConfig\n"
        "k.kv_layout(AttnConfig('mha', num_q_heads=2, num_kv_heads=1, head_dim=8))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ranks_compare_the_kv_layout_up_to_the_head_split() -> None:
    from attn_dispatch.distributed import binding_summary
    from attn_dispatch.distributed import compare_summaries

    rank0 = binding_summary({"t": bind("torch", FP8)})
    half = binding_summary({"t": bind("torch", dataclasses.replace(FP8, num_q_heads=4,
                                                                    num_kv_heads=1))})  # fmt: skip
    assert compare_summaries([rank0, half]) == {}  # each rank holds its own heads
    assert rank0["runner 't'"]["kv_layout"]["bytes_per_page_per_kv_head"] == 4096 // 2
    e5m2 = binding_summary({"t": bind("torch", dataclasses.replace(FP8, kv_dtype="float8_e5m2"))})
    diffs = compare_summaries([rank0, e5m2])
    assert diffs["runner 't'.kv_layout.kv_dtype"] == ["float8_e4m3fn", "float8_e5m2"]


def test_lse_base_is_the_librarys() -> None:
    from attn_dispatch.distributed import LSE_BASE

    assert kv_layout(FP8).lse_base == LSE_BASE


def test_every_dtype_a_config_takes_has_a_layout() -> None:
    # A dtype added to the vocabulary must get its byte size here, or check_agreement (which
    # summarises every binding's layout) would refuse configs that bind.
    from attn_dispatch._vocab import DTYPE_NAMES

    for name in sorted(DTYPE_NAMES - {"float8_e4m3fn", "float8_e5m2"}):
        for kv in (name, "float8_e4m3fn", "float8_e5m2"):
            cfg = AttnConfig("mha", num_q_heads=2, num_kv_heads=1, head_dim=8, dtype=name,
                             kv_dtype=kv)  # fmt: skip
            assert kv_layout(cfg).kv_dtype == kv
