"""attn_dispatch.integrations.sglang: SGLang-shaped entry points over the core mapping."""

from __future__ import annotations

import enum
import types

import pytest

from attn_dispatch import Phase
from attn_dispatch import UnknownPhaseError
from attn_dispatch.integrations.sglang import forward_phase
from attn_dispatch.integrations.sglang import spec_from_server_args


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
