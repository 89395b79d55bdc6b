"""check_agreement: ranks that bound incompatible runners fail at start-up, on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import bind
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch.distributed import RankMismatchError
from attn_dispatch.distributed import binding_summary
from attn_dispatch.distributed import check_agreement
from attn_dispatch.distributed import compare_summaries

ROOT = Path(__file__).resolve().parents[2]
CFG = AttnConfig(
    kind="mha", num_q_heads=8, num_kv_heads=4, head_dim=16, dtype="float32", page_size=16
)


def test_summary_leaves_out_the_head_split_and_device_index():
    a = binding_summary({"t": bind(BackendSpec.uniform("torch"), CFG)})
    half = AttnConfig(
        kind="mha",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        page_size=16,
        device="cpu",
    )
    b = binding_summary({"t": bind(BackendSpec.uniform("torch"), half)})
    assert compare_summaries([a, b]) == {}


def test_compare_names_each_rank_value():
    a = binding_summary({"t": bind(BackendSpec.uniform("torch"), CFG)})
    b = binding_summary({"t": bind(BackendSpec.parse("prefill=torch,decode=native"), CFG)})
    diffs = compare_summaries([a, b, a])
    assert any(k.endswith("backends.decode") for k in diffs), diffs
    key = next(k for k in diffs if k.endswith("backends.decode"))
    assert diffs[key] == ["torch", "native", "torch"]
    err = RankMismatchError(diffs, 3)
    assert "rank 1: 'native'" in str(err) and isinstance(err, RuntimeError)


def test_without_a_process_group_says_how_to_start_one():
    pytest.importorskip("torch.distributed")
    with pytest.raises(AttnDispatchError, match="init_process_group"):
        check_agreement(bind(BackendSpec.uniform("torch"), CFG))


def test_summary_refuses_what_is_not_a_binding():
    with pytest.raises(AttnDispatchError, match="bindings"):
        binding_summary(["not", "a", "mapping"])  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str]]:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("agree_worker.py"))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, out[-2000:] + err[-3000:]
        results.append(
            {
                line.split(" ", 2)[1]: line.split(" ", 2)[2]
                for line in out.splitlines()
                if line.startswith("CASE ")
            }
        )
    return results


@pytest.mark.parametrize("case", ["agree", "head_split"])
def test_compatible_ranks_pass(two_ranks, case):
    assert [r[case] for r in two_ranks] == ["ok", "ok"]


@pytest.mark.parametrize(
    "case,field,values",
    [
        ("spec", "runner 'target'.spec.decode", ("'native'", "'torch'")),
        ("page_size", "config.page_size", ("16", "32")),
        ("kv_dtype", "config.kv_dtype", ("'float32'", "'float8_e4m3fn'")),
        ("verify_mode", "spec.verify_mode", ("'prefill'", "'decode'")),
        ("missing_runner", "runner 'draft'", ("<not bound on this rank>",)),
        ("library_version", "library.version", ("'0.0.0-other'",)),
        ("native_abi", "library.native_abi", ()),
    ],
)
def test_each_mismatch_class_is_caught_on_every_rank(two_ranks, case, field, values):
    for rank, results in enumerate(two_ranks):
        assert results[case] != "ok", f"rank {rank} passed case {case!r}"
        got = json.loads(results[case])
        assert any(field in f for f in got["fields"]), got["fields"]
        for v in values:
            assert v in got["message"], got["message"]
        assert "rank 0:" in got["message"] and "rank 1:" in got["message"]
    # Both ranks raise the same error.
    assert two_ranks[0][case] == two_ranks[1][case]
