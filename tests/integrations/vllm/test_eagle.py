"""vLLM speculative decoding with EAGLE-style heads and the other proposers: each layer is
labelled by the runner vLLM builds it for, bound with that runner's spec, stepped with its
phase rule; the speculative methods without draft attention have no draft runner.

Engines run in child processes (this file run as a script): vLLM engines are heavy, set
process-wide state and load native code, and a crash must fail a test, not the session.
Heads are tiny and random, made in the test (``heads.py``); fp32, 4 greedy requests.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.integrations.vllm.engines import BLOCK
from tests.integrations.vllm.engines import Models
from tests.integrations.vllm.engines import child_env
from tests.integrations.vllm.engines import child_result
from tests.integrations.vllm.engines import needs_vllm
from tests.integrations.vllm.engines import run_child
from tests.integrations.vllm.engines import start_engine

pytestmark = needs_vllm
K = 3  # speculative tokens
NEW_TOKENS = 8
# Four requests of 5 to 116 prompt tokens (1 to 4 blocks of 32).
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 37 * i)] for i in range(4)]


# ---------------------------------------------------------------------------------------------
# Engines in a child process


def _child(job: dict[str, Any]) -> dict[str, Any]:
    child_env()
    import gc

    import vllm

    from attn_dispatch import record_dispatch

    def labels(worker: Any) -> dict[str, Any]:
        """Layer name -> the runner label its attention dispatches under (None: vLLM's own)."""
        ctx = worker.model_runner.compilation_config.static_forward_context
        return {
            name: getattr(getattr(layer.impl, "dispatch", None), "label", None)
            for name, layer in ctx.items()
            if hasattr(layer, "impl")
        }

    results: list[dict[str, Any]] = []
    for engine in job["engines"]:
        kwargs: dict[str, Any] = {"disable_log_stats": False}  # vLLM's spec-decode counters
        if engine.get("spec") is not None:
            kwargs["speculative_config"] = engine["spec"]
        try:
            llm = start_engine(engine["model"], engine.get("attn_dispatch"), **kwargs)
        except Exception as exc:  # start-up refusals are what some tests look for
            results.append({"error": [type(exc).__name__, str(exc)]})
            continue
        params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        prompts: list[Any] = [{"prompt_token_ids": p} for p in PROMPTS]  # vLLM's TokensPrompt
        with record_dispatch() as rec:
            outs = llm.generate(prompts, params, use_tqdm=False)
        spec: dict[str, Any] = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_"):
                value = getattr(m, "values", None)
                spec[m.name.removeprefix("vllm:spec_decode_")] = (
                    list(value) if value is not None else getattr(m, "value", None)
                )
        results.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "counts": [[*k, n] for k, n in sorted(rec.counts().items())],
                "summary": rec.summary(),
                "labels": llm.collective_rpc(labels)[0],
                "spec": spec,
            }
        )
        del llm
        gc.collect()
    return {"results": results}


def _run(engines: list[dict[str, Any]], timeout: float = 1200) -> list[dict[str, Any]]:
    out, _ = run_child(__file__, {"engines": engines}, timeout=timeout)
    results: list[dict[str, Any]] = out["results"]
    return results


def _counts(result: dict[str, Any]) -> dict[tuple[str, str, str], int]:
    return {(label, phase, backend): n for label, phase, backend, n in result["counts"]}


def _backends(result: dict[str, Any], label: str) -> set[str]:
    return {b for lab, _, b in _counts(result) if lab == label}


