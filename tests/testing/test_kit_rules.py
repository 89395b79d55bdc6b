"""The kit compares what ran, not only the name it ran under; reports a phase that vanished
from one side whatever the counts allow; and refuses bad arguments with our errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UnknownPhaseError
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import register_backend
from attn_dispatch.testing import Ledger
from attn_dispatch.testing import assert_isolated
from attn_dispatch.testing import record_rows
from tests.strategies import ANY_CAPS
from tests.strategies import EchoBackend
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import register_echo

ROOT = Path(__file__).resolve().parents[2]


class OtherEcho(EchoBackend):
    """Another implementation, registered under a name a runner already uses."""


class ModeEcho(EchoBackend):
    """An implementation whose factory option changes its kernel path."""

    def __init__(self, config: Any, *, mode: str = "fast", **options: Any) -> None:
        super().__init__(config, **options)
        self.mode = mode


def _serve(binding: Any) -> None:
    for phase in (Phase.PREFILL, Phase.DECODE):
        with attn_scope(binding, FakeBatch(phase)):
            attention(None, None, sm_scale=1.0)


def _workloads(draft_rewrites: Any) -> tuple[Any, Any]:
    def alone() -> None:
        _serve(bind("fa3", mha_config(), label="target"))

    def together() -> None:
        # The draft's start-up replaces the registry entry "fa3" (same name, other kernel);
        # the target, started after it, binds what the entry now holds.
        draft_rewrites()
        _serve(bind("fa3", mha_config(num_q_heads=2), label="draft"))
        _serve(bind("fa3", mha_config(), label="target"))

    return alone, together


@pytest.fixture
def fa3(registry_snapshot: object) -> None:
    register_backend("fa3", capabilities=ANY_CAPS, factory=functools.partial(ModeEcho, name="fa3"))


def test_a_registry_entry_replaced_under_the_same_name_is_caught(fa3: None) -> None:
    def rewrite() -> None:
        register_backend(
            "fa3", capabilities=ANY_CAPS, factory=functools.partial(OtherEcho, name="fa3"),
            replace=True,
        )  # fmt: skip

    with pytest.raises(AssertionError) as e:
        assert_isolated("target", *_workloads(rewrite))
    text = str(e.value)
    assert "backend 'fa3' ran tests.testing.test_kit_rules.ModeEcho(mode='fast') alone" in text
    assert "but tests.testing.test_kit_rules.OtherEcho() together" in text
    assert "registry entry replaced under that name" in text


def test_other_kernel_options_under_the_same_name_are_caught(fa3: None) -> None:
    def rewrite() -> None:
        register_backend(
            "fa3", capabilities=ANY_CAPS,
            factory=functools.partial(ModeEcho, name="fa3", mode="slow"), replace=True,
        )  # fmt: skip

    with pytest.raises(AssertionError) as e:
        assert_isolated("target", *_workloads(rewrite))
    assert "ModeEcho(mode='fast') alone but tests.testing.test_kit_rules.ModeEcho(mode='slow')" in (
        str(e.value)
    )


def test_the_same_implementation_rebuilt_passes(fa3: None) -> None:
    # Fresh backend objects of the same class and options on both sides: isolated (object
    # counters and per-object state are not options).
    result = assert_isolated("target", *_workloads(lambda: None))
    (impl,) = {r.impl for r in result.rows("together")}
    assert impl == "tests.testing.test_kit_rules.ModeEcho(mode='fast')"
    assert result.rows("together")[0].to_dict()["impl"] == impl


def test_rows_of_built_in_backends_name_their_build_and_options() -> None:
    pytest.importorskip("torch")
    from attn_dispatch import AttnConfig
    from attn_dispatch.testing import DispatchRow  # noqa: F401  (the public row type)
    from attn_dispatch.testing._rows import implementation_of

    cfg = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=8)
    torch_impl = implementation_of(
        bind("torch", cfg, options={"torch": {"validate": True}}).backends["torch"]
    )
    assert torch_impl.endswith("TorchBackend(score_budget=16777216, validate=True)"), torch_impl


@pytest.mark.parametrize("allow", [5, 1.5, [5], {"decode": 1}, b"decode", object()])
def test_bad_allowances_are_our_errors(registry_snapshot: object, allow: Any) -> None:
    register_echo("ra")
    run = functools.partial(_serve, None)
    for name in ("allow_call_count_diff", "allow_one_side"):
        with pytest.raises(InvalidSpecError) as e:
            assert_isolated("target", run, run, **{name: allow})
        assert e.value.field == name


def test_bad_label_and_phase_names_are_our_errors() -> None:
    run = functools.partial(_serve, None)
    with pytest.raises(InvalidSpecError) as e:
        assert_isolated(5, run, run)  # type: ignore[arg-type]
    assert e.value.field == "label"
    with pytest.raises(UnknownPhaseError):
        assert_isolated("target", run, run, allow_one_side=["verfy"])


def test_assert_rows_refuses_bad_arguments(registry_snapshot: object) -> None:
    from attn_dispatch.testing.plugin import assert_rows

    register_echo("ra")
    with record_rows() as rec:
        _serve(bind("ra", mha_config(), label="target"))
    bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        ((rec, "target", 5), {}, "spec"),
        ((rec, "target", None), {}, "spec"),
        ((rec, 5, "ra"), {}, "label"),
        (("rows", "target", "ra"), {}, "recorder"),
        ((rec, "target", "ra"), {"phases": "decode"}, "phases"),
        ((rec, "target", "ra"), {"phases": 3}, "phases"),
    ]
    for args, kwargs, field in bad:
        with pytest.raises(InvalidSpecError) as e:
            assert_rows(*args, **kwargs)
        assert e.value.field == field, (args, kwargs)


LEDGER = Ledger("target", (("decode", None, "torch", None, "0123456789abcdef"),))


@pytest.mark.parametrize(
    "text,words",
    [
        ("not json", "is not JSON"),
        ("[1, 2]", "is JSON list"),
        ("null", "is JSON NoneType"),
        ('{"v": 1}', "lacks runner, entries"),
        ('{"v": 99, "runner": "t", "entries": []}', "format version 99"),
        ('{"v": 1, "runner": 5, "entries": []}', "string or null"),
        ('{"v": 1, "runner": "t", "entries": {}}', "list of entries"),
        ('{"v": 1, "runner": "t", "entries": [["decode", null, "torch"]]}', "must be [phase"),
        ('{"v": 1, "runner": "t", "entries": [[1, null, "torch", null, "x"]]}', "must be [phase"),
        ("[" * 100_000, "is not JSON"),
    ],
)
def test_ledger_from_malformed_text_is_our_error(text: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as e:
        Ledger.from_json(text)
    assert words in str(e.value), str(e.value)


def test_ledger_edited_by_hand_is_refused() -> None:
    data = json.loads(LEDGER.to_json())
    assert Ledger.from_json(LEDGER.to_json()) == LEDGER
    assert Ledger.from_json(LEDGER.to_json().encode()) == LEDGER
    data["entries"][0][2] = "native"
    with pytest.raises(InvalidSpecError, match="does not match its entries"):
        Ledger.from_json(json.dumps(data))
    data["entries"][0][0] = "decdoe"
    del data["fingerprint"]
    with pytest.raises(UnknownPhaseError):
        Ledger.from_json(json.dumps(data))
    with pytest.raises(InvalidSpecError):
        Ledger.from_json(5)  # type: ignore[arg-type]


MARKER_TESTS = """
import pytest

@pytest.mark.attn_dispatch_expect("target")
def test_marker_without_a_spec():
    pass

@pytest.mark.attn_dispatch_expect("target", 5)
def test_marker_with_a_spec_that_is_not_one():
    pass

@pytest.mark.attn_dispatch_expect("target", "torch", phase=["decode"])
def test_marker_with_an_unknown_keyword():
    pass
"""


def test_a_malformed_marker_says_how_to_write_it(tmp_path: Path) -> None:
    (tmp_path / "test_markers.py").write_text(textwrap.dedent(MARKER_TESTS))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "attn_dispatch.testing.plugin", "-q",
            "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_markers.py"),
        ],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert "3 failed" in text, text
    assert text.count("InvalidSpecError") >= 3 and "TypeError" not in text, text
    assert "it needs a runner label and a spec" in text
    assert "unknown keyword(s) phase" in text
    assert 'write @pytest.mark.attn_dispatch_expect("target", "prefill=torch,decode=native"' in text
