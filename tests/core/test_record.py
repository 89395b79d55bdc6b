"""record_dispatch: (label, phase, backend) per attention call, per context, nestable."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from attn_dispatch import Binding
from attn_dispatch import DispatchEvent
from attn_dispatch import Phase
from attn_dispatch import ScopeError
from attn_dispatch import _record
from attn_dispatch import _scope
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import carry_scope
from attn_dispatch import record_dispatch
from attn_dispatch import resolve
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import register_echo


@pytest.fixture
def pair(registry_snapshot: object) -> tuple[Binding, Binding]:
    register_echo("ra")
    register_echo("rb")
    target = bind("prefill=ra,decode=rb,verify=ra", mha_config(), label="target")
    draft = bind("rb", mha_config(), label="draft")
    return target, draft


def _recording_is_off() -> bool:
    # The process-wide count is back to zero and the hot path's hook is gone.
    return _record._open == 0 and _scope._call_hook is None


def forward(binding: Binding, phase: Phase, layers: int = 2) -> None:
    with attn_scope(binding, FakeBatch(phase)):
        for _ in range(layers):
            attention(None, None, sm_scale=1.0)


def test_records_label_phase_backend(pair: tuple[Binding, Binding]) -> None:
    target, draft = pair
    with record_dispatch() as rec:
        forward(target, Phase.PREFILL)
        forward(draft, Phase.DECODE, layers=3)
        forward(target, Phase.VERIFY, layers=1)
        forward(target, Phase.DECODE, layers=1)
    assert rec.events == [
        DispatchEvent("target", Phase.PREFILL, "ra"),
        DispatchEvent("target", Phase.PREFILL, "ra"),
        DispatchEvent("draft", Phase.DECODE, "rb"),
        DispatchEvent("draft", Phase.DECODE, "rb"),
        DispatchEvent("draft", Phase.DECODE, "rb"),
        DispatchEvent("target", Phase.VERIFY, "ra"),
        DispatchEvent("target", Phase.DECODE, "rb"),
    ]
    assert rec.counts() == Counter(
        {
            ("target", "prefill", "ra"): 2,
            ("draft", "decode", "rb"): 3,
            ("target", "verify", "ra"): 1,
            ("target", "decode", "rb"): 1,
        }
    )
    table = rec.summary().splitlines()
    assert table[0].split() == ["runner", "phase", "backend", "form", "calls"]
    assert ["draft", "decode", "rb", "-", "3"] in [line.split() for line in table[2:]]
    assert len(table) == 2 + 4


def test_resolve_is_not_recorded(pair: tuple[Binding, Binding]) -> None:
    target, _ = pair
    with record_dispatch() as rec, attn_scope(target):
        resolve(Phase.DECODE)(None, None, None, None, 1.0)
    assert rec.events == []


def test_nested_recorders(pair: tuple[Binding, Binding]) -> None:
    target, draft = pair
    with record_dispatch() as outer:
        forward(target, Phase.PREFILL, layers=1)
        with record_dispatch() as inner:
            forward(draft, Phase.DECODE, layers=1)
        forward(target, Phase.DECODE, layers=1)
    assert [e.label for e in outer.events] == ["target", "draft", "target"]
    assert inner.events == [DispatchEvent("draft", Phase.DECODE, "rb")]


def test_nothing_recorded_when_not_active(pair: tuple[Binding, Binding]) -> None:
    target, _ = pair
    rec_cm = record_dispatch()
    forward(target, Phase.PREFILL)
    with rec_cm as rec:
        pass
    forward(target, Phase.PREFILL)
    assert rec.events == []
    assert _recording_is_off()


def test_per_context_isolation(pair: tuple[Binding, Binding]) -> None:
    target, draft = pair
    # A recorder in one thread sees nothing of another thread's calls.
    with record_dispatch() as mine:
        other_events: list[list[DispatchEvent]] = []

        def other_thread() -> None:
            with record_dispatch() as rec:
                forward(draft, Phase.DECODE, layers=4)
            other_events.append(rec.events)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        forward(target, Phase.PREFILL, layers=1)
        # A carried context records into the same recorder.
        carry_scope(forward)(target, Phase.VERIFY, 1)
        t = threading.Thread(target=carry_scope(forward), args=(draft, Phase.DECODE, 1))
        t.start()
        t.join()
    assert [(e.label, e.phase) for e in mine.events] == [
        ("target", Phase.PREFILL),
        ("target", Phase.VERIFY),
        ("draft", Phase.DECODE),
    ]
    assert other_events == [[DispatchEvent("draft", Phase.DECODE, "rb")] * 4]


def test_asyncio_tasks_record_their_own(pair: tuple[Binding, Binding]) -> None:
    target, draft = pair

    async def task(binding: Binding, n: int) -> list[DispatchEvent]:
        with record_dispatch() as rec:
            for _ in range(n):
                with attn_scope(binding, FakeBatch(Phase.DECODE)):
                    await asyncio.sleep(0)
                    attention(None, None, sm_scale=1.0)
        return rec.events

    async def main() -> list[list[DispatchEvent]]:
        return await asyncio.gather(task(target, 3), task(draft, 5))

    t_events, d_events = asyncio.run(main())
    assert t_events == [DispatchEvent("target", Phase.DECODE, "rb")] * 3
    assert d_events == [DispatchEvent("draft", Phase.DECODE, "rb")] * 5


def test_recorder_misuse(pair: tuple[Binding, Binding]) -> None:
    cm = record_dispatch()
    with cm:
        with pytest.raises(ScopeError, match="already active"):
            cm.__enter__()
    with pytest.raises(ScopeError, match="without being entered"):
        cm.__exit__(None, None, None)
    assert _recording_is_off()


def test_recorder_closed_after_exception(pair: tuple[Binding, Binding]) -> None:
    target, _ = pair
    with pytest.raises(KeyboardInterrupt):
        with record_dispatch() as rec:
            forward(target, Phase.DECODE, layers=1)
            raise KeyboardInterrupt
    assert rec.events == [DispatchEvent("target", Phase.DECODE, "rb")]
    assert _recording_is_off()
    assert _record._RECORDERS.get() == ()


def test_exit_in_another_context_is_a_scope_error(pair: tuple[Binding, Binding]) -> None:
    target, _ = pair
    cm = record_dispatch()
    rec = cm.__enter__()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            cm.__exit__(None, None, None)
        except BaseException as exc:
            errors.append(exc)

    for target_fn in (close, carry_scope(close)):
        t = threading.Thread(target=target_fn)
        t.start()
        t.join()
    assert len(errors) == 2
    assert all(type(e) is ScopeError for e in errors), errors  # not a raw ValueError
    assert all("another thread or task" in str(e) for e in errors)
    assert _record._open == 1  # the count is untouched: the recorder is still open here
    forward(target, Phase.DECODE, layers=1)
    assert len(rec.events) == 1
    cm.__exit__(None, None, None)  # its own context can still close it
    assert _recording_is_off()
    assert _record._RECORDERS.get() == ()


def test_out_of_order_exit_keeps_the_count_and_the_list_right(
    pair: tuple[Binding, Binding],
) -> None:
    target, _ = pair
    outer, inner = record_dispatch(), record_dispatch()
    r_out = outer.__enter__()
    r_in = inner.__enter__()
    outer.__exit__(None, None, None)  # out of order
    assert _record._RECORDERS.get() == (r_in,)
    forward(target, Phase.PREFILL, layers=1)
    inner.__exit__(None, None, None)
    assert _record._RECORDERS.get() == ()  # the closed outer recorder does not come back
    assert _recording_is_off()
    assert len(r_in.events) == 1 and r_out.events == []


def test_profile_labels_torch_profiler_ranges(pair: tuple[Binding, Binding]) -> None:
    pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    target, draft = pair
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_dispatch(profile=True):
            forward(target, Phase.PREFILL, layers=2)
            forward(draft, Phase.DECODE, layers=1)
        with record_dispatch():  # profile=False: no ranges
            forward(target, Phase.VERIFY, layers=1)
        forward(target, Phase.DECODE, layers=1)  # no recorder: no ranges
    names = Counter(e.name for e in prof.events() if e.name.startswith("attn_dispatch/"))
    assert names == {
        "attn_dispatch/target/prefill/ra": 2,
        "attn_dispatch/draft/decode/rb": 1,
    }


def test_profile_range_names_include_the_form() -> None:
    e = DispatchEvent("target", Phase.PREFILL, "torch", form="mha_chunked")
    assert e.range_name() == "attn_dispatch/target/prefill/torch/mha_chunked"
    assert DispatchEvent(None, Phase.DECODE, "x").range_name() == "attn_dispatch/None/decode/x"
