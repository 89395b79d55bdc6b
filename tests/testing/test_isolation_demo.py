"""The kit on the demo: the MLA target alone vs the target with its GQA draft, start-up in
both orders (the demo's own runners, models and engine; tiny sizes, CPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import BackendSpec  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch.demo import engine  # noqa: E402
from attn_dispatch.demo.factory import default_specs  # noqa: E402
from attn_dispatch.demo.factory import pages_needed  # noqa: E402
from attn_dispatch.demo.factory import prompts_for  # noqa: E402
from attn_dispatch.demo.factory import sizes  # noqa: E402
from attn_dispatch.demo.models import build_models  # noqa: E402
from attn_dispatch.demo.runner import Runner  # noqa: E402
from attn_dispatch.demo.runner import SeqKV  # noqa: E402
from attn_dispatch.demo.values import DemoOptions  # noqa: E402
from attn_dispatch.testing import assert_isolated  # noqa: E402

OPTS = DemoOptions(max_new_tokens=8, batch=2)


def _start(order: tuple[str, ...]) -> dict[str, Runner]:
    """Seeded models; runners bound and started in ``order`` (a server's start-up)."""
    size = sizes()[OPTS.size]
    tmodel, dmodel = build_models(
        size.target, size.draft, seed=OPTS.seed, dtype=torch.float32, device="cpu"
    )
    tcfg = tmodel.attn_config(page_size=OPTS.page_size, device="cpu")
    dcfg = dmodel.attn_config(page_size=1, device="cpu")
    tspec, dspec = default_specs(tcfg, dcfg, None, None)
    pages = pages_needed(OPTS)
    made = {
        "target": lambda: Runner(
            "target", tmodel, bind(tspec, tcfg, label="target"), num_pages=pages
        ),
        "draft": lambda: Runner(
            "draft", dmodel, bind(dspec, dcfg, label="draft"), num_pages=pages * OPTS.page_size
        ),
    }
    return {name: made[name]() for name in order}


def _verify_alone(target: Runner, prompts: list[list[int]]) -> None:
    """One VERIFY forward of the target with fixed token trees (what the draft would have
    proposed: the same shape, branch x depth), so the target alone runs every phase."""
    seqs = [SeqKV() for _ in prompts]
    logits, head = engine.prefill(target, seqs, prompts)
    roots = [int(t) for t in logits.argmax(-1)]
    trees = [
        engine.Tree(
            [[(r + b + d) % 50 for d in range(OPTS.depth)] for b in range(OPTS.branch)],
            [[] for _ in range(OPTS.branch)],
        )
        for r in roots
    ]
    engine.verify(target, seqs, roots, trees)
    for seq in [*seqs, head]:
        target.release(seq)


def _workloads(order: tuple[str, ...]) -> tuple[Callable[[], None], Callable[[], None]]:
    def alone() -> None:
        target = _start(("target",))["target"]
        prompts = prompts_for(OPTS, sizes()[OPTS.size].target.vocab)
        engine.target_greedy(target, prompts, OPTS.max_new_tokens)
        _verify_alone(target, prompts)

    def together() -> None:
        runners = _start(order)
        target, draft = runners["target"], runners["draft"]
        prompts = prompts_for(OPTS, sizes()[OPTS.size].target.vocab)
        reference = engine.target_greedy(target, prompts, OPTS.max_new_tokens)
        outputs, _ = engine.speculative(target, draft, prompts, OPTS)
        assert outputs == reference  # the demo's own check: speculation changes nothing

    return alone, together


@pytest.mark.parametrize("order", [("target", "draft"), ("draft", "target")], ids="_then_".join)
def test_demo_target_is_isolated_from_its_draft(order: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    alone, together = _workloads(order)
    result = assert_isolated(
        "target",
        alone,
        together,
        # Speculation changes how many steps of each phase the target runs, never its kernels.
        allow_call_count_diff=True,
    )
    assert result.others == ("draft",)
    mine = result.rows("together")
    assert {r.phase for r in mine} == {"prefill", "decode", "verify"}
    spec = BackendSpec.parse(str(result.rows("alone")[0].backend))
    assert all(r.backend == spec.prefill for r in mine)  # uniform default spec
    if os.environ.get("KIT_PRINT"):
        from attn_dispatch.testing import format_rows

        print(f"\n{'/'.join(order)}: target ledger {result.ledger.fingerprint}")
        print(format_rows(result.together))
