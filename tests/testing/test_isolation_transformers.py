"""The kit on transformers: a tiny random Llama generating alone vs the same model with an
assistant model (assisted generation) bound to other backends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch.backend import register_backend  # noqa: E402
from attn_dispatch.backend import unregister_backend  # noqa: E402
from attn_dispatch.backends.reference import CAPABILITIES as TORCH_CAPS  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from attn_dispatch.testing import assert_isolated  # noqa: E402
from tests.integrations.transformers.tiny import llama  # noqa: E402

VOCAB = 128
TARGET_SPEC = "prefill=torch,decode=torch2"
ASSISTANT_SPEC = "prefill=torch2,decode=torch"


@pytest.fixture(autouse=True)
def _torch2() -> Iterator[None]:
    # A second registered name for the reference kernels: the runners' choices differ.
    register_backend(
        "torch2",
        capabilities=TORCH_CAPS,
        factory="attn_dispatch.backends.reference.backend:TorchBackend",
        replace=True,
    )
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)
    unregister_backend("torch2")


IDS = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))


def _generate(model: Any, **kw: Any) -> Any:
    with torch.no_grad():
        return model.generate(input_ids=IDS, max_new_tokens=10, do_sample=False, **kw)


def test_target_generating_alone_vs_with_an_assistant_on_other_backends() -> None:
    outputs: dict[str, Any] = {}

    def alone() -> None:
        target = llama(seed=0, layers=2)
        bound = use(target, TARGET_SPEC, label="target")
        outputs["alone"] = _generate(target)
        bound.remove()

    def together() -> None:
        target = llama(seed=0, layers=2)
        assistant = llama(seed=1, layers=1)
        bounds = [
            use(target, TARGET_SPEC, label="target"),
            use(assistant, ASSISTANT_SPEC, label="assistant"),
        ]
        # A fixed number of candidates per round, so the assistant takes DECODE steps.
        assistant.generation_config.num_assistant_tokens = 3
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        outputs["together"] = _generate(target, assistant_model=assistant)
        for b in bounds:
            b.remove()

    result = assert_isolated(
        "target",
        alone,
        together,
        # Assisted generation checks candidates in VERIFY forwards instead of decoding: the
        # target runs no decode step together and no verify step alone.
        allow_call_count_diff=["decode", "verify"],
        allow_one_side=["decode", "verify"],
        expect=TARGET_SPEC,
    )
    assert torch.equal(outputs["alone"], outputs["together"])  # greedy: same tokens
    assert result.others == ("assistant",)
    assistant_rows = {(r.phase, r.backend) for r in result.together if r.runner == "assistant"}
    assert {("prefill", "torch2"), ("decode", "torch")} <= assistant_rows
    mine = {(r.phase, r.backend) for r in result.rows("together")}
    assert ("verify", "torch") in mine  # verify follows verify_mode=prefill
