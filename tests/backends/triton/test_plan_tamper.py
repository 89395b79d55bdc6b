"""A triton launch record edited after it was made: our error or the right answer, never
other memory.

A caller holds only a handle (``_ops.TritonPlan``, immutable summaries: editing it reaches
nothing, see tests/adversarial/test_plan_tampering.py); the launch record stays with the
backend object. This file checks the defence behind that: were the record itself reached
and changed -- ``object.__setattr__`` on its frozen fields (grids, split count, snapshot,
mask), editing a tensor it holds -- a launch still refuses it (``check_launchable``) or
reads only inside the call's tensors. Each case runs in a child process (under triton's CPU
interpreter here), since a kernel run with the wrong widths or grid could corrupt the heap
rather than raise. The child prints one line per case; the test reads them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

_CHILD = """
    import dataclasses, math, os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
    from attn_dispatch.backends.triton import _ops
    from attn_dispatch.backends.triton.backend import TritonBackend
    from tests import oracle

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=4, device=dev,
                     tree_verify=True, window_left=5)
    be = TritonBackend(cfg, num_kv_splits=2)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(12, 4, 2, 16, generator=g).to(dev)
    v = torch.randn(12, 4, 2, 16, generator=g).to(dev)

    def batch(phase, q_lens, kv_lens, tables, masks=None):
        return AttnBatch.build(phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables,
                               page_size=4, num_pages=12, masks=masks, device=dev)

    decode = batch(Phase.DECODE, [1, 1], [9, 6], [[3, 7, 1], [0, 5]])
    tree = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    extend = batch(Phase.VERIFY, [2], [6], [[8, 2]], masks=[tree])
    q_dec = torch.randn(2, 4, 16, generator=g).to(dev)
    q_ext = torch.randn(2, 4, 16, generator=g).to(dev)
    run = be.handler(Phase.DECODE)

    def right(b, q):
        want = oracle.reference_for_batch(cfg, b, q, k, v, 0.25)
        return want.float()

    def outcome(name, make, q, b):
        # our error, or the answer for the batch the plan was made for
        plan = make()
        try:
            out = run(q, k, v, plan, 0.25)
        except InvalidBatchError as exc:
            assert exc.field == "plan", exc
            print("ok", name, "refused")
            return
        torch.testing.assert_close(out.cpu(), right(b, q), atol=2e-5, rtol=2e-5)
        print("ok", name, "right answer")

    def record(plan):
        return be._plans.get(plan, be)  # the private launch record behind the handle

    def setattr_(plan, **fields):
        for key, value in fields.items():
            object.__setattr__(record(plan), key, value)
        return plan

    # the untouched plans give the right answer (the baseline the cases compare with)
    outcome("untouched decode", lambda: be.plan(decode), q_dec, decode)
    outcome("untouched extend", lambda: be.plan(extend), q_ext, extend)
    # object.__setattr__ on the frozen fields a launch uses
    outcome("decode split_grid", lambda: setattr_(be.plan(decode), split_grid=(64, 2, 2)),
            q_dec, decode)
    outcome("decode zero splits", lambda: setattr_(be.plan(decode), num_splits=0,
            split_grid=(2, 2, 0)), q_dec, decode)
    outcome("decode more splits", lambda: setattr_(be.plan(decode), num_splits=5,
            split_grid=(2, 2, 5)), q_dec, decode)
    outcome("decode merge_grid", lambda: setattr_(be.plan(decode), merge_grid=(9, 1)),
            q_dec, decode)
    outcome("extend grid rows", lambda: setattr_(be.plan(extend), grid=(1, 4, 0)),
            q_ext, extend)
    outcome("extend grid heads", lambda: setattr_(be.plan(extend), grid=(1, 64, 1)),
            q_ext, extend)
    outcome("extend grid float", lambda: setattr_(be.plan(extend), grid=(1.0, 4, 1)),
            q_ext, extend)
    other = be.plan(batch(Phase.VERIFY, [2], [6], [[4, 9]], masks=[tree]))
    outcome("extend swapped snapshot", lambda: setattr_(be.plan(extend), snap=record(other).snap),
            q_ext, extend)
    outcome("extend swapped mask", lambda: setattr_(be.plan(extend),
            mask=torch.ones(4096, dtype=torch.uint8, device=dev)), q_ext, extend)
    outcome("extend mask dropped", lambda: setattr_(be.plan(extend), mask=None), q_ext, extend)

    # the kernel widths are not the plan's: there is nothing in a plan to widen, and the
    # backend's constants are read-only mappings
    plan = be.plan(decode)
    assert not any(f.name.endswith("constants") for f in dataclasses.fields(record(plan)))
    consts = _ops.constants_of(be.kernel_config)
    for table in consts:
        try:
            table["BLOCK_N"] = 64
        except TypeError:
            pass
        else:
            raise SystemExit("a constants mapping took an item assignment")
    outcome("after constants attempts", lambda: be.plan(decode), q_dec, decode)
    print("ok constants read-only")

    # a tensor the plan holds, edited in place: the kernels read what it now says, bounded
    # by the call's tensors (a page outside the cache is dropped), never other memory
    plan = be.plan(decode)
    record(plan).snap.kv_indices[2] = 10**6  # request 0's third page: outside the cache
    out = run(q_dec, k, v, plan, 0.25)
    assert torch.isfinite(out).all()
    cut = batch(Phase.DECODE, [1, 1], [8, 6], [[3, 7], [0, 5]])
    torch.testing.assert_close(out[1:].cpu(), right(cut, q_dec)[1:], atol=2e-5, rtol=2e-5)
    print("ok edited page table bounded")
"""


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=900,
    )  # fmt: skip


def test_tampered_plans_give_our_error_or_the_right_answer() -> None:
    child = _child(_CHILD)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    expected_refused = [
        "decode split_grid", "decode zero splits", "decode merge_grid", "extend grid rows",
        "extend grid heads", "extend grid float", "extend swapped snapshot",
        "extend swapped mask", "extend mask dropped",
    ]  # fmt: skip
    out = child.stdout
    for name in expected_refused:
        assert f"ok {name} refused" in out, out
    # another split count is as good as the planned one: the same answer
    assert "ok decode more splits right answer" in out, out
    for name in ("untouched decode", "untouched extend", "after constants attempts"):
        assert f"ok {name} right answer" in out, out
    assert "ok constants read-only" in out and "ok edited page table bounded" in out, out