def _spec(method: str, model: str) -> dict[str, Any]:
    return {"method": method, "model": model, "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def runs(models: Models) -> dict[str, dict[str, Any]]:
    """Every engine of this file, in one child process (names -> results)."""
    t, tx = models["target"], models["exact_target"]
    eagle, eagle3 = _spec("eagle", models["eagle"]), _spec("eagle3", models["eagle3"])
    medusa = _spec("medusa", models["medusa"])
    engines: dict[str, dict[str, Any]] = {
        # vLLM's own CPU attention, no speculation: the target's greedy tokens.
        "own": {"model": t},
        "eagle": {
            "model": t,
            "spec": eagle,
            "attn_dispatch": {"target": "native", "draft": "torch"},
        },
        # EAGLE-3 with the specs the other way round: the head follows "draft".
        "eagle3": {
            "model": t,
            "spec": eagle3,
            "attn_dispatch": {"target": "torch", "draft": "prefill=torch,decode=native"},
        },
        "eagle_no_draft": {"model": t, "spec": eagle, "attn_dispatch": {"target": "native"}},
        "eagle3_no_draft": {"model": t, "spec": eagle3, "attn_dispatch": {"target": "native"}},
        "medusa_draft": {
            "model": t,
            "spec": medusa,
            "attn_dispatch": {"target": "native", "draft": "torch"},
        },
        "medusa": {"model": t, "spec": medusa, "attn_dispatch": {"target": "native"}},
        "exact_own": {"model": tx},
        "exact_eagle": {
            "model": tx,
            "spec": _spec("eagle", models["exact_eagle"]),
            "attn_dispatch": {"target": "native", "draft": "prefill=torch,decode=native"},
        },
        "mimo_own": {"model": models["mimo"]},
        # MTP: the draft is the checkpoint's own MTP layer (one token a round for MiMo).
        "mtp": {
            "model": models["mimo"],
            "spec": {"method": "mtp", "num_speculative_tokens": 1},
            "attn_dispatch": {"target": "native", "draft": "torch"},
        },
    }
    return dict(zip(engines, _run(list(engines.values())), strict=True))


# ---------------------------------------------------------------------------------------------
# Engines


def test_eagle_head_is_the_draft_on_its_own_backend(runs: dict[str, dict[str, Any]]) -> None:
    own, run = runs["own"], runs["eagle"]
    assert run["tokens"] == own["tokens"]  # the target's greedy tokens (fp32)
    # The head's attention layer is named after the target's layers, and labelled draft.
    assert run["labels"] == {
        "model.layers.0.self_attn.attn": "target",
        "model.layers.1.self_attn.attn": "target",
        "model.layers.2.self_attn.attn": "draft",
    }
    assert _backends(run, "target") == {"native"} and _backends(run, "draft") == {"torch"}
    c = _counts(run)
    # Each round: the target verifies K drafts (2 layers), the head passes once over the
    # verified tokens (VERIFY, its phase rule) and then drafts K - 1 single tokens (DECODE).
    assert c[("draft", "verify", "torch")] > 0 and c[("draft", "decode", "torch")] > 0
    assert c[("draft", "prefill", "torch")] >= 1
    assert c[("target", "verify", "native")] == 2 * c[("draft", "verify", "torch")]
    assert run["spec"]["num_drafts"] > 0
    print(run["summary"])


def test_eagle3_head_is_the_draft_and_follows_the_draft_spec(
    runs: dict[str, dict[str, Any]],
) -> None:
    own, run = runs["own"], runs["eagle3"]
    assert run["tokens"] == own["tokens"]
    assert run["labels"]["model.layers.2.self_attn.attn"] == "draft"
    assert {n for n, lab in run["labels"].items() if lab == "target"} == {
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    }
    # Target "torch" everywhere; the head prefill/verify on torch, decode on native.
    assert _backends(run, "target") == {"torch"}
    c = _counts(run)
    assert c[("draft", "decode", "native")] > 0 and c[("draft", "verify", "torch")] > 0
    assert _backends(run, "draft") == {"torch", "native"}
    print(run["summary"])


def test_missing_draft_key_fails_at_start(runs: dict[str, dict[str, Any]]) -> None:
    for name, method in (("eagle_no_draft", "eagle"), ("eagle3_no_draft", "eagle3")):
        kind, text = runs[name]["error"]
        assert kind == "InvalidSpecError", text
        assert f"speculative method {method!r}" in text
        assert 'add "draft": "<spec>"' in text and "never copied" in text
    print(runs["eagle_no_draft"]["error"][1])


def test_a_head_that_drafts_well_gets_multi_token_acceptance(
    runs: dict[str, dict[str, Any]],
) -> None:
    own, run = runs["exact_own"], runs["exact_eagle"]
    assert run["tokens"] == own["tokens"]
    spec = run["spec"]
    # vLLM's own counters: every draft token accepted, at every position.
    assert spec["num_draft_tokens"] == K * spec["num_drafts"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["num_accepted_tokens_per_pos"] == [spec["num_drafts"]] * K
    # Whole rounds accepted: 1 + K tokens a round, so few rounds for NEW_TOKENS.
    c = _counts(run)
    rounds = c[("draft", "verify", "torch")]
    assert 0 < rounds < NEW_TOKENS - 1
    assert c[("draft", "decode", "native")] > 0 and _backends(run, "target") == {"native"}


def test_medusa_has_no_draft_runner(runs: dict[str, dict[str, Any]]) -> None:
    kind, text = runs["medusa_draft"]["error"]
    assert kind == "InvalidSpecError" and "speculative method 'medusa'" in text
    assert 'drop "draft"' in text
    run = runs["medusa"]
    assert run["tokens"] == runs["own"]["tokens"]
    assert set(run["labels"].values()) == {"target"} and len(run["labels"]) == 2
    assert {lab for lab, _, _ in _counts(run)} == {"target"}
    assert _counts(run)[("target", "verify", "native")] > 0
    assert run["spec"]["num_drafts"] > 0


def test_mtp_layer_is_the_draft(runs: dict[str, dict[str, Any]]) -> None:
    own, run = runs["mimo_own"], runs["mtp"]
    assert run["tokens"] == own["tokens"]
    # vLLM builds the MTP layer with the target's layer numbering, under the EAGLE proposer.
    assert run["labels"] == {
        "model.layers.0.self_attn.attn": "target",
        "model.layers.1.self_attn.attn": "target",
        "model.layers.2.self_attn.attn": "draft",
    }
    assert _backends(run, "target") == {"native"} and _backends(run, "draft") == {"torch"}
    c = _counts(run)
    # One draft token a round: the MTP layer's pass over the verified tokens, no decode pass.
    assert c[("target", "verify", "native")] == 2 * c[("draft", "verify", "torch")] > 0
    assert ("draft", "decode", "torch") not in c


# ---------------------------------------------------------------------------------------------
# Without an engine: the classification rules, against vLLM's own predicates


def test_every_vllm_method_is_classified() -> None:
    """Each speculative method vLLM 0.32 names: a draft runner exactly when its proposer has
    attention layers of its own (a draft KV cache)."""
    from typing import get_args

    from vllm.config.speculative import MTPModelTypes
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.speculative import SpeculativeMethod

    from attn_dispatch.integrations.vllm._runners import speculation_runs_draft_attention

    def flat(t: Any) -> list[str]:
        out: list[str] = []
        for a in get_args(t):
            out.extend(flat(a) if get_args(a) else [a])
        return out

    # vLLM rewrites every "<model>_mtp" method to "mtp" when it builds its config.
    methods = set(flat(SpeculativeMethod)) - (set(flat(MTPModelTypes)) - {"mtp"})
    with_draft = {"draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark"}
    with_draft.add("extract_hidden_states")  # its cache-only attention layer is the proposer's
    assert with_draft <= methods and {"ngram", "suffix", "medusa"} <= methods
    for method in sorted(methods):
        spec = object.__new__(SpeculativeConfig)
        object.__setattr__(spec, "method", method)
        cfg = type("C", (), {"speculative_config": spec})()
        assert speculation_runs_draft_attention(cfg) is (method in with_draft), method
    assert speculation_runs_draft_attention(type("C", (), {"speculative_config": None})()) is False


def test_runner_signals_must_agree() -> None:
    """A layer is the draft's when vLLM's model tag is a proposer's and a proposer is building
    it; when the two disagree, start-up fails with the reason."""
    from vllm.compilation.backends import set_model_tag

    from attn_dispatch.integrations.transformers import UnsupportedModelError
    from attn_dispatch.integrations.vllm._runners import runner_of

    spec = type("S", (), {"method": "eagle", "uses_draft_kv_cache": lambda self: True})()
    cfg = type("C", (), {"speculative_config": spec})()
    # A stand-in proposer: a class of vLLM's proposer modules, building a layer in a method.
    Proposer = type("FakeProposer", (), {"__module__": "vllm.v1.spec_decode.fake"})
    Proposer.build = lambda self: runner_of(cfg)  # type: ignore[attr-defined]
    assert runner_of(cfg) == "target"
    with set_model_tag("eagle_head"):
        assert Proposer().build() == "draft"
        with pytest.raises(UnsupportedModelError, match="no speculative proposer is building"):
            runner_of(cfg)
    with pytest.raises(UnsupportedModelError, match="FakeProposer is building it") as err:
        Proposer().build()
    assert "'backbone'" in str(err.value) and "eagle_head" in str(err.value)
    ngram = type("S", (), {"method": "ngram", "uses_draft_kv_cache": lambda self: False})()
    cfg = type("C", (), {"speculative_config": ngram})()
    with set_model_tag("eagle_head"), pytest.raises(UnsupportedModelError, match="'ngram'"):
        Proposer().build()


def test_draft_layer_names_are_checked_against_vllms_proposer() -> None:
    from attn_dispatch.integrations.transformers import UnsupportedModelError
    from attn_dispatch.integrations.vllm._runners import check_draft_layer_names

    drafter = type("D", (), {"_draft_attn_layer_names": {"model.layers.2.self_attn.attn"}})()
    Runner = type("FakeRunner", (), {"__module__": "vllm.v1.worker.fake", "drafter": drafter})
    Runner.check = lambda self, labels: check_draft_layer_names(labels)  # type: ignore[attr-defined]
    good = {"model.layers.1.self_attn.attn": "target", "model.layers.2.self_attn.attn": "draft"}
    Runner().check(good)
    bad = {**good, "model.layers.2.self_attn.attn": "target"}
    with pytest.raises(UnsupportedModelError, match=r"labelled \{'model.layers.2"):
        Runner().check(bad)
    check_draft_layer_names(bad)  # no runner building: nothing to check against


def test_each_layer_steps_with_its_runners_phase_rule() -> None:
    """One step's metadata, read by a target layer and a draft layer: K + 2 query tokens over a
    cache are the draft's pass over verified tokens plus the bonus token (VERIFY), but more
    than the target ever verifies (PREFILL, a chunk)."""
    torch = pytest.importorskip("torch")
    from attn_dispatch import Phase
    from attn_dispatch.integrations.vllm._metadata import DispatchMetadata

    qsl = torch.tensor([0, K + 2, K + 3], dtype=torch.int32)
    seq = torch.tensor([40, 41], dtype=torch.int32)
    md = DispatchMetadata(
        num_actual_tokens=K + 3,
        max_query_len=K + 2,
        max_seq_len=41,
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        slot_mapping=torch.zeros(K + 3, dtype=torch.int64),
        block_size=BLOCK,
        num_speculative_tokens=K,
        mixed="split",
    )
    assert md.phases(draft=True) == (Phase.DECODE, Phase.VERIFY)
    assert md.phases(draft=False) == (Phase.DECODE, Phase.PREFILL)


if __name__ == "__main__":
    child_result(_child(json.loads(sys.argv[1])))
