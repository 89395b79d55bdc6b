"""Tampering with an issued native plan gives our error or the right answer, never other memory.

Each case runs in a child process (a memory-safety failure would crash or corrupt it): the
child plans a batch, computes the reference output, tampers, runs again and prints what
happened (REFUSED <field>, RIGHT or WRONG). Kinds of tampering: ``object.__setattr__`` on each
field of the frozen plan, item assignment into a tensor the plan holds (and into the batch it
was made from), a freed C++ plan id, a forged id, another runner's live id (through the
backend's private record, and straight through the C ABI with the Python checks bypassed),
and a plan handed to another backend object.

Nothing the kernels trust lives in the plan object: the C++ plan's id is kept by the backend
that issued it, keyed by the plan's identity; the library checks that id (live, not freed,
issued to this runner) inside ``na_run``; the output is sized from the library's own row
count and ``na_run`` refuses any other size, so no row of a returned output is left unwritten.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from attn_dispatch.backends.native._lib import load

LIB = load()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
ROOT = Path(__file__).resolve().parents[3]

_CHILD = textwrap.dedent(
    """
    import ctypes, dataclasses, sys
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
    from attn_dispatch.backends.native import backend as nb
    from attn_dispatch.backends.native.backend import run_args

    case = sys.argv[1]
    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=4, device="cpu")
    be = nb.NativeBackend(cfg, num_threads=2)
    other = nb.NativeBackend(cfg, num_threads=2)
    batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[7, 5],
                            page_tables=[[0, 1], [2, 3]], page_size=4, num_pages=6)
    big = AttnBatch.build(Phase.DECODE, q_lens=[1, 1, 1], kv_lens=[8, 8, 8],
                          page_tables=[[0, 1], [2, 3], [4, 5]], page_size=4, num_pages=6)
    plan = be.plan(batch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, generator=gen)
    k = torch.randn(6, 4, 2, 32, generator=gen)
    v = torch.randn(6, 4, 2, 32, generator=gen)
    run = be.handler(Phase.DECODE)
    want = run(q, k, v, plan, 0.2).clone()
    # Fill the allocator with garbage of the output's size, so a row left unwritten by the
    # kernel would show in the result instead of an earlier correct output.
    for _ in range(4):
        torch.full((2, 4, 32), 7.0).sum()

    def record(p, backend=be):
        return backend._issued[id(p)]

    if case == "setattr_num_items":
        object.__setattr__(plan, "num_items", 0)
    elif case == "setattr_num_tokens":
        object.__setattr__(plan, "num_tokens", 3)
    elif case == "setattr_phase":
        object.__setattr__(plan, "phase", Phase.PREFILL)
    elif case == "setattr_max_page":
        object.__setattr__(plan, "max_page", 10**9)
    elif case == "setattr_snapshot":
        object.__setattr__(plan, "snapshot", be.plan(big).snapshot)
    elif case == "setattr_owner":
        theirs = other.plan(batch)
        object.__setattr__(theirs, "owner", be)
        plan = theirs
    elif case == "edit_plan_tensor":
        snap = plan.snapshot
        for name in ("kv_indices", "kv_indptr", "kv_lens", "qo_indptr"):
            t = getattr(snap, name)
            try:
                t[...] = 10**6  # item assignment into a tensor the plan holds
            except (RuntimeError, ValueError) as exc:  # read-only: refusing is fine too
                print("READONLY", name, type(exc).__name__)
    elif case == "edit_batch_tensor":
        batch.kv_indices[...] = 10**6
        batch.kv_lens[...] = 10**6
    elif case == "freed_handle":
        rec = record(plan)
        assert be._free(be._runner, rec.plan_id) == 0
    elif case == "forged_handle":
        object.__setattr__(record(plan), "plan_id", 0x1234_5678_9ABC_DEF0)
    elif case == "other_runner_handle":
        theirs = other.plan(batch)
        object.__setattr__(record(plan), "plan_id", record(theirs, other).plan_id)
    elif case == "other_runner_plan_checks_bypassed":
        # Both Python checks out of the way: only the library stands between the call and
        # another runner's plan.
        theirs = other.plan(batch)
        be._issued[id(theirs)] = record(theirs, other)
        nb.check_plan = lambda *a, **k: None
        plan = theirs
    elif case == "c_abi_other_runner":
        theirs = other.plan(batch)
        out = torch.empty(2, 4, 32)
        args = run_args(q, k, v, out, sm_scale=0.2, num_threads=1)
        na_run = be.library.cdll.na_run
        print("RC", na_run(be._runner, record(theirs, other).plan_id, ctypes.byref(args)),
              na_run(be._runner, 0x1234_5678_9ABC_DEF0, ctypes.byref(args)),
              na_run(other._runner, record(theirs, other).plan_id, ctypes.byref(args)),
              na_run(0x42, record(plan).plan_id, ctypes.byref(args)))
        rid = record(theirs, other).plan_id
        print("FREE", be._free(be._runner, rid), be._free(other._runner, rid),
              be._free(other._runner, rid), na_run(other._runner, rid, ctypes.byref(args)))
        sys.exit(0)
    else:
        raise SystemExit("unknown case " + case)
    try:
        got = run(q, k, v, plan, 0.2)
    except InvalidBatchError as exc:
        print("REFUSED", exc.field, exc)
    else:
        print("RIGHT" if torch.equal(got, want) else "WRONG")
    """
)

RIGHT_OR_REFUSED = {"RIGHT", "REFUSED"}
CASES = {
    # Editing a field of the plan changes nothing the kernel reads: the answer stays right.
    "setattr_num_items": {"RIGHT"},
    "setattr_num_tokens": {"RIGHT"},
    "setattr_phase": {"RIGHT"},
    "setattr_max_page": {"RIGHT"},
    "setattr_snapshot": RIGHT_OR_REFUSED,
    "edit_plan_tensor": RIGHT_OR_REFUSED,
    "edit_batch_tensor": {"RIGHT"},
    # Handles: the library refuses them.
    "setattr_owner": {"REFUSED"},
    "freed_handle": {"REFUSED"},
    "forged_handle": {"REFUSED"},
    "other_runner_handle": {"REFUSED"},
    "other_runner_plan_checks_bypassed": {"REFUSED"},
}


def _child(case: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, case],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_tampered_plan_gives_our_error_or_the_right_answer(case: str) -> None:
    done = _child(case)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    last = done.stdout.strip().splitlines()[-1]
    outcome = last.split()[0]
    assert outcome in CASES[case], last
    if outcome == "REFUSED":
        assert last.split()[1] in ("plan", "phase", "q", "kv_indices", "k_cache"), last
    if case in ("freed_handle", "forged_handle"):
        assert "no live plan" in last, last
    if case == "other_runner_handle":
        assert "another native runner" in last, last


def test_the_library_checks_runner_and_plan_ids_itself() -> None:
    done = _child("c_abi_other_runner")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    # na_run: another runner's plan, a forged id, the owner's call, an unknown runner.
    assert lines["RC"].split() == ["-4", "-3", "0", "-5"], lines
    # na_plan_free: not by another runner; by its own once; a freed id stays dead.
    assert lines["FREE"].split() == ["-4", "0", "-3", "-3"], lines


def test_native_plan_holds_no_mutable_container() -> None:
    # Every field is an immutable value (ints, the phase, the owner, the snapshot): no dict,
    # list or handle object a caller could edit in place.
    import dataclasses

    from attn_dispatch.backends.native.backend import NativePlan

    names = {f.name for f in dataclasses.fields(NativePlan)}
    assert "handle" not in names and not any("ptr" in n for n in names), names
    assert NativePlan.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert not hasattr(NativePlan, "__dict__") or "__dict__" not in NativePlan.__slots__
