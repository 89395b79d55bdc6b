"""The kit catches the leak family in a small framework (tests/testing/minifw.py), and passes
the same framework once each runner owns what it dispatches with.

Each test runs the buggy framework (the kit must fail it, with a message that names the
runner, the rows and what differs) and the fixed one (the kit must pass it). Run with
``-s`` and ``KIT_PRINT=1`` to see the messages (docs/testing.md shows them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from attn_dispatch import Phase
from attn_dispatch.testing import assert_isolated
from tests.testing import minifw as fw
from tests.testing.minifw import Process


@pytest.fixture(autouse=True)
def _backends(registry_snapshot: object) -> None:
    fw.register_backends()


def _fails(label: str, alone: Callable[[], Any], together: Callable[[], Any], **kw: Any) -> str:
    with pytest.raises(AssertionError) as err:
        assert_isolated(label, alone, together, **kw)
    text = str(err.value)
    if os.environ.get("KIT_PRINT"):
        print(f"\n----- {label}\n{text}")
    assert text.startswith(f"runner {label!r} ")
    return text


# -- SGLang 28528 ----------------------------------------------------------------------------


def _alone_28528(fixed: bool) -> Callable[[], None]:
    def run() -> None:
        p = Process()
        fw.serve([fw.target_28528(p, fixed)])

    return run


def _together_28528(fixed: bool, draft_first: bool) -> Callable[[], None]:
    def run() -> None:
        p = Process()
        if draft_first:
            draft = fw.draft_28528(p, fixed)
            target = fw.target_28528(p, fixed)
        else:
            target = fw.target_28528(p, fixed)  # the server starts the target, then its draft
            draft = fw.draft_28528(p, fixed)
        fw.serve([draft, target])

    return run


def test_sglang_28528_replay_is_caught() -> None:
    text = _fails("target", _alone_28528(False), _together_28528(False, draft_first=False))
    # The engineer reads: which runner, which phase, which kernel on each side, who else ran.
    assert "first difference, alone:    prefill: backend 'fa3'" in text
    assert "first difference, together: prefill: backend 'flashinfer'" in text
    assert "other runners alive together: 'draft'" in text
    assert "should own its BackendSpec" in text  # the likely cause
    assert "decode: backend 'fa3' alone but 'flashinfer' together" in text


@pytest.mark.parametrize("draft_first", [False, True], ids=["target_first", "draft_first"])
def test_sglang_28528_runner_owning_its_spec_passes(draft_first: bool) -> None:
    result = assert_isolated(
        "target", _alone_28528(True), _together_28528(True, draft_first=draft_first)
    )
    assert result.others == ("draft",)
    assert {(r.phase, r.backend) for r in result.rows()} == {("prefill", "fa3"), ("decode", "fa3")}
    # The draft ran its own backend meanwhile: isolation, not absence.
    assert {r.backend for r in result.together if r.runner == "draft"} == {"flashinfer"}


# -- shared mutable config -------------------------------------------------------------------


def _args_workloads(copy: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    def alone() -> None:
        fw.serve([fw.ArgsRunner("target", fw.ServerArgs(), fw.TARGET_CONFIG)])

    def together() -> None:
        args = fw.ServerArgs()
        target = fw.ArgsRunner("target", args, fw.TARGET_CONFIG)
        draft = fw.AdjustingDraftWorker(args, copy=copy)
        fw.serve([draft, target])

    return alone, together


def test_shared_mutable_args_adjusted_by_the_draft_are_caught() -> None:
    text = _fails("target", *_args_workloads(copy=False))
    # The backend and the config both moved; the config's changed fields are named.
    assert "backend 'fa3' alone but 'flashinfer' together" in text
    assert "(page_size: 64 -> 1)" in text


def test_draft_adjusting_its_own_copy_passes() -> None:
    assert_isolated("target", *_args_workloads(copy=True))


# -- metadata of one runner reused by another --------------------------------------------------


def _metadata_workloads(reuse: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    def alone() -> None:
        p = Process()
        fw.serve([fw.MetadataRunner(p, "target", "fa3", fw.TARGET_CONFIG, reuse=False)])

    def together() -> None:
        p = Process()
        target = fw.MetadataRunner(p, "target", "fa3", fw.TARGET_CONFIG, reuse=False)
        draft = fw.MetadataRunner(p, "draft", "flashinfer", fw.DRAFT_CONFIG, reuse=reuse)
        fw.serve([draft, target])

    return alone, together


def test_metadata_reused_by_the_draft_is_caught() -> None:
    text = _fails("target", *_metadata_workloads(reuse=True))
    # The draft's layers ran under the target's metadata: more target calls, same kernel.
    assert "the same dispatch, but 4 calls alone and 5 together" in text
    assert "layers may have run under this runner's scope" in text


def test_draft_building_its_own_metadata_passes() -> None:
    result = assert_isolated("target", *_metadata_workloads(reuse=False))
    assert {r.phase for r in result.together if r.runner == "draft"} == {"prefill", "decode"}


# -- a lazily created runner reading a global --------------------------------------------------


def _overlap_workloads(inherit: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    def alone() -> None:
        fw.serve([fw.OverlapRunner(Process(), inherit=inherit)])

    def together() -> None:
        p = Process()
        target = fw.OverlapRunner(p, inherit=inherit)
        draft = fw.AutoDraftWorker(p)  # resolves "auto" for its MHA config: triton
        fw.serve([draft, target])

    return alone, together


def test_lazily_created_children_reading_a_global_are_caught() -> None:
    text = _fails("target", *_overlap_workloads(inherit=False))
    # Only the children (prefill halves) moved; the target's own decode rows did not.
    assert "prefill: backend 'fa3' alone but 'triton' together" in text
    assert "decode" not in text.split("what differs:")[1].split("other runners")[0]


def test_children_inheriting_their_parents_spec_pass() -> None:
    assert_isolated("target", *_overlap_workloads(inherit=True))


# -- a per-layer setting copied from the target into the draft --------------------------------


def _layer_workloads(
    from_context: bool, target_first: bool = True
) -> tuple[Callable[[], None], Callable[[], None]]:
    def alone() -> None:
        fw.serve([fw.LayerSettingsDraft(Process(), from_context=from_context)])

    def together() -> None:
        p = Process()
        if target_first:
            target = fw.WindowedTarget(p)
            draft = fw.LayerSettingsDraft(p, from_context=from_context)
        else:
            draft = fw.LayerSettingsDraft(p, from_context=from_context)
            target = fw.WindowedTarget(p)
        fw.serve([draft, target])

    return alone, together


def test_target_layer_settings_copied_into_the_draft_are_caught() -> None:
    text = _fails("draft", *_layer_workloads(from_context=True))
    assert "window_left: None -> 4095" in text and "logit_cap: None -> 50.0" in text
    assert "other runners alive together: 'target'" in text


def test_layer_settings_leak_depends_on_start_up_order() -> None:
    # The same bug passes when the draft happens to start first: why both orders are tested.
    assert_isolated("draft", *_layer_workloads(from_context=True, target_first=False))


@pytest.mark.parametrize("target_first", [True, False])
def test_draft_reading_its_own_model_passes(target_first: bool) -> None:
    assert_isolated("draft", *_layer_workloads(from_context=False, target_first=target_first))


# -- the kit's own rules -----------------------------------------------------------------------


def test_call_counts_may_differ_only_where_allowed() -> None:
    def alone() -> None:
        fw.serve([fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)], steps=2)

    def together() -> None:
        target = fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)
        draft = fw.OwnedSpecRunner("draft", "flashinfer", fw.DRAFT_CONFIG)
        fw.serve([draft, target], steps=5)

    text = _fails("target", alone, together)
    assert "8 calls alone and 20 together" in text and "allow_call_count_diff='decode'" in text
    assert_isolated("target", alone, together, allow_call_count_diff=["decode"])
    assert_isolated("target", alone, together, allow_call_count_diff=True)


def test_a_phase_run_on_one_side_only_needs_permission() -> None:
    def alone() -> None:
        fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG).step(Phase.PREFILL)

    def together() -> None:
        t = fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)
        t.step(Phase.PREFILL)
        t.step(Phase.VERIFY)

    text = _fails("target", alone, together)
    assert "verify ran only together" in text and "allow_one_side='verify'" in text
    assert_isolated("target", alone, together, allow_one_side="verify")
    # Counts allowed to differ are no permission for calls that vanished from one side.
    text = _fails("target", alone, together, allow_call_count_diff="verify")
    assert "verify ran only together (4 calls; none alone)" in text
    text = _fails("target", together, alone, allow_call_count_diff=True)
    assert "verify ran only alone" in text


def test_expect_checks_every_row_against_the_spec() -> None:
    def run() -> None:
        fw.serve([fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)])

    assert_isolated("target", run, run, expect="fa3")
    text = _fails("target", run, run, expect="prefill=fa3,decode=flashinfer")
    assert "decode ran backend 'fa3', but the spec expected for runner 'target'" in text
    assert "first difference, together: decode: backend 'fa3'" in text


def test_a_runner_that_never_dispatched_fails() -> None:
    def run() -> None:
        fw.serve([fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)])

    text = _fails("targte", run, run)
    assert text.startswith("runner 'targte' cannot be checked for isolation")
    assert "made no attention calls in the 'alone' workload (runners that did: 'target')" in text


def test_bad_arguments_raise_our_errors() -> None:
    from attn_dispatch import InvalidSpecError
    from attn_dispatch import UnknownPhaseError

    def run() -> None:
        fw.serve([fw.OwnedSpecRunner("target", "fa3", fw.TARGET_CONFIG)])

    with pytest.raises(InvalidSpecError, match="function of no arguments"):
        assert_isolated("target", run, None)  # type: ignore[arg-type]
    with pytest.raises(UnknownPhaseError):
        assert_isolated("target", run, run, allow_call_count_diff=["verfy"])
    with pytest.raises(InvalidSpecError):
        assert_isolated("target", run, run, expect="prefill=fa3,decdoe=fa3")
