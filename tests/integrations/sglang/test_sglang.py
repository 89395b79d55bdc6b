"""attn_dispatch.integrations.sglang, and the SGLang mapping checked against SGLang itself.

The recorded grid (tests/data/sglang_grid_0.5.23.json, written by tools/sglang_grid.py from
SGLang's own code) is checked everywhere; the installed-SGLang tests run where it is.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UnknownPhaseError
from attn_dispatch.integrations.sglang import attn_config_from_layer
from attn_dispatch.integrations.sglang import forward_phase
from attn_dispatch.integrations.sglang import phase_of
from attn_dispatch.integrations.sglang import spec_from_server_args
from attn_dispatch.integrations.sglang import variant_fields


class ForwardMode(enum.IntEnum):  # the shape of SGLang's enum (names matter, not values)
    EXTEND = enum.auto()
    DECODE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()
    NEW_MODE = enum.auto()


@pytest.mark.parametrize(
    ("mode", "phase"),
    [
        (ForwardMode.EXTEND, Phase.PREFILL),
        (ForwardMode.DECODE, Phase.DECODE),
        (ForwardMode.TARGET_VERIFY, Phase.VERIFY),
        (ForwardMode.DRAFT_EXTEND_V2, Phase.VERIFY),
    ],
)
def test_forward_phase_reads_the_batch_mode(mode: ForwardMode, phase: Phase) -> None:
    assert forward_phase(types.SimpleNamespace(forward_mode=mode)) is phase


def test_unknown_forward_mode_raises() -> None:
    with pytest.raises(UnknownPhaseError, match="NEW_MODE"):
        forward_phase(types.SimpleNamespace(forward_mode=ForwardMode.NEW_MODE))


def test_draft_and_target_specs_from_one_set_of_server_args() -> None:
    args = types.SimpleNamespace(
        attention_backend="triton",
        decode_attention_backend="flashinfer",
        speculative_draft_attention_backend="torch",
        speculative_attention_mode="decode",
    )
    target = spec_from_server_args(args)
    draft = spec_from_server_args(args, is_draft=True)
    assert (target.prefill, target.decode, target.backend_for(Phase.VERIFY)) == (
        "triton",
        "flashinfer",
        "flashinfer",
    )
    assert set(draft.names) == {"torch"}
    # Without the override the algorithm's rule applies: DFLASH runs the prefill backend.
    args.speculative_draft_attention_backend = None
    dflash = spec_from_server_args(args, is_draft=True, speculative_algorithm="DFLASH")
    assert dflash.names == ("triton", "triton", "triton")
    eagle = spec_from_server_args(args, is_draft=True, speculative_algorithm="EAGLE")
    assert eagle.names == ("flashinfer", "flashinfer", "flashinfer")


# --- Checked against SGLang itself ---------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
GRID_FILE = ROOT / "tests" / "data" / "sglang_grid_0.5.23.json"


def _grid_tool() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_grid", ROOT / "tools" / "sglang_grid.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    doc = json.loads(GRID_FILE.read_text())
    doc["rows"] = _grid_tool().unpacked(doc)
    return doc


def test_recorded_grid_is_sglang_0_5_23_over_the_whole_grid(recorded: dict[str, Any]) -> None:
    assert recorded["sglang_version"] == "0.5.23"
    size = 1
    for values in recorded["grid"].values():
        size *= len(values)
    assert len(recorded["rows"]) == size == 2592
    accepted = [row for row in recorded["rows"] if "rejected" not in row]
    assert len(accepted) == 2544
    # Every real ForwardMode of that release has a phase.
    assert {phase_of(m) for m in recorded["forward_modes"]} == set(Phase)


def test_recorded_grid_target_matches_sglang(recorded: dict[str, Any]) -> None:
    checked = 0
    for row in recorded["rows"]:
        if "rejected" in row:
            continue
        spec = spec_from_server_args(row["resolved"])
        for mode, backend in row["target"].items():
            if mode == "DRAFT_EXTEND_V2":  # a draft-runner mode; see test_phase.py
                continue
            assert spec.backend_for(phase_of(mode)) == backend, (row["input"], mode)
            checked += 1
    assert checked == 2544 * 8


def test_recorded_grid_draft_matches_sglang(recorded: dict[str, Any]) -> None:
    checked = 0
    for row in recorded["rows"]:
        draft = row.get("draft")
        if not isinstance(draft, dict):  # no draft runner, or SGLang refuses to build one
            continue
        spec = spec_from_server_args(row["resolved"], is_draft=True)
        for mode, backend in draft.items():
            assert spec.backend_for(phase_of(mode)) == backend, (row["input"], mode)
        checked += 1
    assert checked == 1912


def test_recorded_grid_has_the_cases_that_used_to_differ(recorded: dict[str, Any]) -> None:
    rows = [r for r in recorded["rows"] if "rejected" not in r]
    # Mode "decode", no draft override, prefill != decode: the draft extends on decode.
    decode_mode = [
        r
        for r in rows
        if r["resolved"]["speculative_algorithm"] == "EAGLE"
        and r["resolved"]["speculative_attention_mode"] == "decode"
        and r["resolved"]["speculative_draft_attention_backend"] is None
        and r["target"]["EXTEND"] != r["target"]["DECODE"]
        and r["target"]["DECODE"] != "cutedsl_mla"  # its draft extends on trtllm_mla
        and isinstance(r["draft"], dict)  # not refused by SGLang (torch_native)
    ]
    assert decode_mode
    for r in decode_mode:
        assert r["draft"]["DRAFT_EXTEND_V2"] == r["draft"]["EXTEND"] == r["target"]["DECODE"]
        draft = spec_from_server_args(r["resolved"], is_draft=True)
        assert draft.prefill == r["target"]["DECODE"]
    # tokenspeed_mla: SGLang runs trtllm_mla for prefill, cutedsl_mla for decode.
    tokenspeed = [r for r in rows if r["input"].get("attention_backend") == "tokenspeed_mla"]
    assert tokenspeed
    for r in tokenspeed:
        raw = spec_from_server_args(r["input"])  # older releases: raw values only
        if "prefill_attention_backend" not in r["input"]:
            assert raw.prefill == "trtllm_mla" == r["target"]["EXTEND"]
            assert raw.note is not None and "tokenspeed_mla" in raw.note


def test_recorded_rejections_are_sglangs(recorded: dict[str, Any]) -> None:
    rejected = [r for r in recorded["rows"] if "rejected" in r]
    assert rejected and all(r["rejected"].startswith("ValueError") for r in rejected)
    refused_drafts = [r for r in recorded["rows"] if isinstance(r.get("draft"), str)]
    assert all("torch_native" in r["draft"] for r in refused_drafts)


# Runs only where SGLang is installed (see tools/sglang_grid.py for the packages).


def _run_grid_tool(*args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (pip install --no-deps sglang==0.5.23 ...)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sglang_grid.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def test_phase_of_every_real_forward_mode() -> None:
    from tests.core.test_phase import SGLANG_MODES

    proc = _run_grid_tool("--modes")
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "TARGET_VERIFY" in modes and "EXTEND" in modes
    for name in modes:
        assert phase_of(name) is SGLANG_MODES[name], name


def test_grid_against_installed_sglang() -> None:
    proc = _run_grid_tool("--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'target_mismatch': 0" in proc.stdout and "'draft_mismatch': 0" in proc.stdout


# --- Layer variants as RadixAttention spells them --------------------------------------------


def radix_layer(**fields: Any) -> types.SimpleNamespace:
    """The public fields of SGLang's RadixAttention (as its __init__ stores them)."""
    base = dict(
        tp_q_head_num=8,
        tp_k_head_num=2,
        tp_v_head_num=2,
        head_dim=64,
        qk_head_dim=64,
        v_head_dim=64,
        scaling=0.125,
        layer_id=0,
        logit_cap=0.0,
        sliding_window_size=-1,
        is_cross_attention=False,
        logit_capping_method="tanh",
    )
    return types.SimpleNamespace(**{**base, **fields})


