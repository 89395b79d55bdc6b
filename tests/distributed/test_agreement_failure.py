"""check_agreement never hangs: a rank that fails on its own input before the exchange still
joins it with a failure marker, and every rank raises RankFailedError naming it and why.

Real gloo process groups, one subprocess per rank, with a short process-group timeout: on a
build where the failed rank skips the collective, the others wait that long and then fail
with gloo's own error, and the test fails in seconds.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from attn_dispatch._errors import AttnDispatchError
from attn_dispatch.distributed import RankFailedError

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3
PG_TIMEOUT_S = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, dict[str, object]]]:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("fail_worker.py")),
                    str(PG_TIMEOUT_S),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, out[-2000:] + err[-3000:]
            results.append(
                {
                    line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
                    for line in out.splitlines()
                    if line.startswith("CASE ")
                }
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def test_one_failed_rank_is_named_on_every_rank(three_ranks):
    for rank, results in enumerate(three_ranks):
        got = results["one_fails"]
        assert got["type"] == "RankFailedError", (rank, got)
        assert list(got["failures"]) == ["1"]
        assert got["failures"]["1"].startswith("InvalidBatchError: "), got
        assert "rank(s) 1 of the 3 ranks" in got["message"]
        assert f"seen on rank {rank}" in got["message"]
        # The failed rank keeps its own error as the cause; the others had none.
        assert got["cause"] == ("InvalidBatchError" if rank == 1 else None)


def test_every_failed_rank_is_named(three_ranks):
    for results in three_ranks:
        got = results["two_fail"]
        assert got["type"] == "RankFailedError"
        assert sorted(got["failures"]) == ["1", "2"]
        assert "rank(s) 1, 2 of the 3 ranks" in got["message"]


def test_the_group_stays_usable_after_a_failed_check(three_ranks):
    # Every rank took part in each exchange: the next collective lines up.
    assert [r["after_failures_agree"] for r in three_ranks] == [{"ok": True}] * WORLD


def test_rank_failed_error_survives_pickling():
    err = RankFailedError({2: "InvalidBatchError: bad", 0: "TypeError: no"}, 3, 1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RankFailedError and isinstance(back, AttnDispatchError)
    assert isinstance(back, RuntimeError)
    assert (back.failures, back.world, back.rank) == (
        {0: "TypeError: no", 2: "InvalidBatchError: bad"},
        3,
        1,
    )
    assert str(back) == str(err)
    assert list(back.failures) == [0, 2]  # rank order
