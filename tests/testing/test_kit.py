"""attn_dispatch.testing itself: rows, ledgers and fingerprints, imports, the pytest plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch
from attn_dispatch.testing import Ledger
from attn_dispatch.testing import config_fingerprint
from attn_dispatch.testing import record_rows
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import register_echo

ROOT = Path(__file__).resolve().parents[2]

# Makes two runners' calls and prints the target's ledger as JSON: run in fresh processes.
LEDGER_SCRIPT = """
from attn_dispatch import attention, attn_scope, bind, Phase
from attn_dispatch.testing import record_rows
from tests.strategies import FakeBatch, mha_config, register_echo

register_echo("ra"); register_echo("rb")
target = bind("prefill=ra,decode=rb", mha_config(page_size=16), label="target")
draft = bind("rb", mha_config(num_q_heads=2), label="draft")
with record_rows() as rec:
    for phase in {phases}:
        for b in (draft, target):
            with attn_scope(b, FakeBatch(phase)):
                attention(None, None, sm_scale=1.0)
print(rec.ledger("target").to_json())
"""


def _ledger_in_child(phases: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "random", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", LEDGER_SCRIPT.format(phases=phases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_ledger_fingerprint_is_stable_across_processes() -> None:
    # Two processes (different hash seeds), calls in different orders and numbers: the same
    # choices give the same bytes and fingerprint, which is what a CI diff stores.
    a = _ledger_in_child("[Phase.PREFILL, Phase.DECODE, Phase.DECODE]")
    b = _ledger_in_child("[Phase.DECODE, Phase.PREFILL]")
    assert a == b
    ledger = Ledger.from_json(a)
    assert json.loads(a)["fingerprint"] == ledger.fingerprint
    assert [e[:3] for e in ledger.entries] == [("decode", None, "rb"), ("prefill", None, "ra")]
    # A different choice is a different fingerprint, and the diff says which entry moved.
    c = Ledger.from_json(_ledger_in_child("[Phase.PREFILL]"))
    assert c.fingerprint != ledger.fingerprint
    assert ledger.diff(c) == [f"- decode: backend 'rb', form -, config {ledger.entries[0][4]}"]


def test_config_fingerprint_sees_every_field() -> None:
    base = mha_config()
    seen = {config_fingerprint(base)}
    for change in ({"page_size": 16}, {"window_left": 7}, {"sm_scale": 0.125}, {"dtype": "bf16"}):
        fp = config_fingerprint(base.replace(**change))
        assert fp not in seen, change
        seen.add(fp)
    assert config_fingerprint(mha_config()) == config_fingerprint(base)


def test_rows_aggregate_per_runner_phase_group_and_config(registry_snapshot: object) -> None:
    from attn_dispatch.backend import Capabilities

    register_echo("ra", Capabilities(kinds={"mha"}, devices={"cpu"}, variants={"window"}))
    grouped = bind("ra", {"sliding": mha_config(window_left=3), "full": mha_config()}, label="g")
    with record_rows() as rec, record_dispatch() as plain:
        with attn_scope(grouped, FakeBatch(Phase.DECODE)):
            for _ in range(3):
                attention(None, None, sm_scale=1.0, group="sliding")
            attention(None, None, sm_scale=1.0, group="full")
    rows = rec.rows_of("g")
    assert [(r.group, r.calls) for r in rows] == [("full", 1), ("sliding", 3)]
    assert rows[0].config != rows[1].config  # each group's own config
    assert len(plain.events) == 4  # an event recorder open at the same time still gets events
    assert rec.runners() == ["g"]


def test_tally_recording_counts_carried_threads(registry_snapshot: object) -> None:
    import threading

    from attn_dispatch import carry_scope

    register_echo("ra")
    b = bind("ra", mha_config(), label="t")
    with record_rows() as rec, attn_scope(b, FakeBatch(Phase.DECODE)):

        def work() -> None:
            for _ in range(2000):
                attention(None, None, sm_scale=1.0)

        threads = [threading.Thread(target=carry_scope(work)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    (row,) = rec.rows_of("t")
    assert row.calls == 8000  # no call lost between threads


def test_importing_the_kit_imports_neither_torch_nor_hypothesis() -> None:
    code = (
        "import sys, attn_dispatch, attn_dispatch.testing\n"
        "bad = [m for m in ('torch', 'hypothesis') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_pyproject_declares_the_extra_and_the_plugin() -> None:
    tomllib = pytest.importorskip("tomllib", reason="the standard TOML reader is Python 3.11+")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    assert any(d.startswith("hypothesis") for d in project["optional-dependencies"]["testing"])
    assert project["entry-points"]["pytest11"] == {"attn_dispatch": "attn_dispatch.testing.plugin"}


PLUGIN_TESTS = """
import pytest
from attn_dispatch import Phase, attention, attn_scope, bind
from attn_dispatch.testing.plugin import assert_rows
from tests.strategies import FakeBatch, RegistrySnapshot, mha_config, register_echo

@pytest.fixture(autouse=True)
def backends():
    snap = RegistrySnapshot()
    register_echo("ra"); register_echo("rb")
    yield
    snap.restore()

def run(spec):
    b = bind(spec, mha_config(), label="target")
    for phase in (Phase.PREFILL, Phase.DECODE):
        with attn_scope(b, FakeBatch(phase)):
            attention(None, None, sm_scale=1.0)

def test_fixture(attn_dispatch_rows):
    run("prefill=ra,decode=rb")
    assert_rows(attn_dispatch_rows, "target", "prefill=ra,decode=rb", phases=["prefill", "decode"])

@pytest.mark.attn_dispatch_expect("target", "prefill=ra,decode=rb")
def test_marker_passes():
    run("prefill=ra,decode=rb")

@pytest.mark.attn_dispatch_expect("target", "prefill=ra,decode=rb")
def test_marker_fails():
    run("ra")

def test_unused_plugin_records_nothing():
    from attn_dispatch import _scope
    assert _scope._call_hook is None
"""


def test_pytest_plugin_fixture_and_marker(tmp_path: Path) -> None:
    (tmp_path / "test_plugin_use.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    # Autoloading off: the plugin is loaded by name here, whether or not the package's
    # entry point is installed in this environment.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "attn_dispatch.testing.plugin",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_plugin_use.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert "1 failed, 3 passed" in text, text
    assert "runner 'target' did not dispatch as its spec (prefill=ra,decode=rb) says" in text
    assert "decode: ran backend 'ra', the spec names 'rb'" in text


@pytest.mark.parametrize("bad", ["verify", "targte"])
def test_assert_rows_refuses(registry_snapshot: object, bad: str) -> None:
    from attn_dispatch.testing.plugin import assert_rows

    register_echo("ra")
    b = bind("ra", mha_config(), label="target")
    with record_rows() as rec, attn_scope(b, FakeBatch(Phase.DECODE)):
        attention(None, None, sm_scale=1.0)
    label, phases = ("target", ["verify"]) if bad == "verify" else ("targte", None)
    with pytest.raises(AssertionError, match="did not dispatch as its spec"):
        assert_rows(rec, label, "ra", phases=phases)


def test_public_names_report_their_public_module() -> None:
    import pickle

    import attn_dispatch.testing as kit

    for name in kit.__all__:
        assert getattr(kit, name).__module__ == "attn_dispatch.testing", name
    ledger = Ledger("target", (("decode", None, "torch", None, "0123456789abcdef"),))
    assert pickle.loads(pickle.dumps(ledger)) == ledger
