"""A torch-backend plan edited after it was issued: our error or the right answer.

The torch reference backend indexes the cache through its plan's padded page table and row
tables. An entry edited in place (a page past the cache, a row past q) or a table replaced
with ``object.__setattr__`` must raise our ``InvalidBatchError`` naming the plan, never a raw
``IndexError`` or ``RuntimeError``. Run in a child process, as every tamper case is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_CHILD = """
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
    from attn_dispatch.backends.reference.backend import TorchBackend
    from tests import oracle

    cfg = AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=4, device="cpu")
    be = TorchBackend(cfg)
    run = be.handler(Phase.PREFILL)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(8, 4, 2, 16, generator=g)
    v = torch.randn(8, 4, 2, 16, generator=g)
    batch = AttnBatch.build(Phase.PREFILL, q_lens=[3, 2], kv_lens=[7, 5],
                            page_tables=[[6, 1], [3, 0]], page_size=4, num_pages=8)
    q = torch.randn(5, 4, 16, generator=g)
    want = oracle.reference_for_batch(cfg, batch, q, k, v, 0.25).float()

    def case(name, tamper):
        plan = be.plan(batch)
        tamper(plan)
        try:
            out = run(q, k, v, plan, 0.25)
        except InvalidBatchError as exc:
            assert exc.field == "plan", exc
            print("ok", name, "refused")
            return
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        print("ok", name, "right answer")

    def put(name, value):
        return lambda plan: object.__setattr__(plan, name, value)

    def edit(name, index, value):
        def go(plan):
            getattr(plan, name)[index] = value
        return go

    case("untouched", lambda plan: None)
    case("page past the cache", edit("page_table", (0, 1), 8))
    case("negative page", edit("page_table", (1, 0), -100))
    case("row past q", edit("q_rows", (0, 2), 99))
    case("output row past the batch", edit("out_rows", 4, 10**6))
    case("page table replaced", put("page_table", torch.zeros(2, 64, dtype=torch.int64)))
    case("row table replaced", put("q_rows", torch.zeros(1, 1, dtype=torch.int64)))
    case("kv lengths replaced", put("kv_lens", torch.tensor([7, 5, 9])))
    # the page table is the plan's private copy: the batch's own tensors may change freely
    plan = be.plan(batch)
    batch.kv_indices[0] = 7
    torch.testing.assert_close(run(q, k, v, plan, 0.25), want, atol=2e-5, rtol=2e-5)
    print("ok batch edited after planning right answer")
"""


def test_tampered_torch_plans_give_our_error_or_the_right_answer() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD)], capture_output=True, text=True,
        env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    out = child.stdout
    for name in (
        "page past the cache",
        "negative page",
        "row past q",
        "output row past the batch",
        "page table replaced",
        "row table replaced",
        "kv lengths replaced",
    ):
        assert f"ok {name} refused" in out, out
    assert "ok untouched right answer" in out, out
    assert "ok batch edited after planning right answer" in out, out
