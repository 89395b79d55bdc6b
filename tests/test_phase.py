"""Phase and phase_of: SGLang forward-mode names map to the three phases; unknown names raise."""

from __future__ import annotations

import enum

import pytest

from attn_dispatch import AttnDispatchError
from attn_dispatch import Phase
from attn_dispatch import UnknownPhaseError
from attn_dispatch import phase_of

SGLANG_MODES = {
    "EXTEND": Phase.PREFILL,
    "MIXED": Phase.PREFILL,
    "SPLIT_PREFILL": Phase.PREFILL,
    "PREBUILT": Phase.PREFILL,
    "DLLM_EXTEND": Phase.PREFILL,
    "DRAFT_EXTEND": Phase.PREFILL,
    "DECODE": Phase.DECODE,
    "IDLE": Phase.DECODE,
    "TARGET_VERIFY": Phase.VERIFY,
    "DRAFT_EXTEND_V2": Phase.VERIFY,
}


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
