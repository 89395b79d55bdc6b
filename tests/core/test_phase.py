"""Phase and phase_of: SGLang forward-mode names map to the three phases; unknown names raise."""

from __future__ import annotations

import enum

import pytest

from attn_dispatch import AttnDispatchError
from attn_dispatch import Phase
from attn_dispatch import UnknownPhaseError
from attn_dispatch.integrations.sglang import phase_of

# Where SGLang runs each ForwardMode, stated from its code rather than from our table:
# HybridAttnBackend._select_backend (0.5.23) sends DECODE/IDLE to the decode backend,
# TARGET_VERIFY to the one speculative_attention_mode names, everything else to prefill.
# DRAFT_EXTEND_V2 runs on EAGLE's draft-extend backend, chosen by speculative_attention_mode
# (DraftBackendFactory.create_draft_extend_backend); DRAFT_EXTEND (<= 0.5.13) was routed like
# TARGET_VERIFY by that release's HybridAttnBackend.
ROUTED_TO = {
    "EXTEND": "prefill",
    "MIXED": "prefill",
    "SPLIT_PREFILL": "prefill",
    "PREBUILT": "prefill",
    "DLLM_EXTEND": "prefill",
    "DECODE": "decode",
    "IDLE": "decode",
    "TARGET_VERIFY": "speculative_attention_mode",
    "DRAFT_EXTEND_V2": "speculative_attention_mode",
    "DRAFT_EXTEND": "speculative_attention_mode",
}
_PHASE_OF_ROUTE = {
    "prefill": Phase.PREFILL,
    "decode": Phase.DECODE,
    "speculative_attention_mode": Phase.VERIFY,
}
SGLANG_MODES = {mode: _PHASE_OF_ROUTE[route] for mode, route in ROUTED_TO.items()}


def test_phase_values_index_tables() -> None:
    assert [int(p) for p in Phase] == [0, 1, 2]
    assert [p.name for p in Phase] == ["PREFILL", "DECODE", "VERIFY"]


@pytest.mark.parametrize(("mode", "phase"), sorted(SGLANG_MODES.items()))
def test_phase_of_sglang_names(mode: str, phase: Phase) -> None:
    assert phase_of(mode) is phase
    assert phase_of(mode.lower()) is phase
    assert phase_of(f"  {mode} ") is phase


def test_phase_of_enum_members_by_name() -> None:
    # SGLang passes its own ForwardMode enum; values differ from ours, names are what count.
    ForwardMode = enum.IntEnum("ForwardMode", list(SGLANG_MODES))
    for member in ForwardMode:
        assert phase_of(member) is SGLANG_MODES[member.name]


def test_phase_of_phase_is_identity() -> None:
    for p in Phase:
        assert phase_of(p) is p
        assert phase_of(p.name) is p


@pytest.mark.parametrize("bad", ["EXTENDED", "", "target-verify", "draft"])
def test_phase_of_unknown_name(bad: str) -> None:
    with pytest.raises(UnknownPhaseError) as info:
        phase_of(bad)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
    assert err.name == bad
    assert "TARGET_VERIFY" in err.known and "EXTEND" in err.known
    assert repr(bad) in str(err)
    assert "'TARGET_VERIFY'" in str(err)


@pytest.mark.parametrize("bad", [3, None, 1.5, object()])
def test_phase_of_non_string(bad: object) -> None:
    with pytest.raises(UnknownPhaseError) as info:
        phase_of(bad)
    assert info.value.name == repr(bad)
    assert repr(bad) in str(info.value)


def test_phase_parse() -> None:
    assert Phase.parse("decode") is Phase.DECODE
    assert Phase.parse(" Verify ") is Phase.VERIFY
    assert Phase.parse(Phase.PREFILL) is Phase.PREFILL
    with pytest.raises(UnknownPhaseError) as info:
        Phase.parse("extend")  # a forward mode, not a phase name
    assert info.value.known == ("prefill", "decode", "verify")
    assert "'extend'" in str(info.value)
