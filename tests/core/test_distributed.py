"""Tensor parallel over torch.distributed (gloo, 127.0.0.1): examples/distributed_tp.py.

Two ranks each bind their runners for half of the heads from a pickled BackendSpec broadcast
by rank 0, know the plugin backend only through the entry-point group, and all-gather their
outputs; rank 0 compares with one process that runs every head.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distributed_tp.py"

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="this torch build has no torch.distributed gloo backend",
)


def run_example(*args: str) -> tuple[int, dict[str, object] | None, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--timeout", "50", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return proc.returncode, result, proc.stdout + proc.stderr


def test_two_gloo_ranks_gather_the_single_process_result() -> None:
    code, result, log = run_example("--world-size", "2")
    assert code == 0, log
    assert result is not None, log
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    runners = result["runners"]
    assert isinstance(runners, dict)
    assert set(runners) == {"target/prefill", "target/decode", "draft/prefill", "draft/decode"}
    for key, row in runners.items():
        assert row["equal"] and row["matches_reference"], (key, row)
        assert row["shape"][1:] == [8, 16], (key, row)  # all heads, gathered
    assert runners["target/prefill"]["backend"] == "torch"
    assert runners["target/decode"]["backend"] == "tpdemo"
    ranks = result["ranks"]
    assert isinstance(ranks, list) and [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        # Registered only through the entry point: nothing in the rank code registers it.
        assert "tpdemo" in r["registered"]
        n = r["rank"]
        assert r["calls"] == sorted(
            [
                f"draft@rank{n}:decode:tpdemo=1",
                f"draft@rank{n}:prefill:tpdemo=1",
                f"target@rank{n}:decode:tpdemo=1",
                f"target@rank{n}:prefill:torch=1",
            ]
        )


def test_the_demo_plugin_is_found_through_the_entry_point_group() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import distributed_tp  # type: ignore[import-not-found]

        before = list(sys.path)
        root = distributed_tp.install_demo_plugin()
        try:
            eps = importlib.metadata.entry_points(group="attn_dispatch.backends")
            (ep,) = [e for e in eps if e.name == "tpdemo"]
            assert ep.value == "tp_plugin_backend:register"
            assert ep.dist is not None and ep.dist.metadata["Name"] == "attn-tpdemo-plugin"
            assert callable(ep.load())
        finally:
            sys.path[:] = [p for p in sys.path if p != str(root)]
            assert sys.path == before
            shutil.rmtree(root)
            sys.modules.pop("tp_plugin_backend", None)
            importlib.invalidate_caches()
    finally:
        sys.path.remove(str(ROOT / "examples"))
        sys.modules.pop("distributed_tp", None)
