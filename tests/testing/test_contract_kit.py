"""The contract kit (``attn_dispatch.testing.contract``) as a plugin's CI runs it: ``pytest
--pyargs attn_dispatch.testing.contract --attn-backend NAME`` in a fresh process, against the
example package of examples/gather_backend found only through its entry point, and against
broken copies of it, which must fail naming the case."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gather_backend" / "src" / "attn_gather"


def _install(tmp: Path, package: str, name: str, edits: dict[str, tuple[str, str]]) -> Path:
    """The example as package ``package`` registering backend ``name``, on a path of its own
    with a ``.dist-info`` whose ``entry_points.txt`` declares it (what pip writes); ``edits``:
    file -> (text, replacement), each of which must match."""
    site = tmp / "site"
    shutil.copytree(EXAMPLE, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (site / package).glob("*.py"):
        text = path.read_text(encoding="utf-8").replace("attn_gather.", f"{package}.")
        text = text.replace('NAME = "gather"', f"NAME = {name!r}")
        if path.name in edits:
            old, new = edits[path.name]
            assert old in text, (path.name, old)
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")
    info = site / f"{package}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        f"[attn_dispatch.backends]\n{name} = {package}.plugin:register\n", encoding="utf-8"
    )
    return site


def _kit(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)]),
        "TRITON_INTERPRET": "1",
    }
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attn_dispatch.testing.contract"]
    return subprocess.run(
        [*cmd, "-p", "no:cacheprovider", "-q", "-rfEs", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=site,  # not the repository: its conftest and ini play no part
        timeout=600,
    )


def test_the_example_passes_and_skips_what_it_does_not_declare(tmp_path: Path) -> None:
    site = _install(tmp_path, "attn_gather_copy", "gather_copy", {})
    chosen = "edge or input or unused or chain or (test_out and (mha or empty or v_cache))"
    run = _kit(site, "--attn-backend", "gather_copy", "-k", chosen)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"\d+ passed", out), out
    # What the example does not declare skips, naming the capability.
    assert "does not declare kind 'mla' (Capabilities.kinds=['mha'])" in out, out
    assert "layer variant 'window'" in out and "is not implemented" in out, out
    # It declares out_buffer: its handler's own checks of out ran (none skipped).
    assert "out_buffer" not in out, out


UNDECLARED = ("plugin.py", ("    out_buffer=True,", ""))
IGNORES_OUT = ("backend.py", ("if out is None:", "if True:"))


def test_the_kit_checks_out_declared_or_not(tmp_path: Path) -> None:
    """A copy of the example that does not declare out_buffer: the core's copy into out
    passes, the handler's own checks skip naming the capability. A copy that declares it and
    ignores out fails. (The example itself, which declares it, is run in the test above.)"""
    site = _install(tmp_path / "a", "attn_gather_plain", "plain", dict([UNDECLARED]))
    run = _kit(site, "--attn-backend", "plain", "-k", "test_out and (mha or empty or v_cache)")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"\b[1-9]\d* passed", out), out
    assert "'plain' does not declare Capabilities(out_buffer=True)" in out, out
    site = _install(tmp_path / "b", "attn_gather_liar", "liar", dict([IGNORES_OUT]))
    run = _kit(site, "--attn-backend", "liar", "-k", "test_out_gives and mha and decode")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert re.search(r"FAILED \S+::test_out_gives_the_same_result\[\S*decode", out), out
    assert "backend bug" in out, out


SCALE = ("backend.py", ("scale=sm_scale,", "scale=sm_scale * 1.25,"))
NO_CAUSAL = (
    "backend.py",
    ("attn_mask=r.visible,", "attn_mask=torch.ones_like(r.visible),"),
)


@pytest.mark.parametrize("edit", [SCALE, NO_CAUSAL], ids=["wrong-scale", "ignores-causal"])
def test_a_broken_copy_fails_naming_the_case(
    tmp_path: Path, edit: tuple[str, tuple[str, str]]
) -> None:
    site = _install(tmp_path, "attn_gather_broken", "broken", dict([edit]))
    run = _kit(site, "--attn-backend", "broken", "-k", "test_edge_cases")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    failed = re.findall(r"FAILED \S+::test_edge_cases\[(?:broken-)?([a-z-]+?)(?:-broken)?\]", out)
    # The multi-token cases: decode sees every key of its request, so a causal bug hides there.
    assert {"one-full-page-prefill", "partial-last-page"} <= set(failed), out
    assert "backend 'broken' on KernelCase(kind='mha', phase=<Phase.PREFILL" in out, out
    assert "out differs from the float64 oracle" in out, out
    assert "Mismatched elements" in out, out


def test_run_reports_from_python(tmp_path: Path) -> None:
    site = _install(tmp_path, "attn_gather_broken", "broken", dict([SCALE]))
    script = (
        "from attn_dispatch.testing.contract import run\n"
        "r = run('broken', ['-k', 'test_edge_cases and prefill'])\n"
        "print(r)\n"
        "assert not r.ok and r.failed and 'out differs' in r.failed[0][1]\n"
        "r = run('torch', ['-k', 'test_edge_cases and prefill'])\n"
        "print(r)\n"
        "assert r.ok and len(r.passed) == 1, r\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=site,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "contract kit on backend 'broken': 0 passed, 1 failed" in run.stdout, run.stdout
    failed = r"FAILED \S*test_contract.py::test_edge_cases\[\S*broken"
    assert re.search(failed, run.stdout), run.stdout
    assert "warning" not in run.stdout, run.stdout


def test_without_a_backend_every_test_skips_saying_how(tmp_path: Path) -> None:
    run = _kit(tmp_path, "-k", "test_edge_cases")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "no backend to check: run pytest --pyargs attn_dispatch.testing.contract" in out, out
    assert " passed" not in out, out