def enum_value(value: str) -> Any:
    """A stand-in for SGLang's ``AttentionType`` member (an Enum with string values)."""
    return types.SimpleNamespace(value=value)


def test_sliding_window_size_is_window_left_and_logit_cap_is_logit_cap() -> None:
    # Gemma 2 in SGLang: sliding_window_size = HF sliding_window - 1 = 4095, logit_cap 50.
    cfg = attn_config_from_layer(
        radix_layer(sliding_window_size=4095, logit_cap=50.0), dtype="bfloat16", page_size=16
    )
    assert (cfg.window_left, cfg.logit_cap, cfg.sinks) == (4095, 50.0, False)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sm_scale) == (8, 2, 64, 0.125)
    full = attn_config_from_layer(radix_layer(), dtype="bfloat16", page_size=16)
    assert (full.window_left, full.logit_cap) == (None, None)


@pytest.mark.parametrize(
    ("size", "window"), [(-1, None), (0, None), (None, None), (1, 1), (127, 127)]
)
def test_sliding_window_size_follows_radix_attentions_none_values(
    size: int | None, window: int | None
) -> None:
    # RadixAttention stores `sliding_window_size or -1`: 0 and None are "no window" there.
    assert variant_fields(sliding_window_size=size)["window_left"] == window


def test_sglang_names_reach_a_binding_and_sinks_are_a_flag() -> None:
    from attn_dispatch import bind

    cfg = attn_config_from_layer(
        radix_layer(sliding_window_size=3, logit_cap=30.0), dtype="float32", page_size=4, sinks=True
    )
    binding = bind("torch", cfg)
    assert binding.config.window_left == 3 and binding.config.sinks


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"logit_capping_method": "clamp"}, "logit_capping_method"),
        ({"is_cross_attention": True}, "is_cross_attention"),
        ({"sliding_window_size": 2.5}, "sliding_window_size"),
        ({"logit_cap": -1.0}, "logit_cap"),
        ({"attn_type": enum_value("decoder_bidirectional")}, "attn_type"),
        ({"use_irope": True}, "attention_chunk_size"),
    ],
)
def test_sglang_values_we_do_not_serve_are_refused_by_name(
    fields: dict[str, Any], name: str
) -> None:
    with pytest.raises(InvalidSpecError) as info:
        attn_config_from_layer(radix_layer(**fields), dtype="bfloat16", page_size=16)
    assert info.value.field == name


def test_sglang_attention_types_map_to_causal_and_chunk() -> None:
    # Llama 4 in SGLang: the chunked layers have use_irope=True; the chunk size is the model
    # config's attention_chunk_size (kept on the model runner, not on the layer).
    chunked = attn_config_from_layer(
        radix_layer(use_irope=True), dtype="bfloat16", page_size=16, attention_chunk_size=8192
    )
    assert chunked.attention_chunk_size == 8192 and chunked.causal
    full = attn_config_from_layer(
        radix_layer(use_irope=False), dtype="bfloat16", page_size=16, attention_chunk_size=8192
    )
    assert full.attention_chunk_size is None
    encoder = attn_config_from_layer(
        radix_layer(attn_type=enum_value("encoder_only")), dtype="bfloat16", page_size=16
    )
    assert not encoder.causal and "non_causal" in encoder.variants
    decoder = attn_config_from_layer(
        radix_layer(attn_type=enum_value("decoder")), dtype="bfloat16", page_size=16
    )
    assert decoder.causal
