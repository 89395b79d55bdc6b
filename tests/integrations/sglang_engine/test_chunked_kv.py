"""SGLang's chunked-KV prefill of DeepSeek-style MLA layers (``MHA_CHUNKED_KV``) served by the
attn_dispatch backend, without an engine (``chunked_kv_check.py`` in a child process, as the
engine tests run SGLang: the test-only shims on its PYTHONPATH). The engine run with a prefix
split into chunks is ``test_engine.py``'s ``mla_chunked_kv``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attn_dispatch import InvalidSpecError
from attn_dispatch.backend import FormPolicy
from attn_dispatch.integrations.sglang_engine import ENV_VAR
from attn_dispatch.integrations.sglang_engine import Settings

from .test_engine import ROOT
from .test_engine import needs_sglang

HERE = Path(__file__).resolve().parent
CHUNKED = {"short_prefix_max": 0}  # mha_chunked for every prefill with a cached prefix


def test_form_policy_from_json() -> None:
    raw = {"target": "sdpa", "options": {"sdpa": {"form_policy": CHUNKED}}}
    s = Settings.parse(json.dumps(raw))
    assert s.options["sdpa"]["form_policy"] == FormPolicy(short_prefix_max=0)
    with pytest.raises(InvalidSpecError, match="unknown field"):
        Settings.parse({"target": "sdpa", "options": {"sdpa": {"form_policy": {"long": "mha"}}}})
    with pytest.raises(InvalidSpecError, match="choose one of"):
        Settings.parse({"target": "sdpa", "options": {"sdpa": {"form_policy": {"decode": "x"}}}})


def _env(prefill: str, record: str) -> dict[str, Any]:
    return {
        "target": f"prefill={prefill},decode=torch",
        "options": {prefill: {"form_policy": CHUNKED}},
        "record": record,
    }


@needs_sglang
def test_chunked_kv_calls_merge_to_full_attention(tmp_path: Path) -> None:
    """Our handler answers MHA_CHUNKED_KV (MHA_ONE_SHOT when SGLang's chunked prefix cache is
    off); the new tokens' call and each chunk's call, merged by SGLang's merge_state, give
    full attention over prefix + new tokens (float64 reference). Cases: a request without a
    prefix (its rows attend nothing in every chunk), chunks a request has no keys in, and
    more new tokens than a chunk has keys (a request's rows in pieces)."""
    record = str(tmp_path / "record.json")
    cases = [
        {"env": _env("sdpa", record), "prefix": [5, 12, 0], "new": [3, 1, 4], "capacity": 12},
        {"env": _env("sdpa", record), "prefix": [7], "new": [9], "capacity": 3},
        {"env": _env("torch", record), "prefix": [6, 2], "new": [2, 5], "capacity": 4},
    ]
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE / "shims"), str(ROOT)]),
    }
    env.pop(ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "chunked_kv_check.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CHUNKED "))
    results = json.loads(line[len("CHUNKED ") :])
    for case, r in zip(cases, results, strict=True):
        assert r["method"] == "MHA_CHUNKED_KV", r
        assert r["method_disabled"] == "MHA_ONE_SHOT", r
        assert r["chunks"] >= 2, r
        assert r["shapes"] == [[sum(case["new"]), 4, 16], [sum(case["new"]), 4]], r
        assert r["max_err"] < 1e-5, (case, r)
        assert r["missing_metadata"][0] == "InvalidBatchError", r
        assert "init_mha_chunk_metadata was not called" in r["missing_metadata"][1], r
    assert results[0]["chunk_lens"] == [[4, 4, 0], [1, 4, 0], [0, 4, 0]]
    # Every call (the new tokens' and one per chunk) is filed under the layer's form, on the
    # runner's prefill backend (the process's one record, written after each call).
    calls = {"sdpa": 0, "torch": 0}
    for case, r in zip(cases, results, strict=True):
        calls[next(iter(case["env"]["options"]))] += 1 + r["chunks"]
    with open(record, encoding="utf-8") as f:
        assert json.load(f) == [
            ["target", "prefill", name, n, "mha_chunked"] for name, n in sorted(calls.items())
        ]
