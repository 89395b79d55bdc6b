"""SGLang 0.5.23's own offline engine serving each runner through attn_dispatch.

The engine tests need ``sglang`` (the README's test command installs it in ``.venv-sglang``
and runs this folder there). All engines run in one child process (``engine_run.py``), one
after another: SGLang's engine starts a scheduler subprocess and sets process-wide state, and a
crash must fail a test, not the session. The child's PYTHONPATH holds the test-only shims
(``shims/``: a small ``sgl_kernel`` and a placeholder ``torchvision``); nothing of them is in
the library.

Specs: every phase names a different backend in the two runners, so a draft that ran on the
target's spec (or the reverse) shows in the dispatch table.
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

from attn_dispatch import InvalidSpecError
from attn_dispatch.integrations.sglang_engine import DRAFT
from attn_dispatch.integrations.sglang_engine import ENV_VAR
from attn_dispatch.integrations.sglang_engine import TARGET
from attn_dispatch.integrations.sglang_engine import Settings
from attn_dispatch.integrations.sglang_engine import settings_from_env

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not HAVE_SGLANG,
    reason="sglang is not installed in this environment; the README's test command runs this "
    "folder in .venv-sglang, where it is",
)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

TARGET_SPEC = "prefill=sdpa,decode=torch"  # verify: the prefill backend (verify_mode prefill)
DRAFT_SPEC = "prefill=torch,decode=sdpa"
ENV = {"target": TARGET_SPEC, "draft": DRAFT_SPEC, "record": "auto"}
# What each runner must have run, per phase (SGLang's DRAFT_EXTEND_V2 is VERIFY).
TARGET_TABLE = {("target", "prefill"): "sdpa", ("target", "verify"): "sdpa"}
DRAFT_TABLE = {
    ("draft", "prefill"): "torch",
    ("draft", "verify"): "torch",
    ("draft", "decode"): "sdpa",
}

RUNS: list[dict[str, Any]] = [
    # SGLang's own CPU backend, no draft: the tokens every other run must reproduce.
    {"name": "alone", "backend": "torch_native", "env": None},
    {"name": "plain", "backend": "attn_dispatch", "env": ENV},
    {
        "name": "standalone",
        "backend": "attn_dispatch",
        "env": ENV,
        "spec": {"algorithm": "STANDALONE", "draft": "draft"},
    },
    # The target as its own draft: every draft token is accepted, so a wrong draft KV read or
    # a wrong tree mask would change the tokens.
    {
        "name": "standalone_tree",
        "backend": "attn_dispatch",
        "env": ENV,
        "spec": {"algorithm": "STANDALONE", "draft": "target", "topk": 2, "tokens": 6},
    },
    {
        "name": "standalone_page4",
        "backend": "attn_dispatch",
        "env": ENV,
        "page": 4,
        "spec": {"algorithm": "STANDALONE", "draft": "target"},
    },
    {
        "name": "eagle",
        "backend": "attn_dispatch",
        "env": ENV,
        "spec": {"algorithm": "EAGLE", "topk": 2, "tokens": 6},
    },
    {
        "name": "eagle3",
        "backend": "attn_dispatch",
        "env": ENV,
        "page": 4,
        "spec": {"algorithm": "EAGLE3"},
    },
]
# MLA (SGLang's latent pool): a tiny DeepSeek-V2 target, each runner on its own spec with a
# DeepSeek draft; then a Sarvam MLA draft on SGLang's triton backend (concatenated rope) beside
# a target on attn_dispatch (registered separate-rope): without the plugin's Sarvam hook SGLang
# hands the draft the pair's form and the draft's triton backend dies ("TritonAttnBackend.
# forward_extend() got an unexpected keyword argument 'q_rope'", checked by hand; the issue's
# FlashInfer draft died of the other form, "shape mismatch"); the hook reads the draft's own.
MLA_RUNS: list[dict[str, Any]] = [
    {
        "name": "mla_standalone",
        "backend": "attn_dispatch",
        "env": ENV,
        "model": "mla_target",
        "spec": {"algorithm": "STANDALONE", "draft": "mla_draft"},
    },
    # The target's binding picks mha_chunked for a prefill with a cached prefix, so our
    # handler answers SGLang's chunked-KV MHA; SGLang's chunk capacity of 4 tokens splits the
    # second round's 13-token prefix into >= 4 chunks (2 tokens per request when both
    # requests share a batch).
    {
        "name": "mla_chunked_kv",
        "backend": "attn_dispatch",
        "env": {
            "target": TARGET_SPEC,
            "options": {"sdpa": {"form_policy": {"short_prefix_max": 0}}},
            "record": "auto",
        },
        "model": "mla_target",
        "sglang_env": {"SGLANG_MAX_KV_CHUNK_CAPACITY": "4"},
    },
    # A token tree (topk 2) over the latent pool: the target as its own draft, so every
    # draft token is accepted and a wrong tree mask in the absorbed verify changes the tokens.
    {
        "name": "mla_tree",
        "backend": "attn_dispatch",
        "env": ENV,
        "model": "mla_target",
        "spec": {"algorithm": "STANDALONE", "draft": "mla_target", "topk": 2, "tokens": 6},
    },
    {
        "name": "sarvam_draft",
        "backend": "attn_dispatch",
        "env": {"target": TARGET_SPEC, "record": "auto"},
        "model": "mla_target",
        "spec": {"algorithm": "STANDALONE", "draft": "sarvam_draft", "draft_backend": "triton"},
    },
]
# The MLA target's greedy tokens on SGLang's own MLA path, recorded here: SGLang's triton
# backend (its MLA default off Hopper) in fp32, under TRITON_INTERPRET=1, from
#   engine_run.py WORK '[{"name": "mla_alone", "backend": "triton", "env": null,
#                         "model": "mla_target"}]'
# (9 minutes of interpreted kernels on a loaded 2-core machine, so not rerun in CI). SGLang's
# torch_native cannot serve DeepSeek: its MHA prefill reads the latent cache as K.
MLA_REFERENCE = [
    [490, 210, 210, 276, 16, 26, 161, 124, 419, 22],
    [488, 210, 16, 16, 90, 138, 425, 467, 17, 320],
    [72, 16, 402, 105, 272, 34, 488, 261, 363, 119],
    [41, 139, 278, 0, 244, 35, 488, 252, 212, 156],
]
RUNS += MLA_RUNS
# No draft spec: the draft runner must refuse at start-up. Its own child process: SGLang's
# engine kills its parent process when the scheduler subprocess dies.
REFUSED = {
    "name": "no_draft_spec",
    "backend": "attn_dispatch",
    "env": {"target": TARGET_SPEC},
    "spec": {"algorithm": "STANDALONE", "draft": "draft"},
}


def _run_engines(work: Path, runs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(HERE / "shims"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop(ENV_VAR, None)
    return subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(work), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
        check=False,
    )


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("sglang_engine")
    proc = _run_engines(work, RUNS)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            # raw_decode: a scheduler subprocess's log line can land right after the result on
            # the same line (its print and ours share the pipe).
            r, _ = json.JSONDecoder().raw_decode(line[len("RESULT ") :])
            results[r["name"]] = r
    # The dispatch table of each run, for the log (pytest -s, or on failure).
    for r in results.values():
        print(r["name"], r.get("setup_s"), r.get("record"), r.get("error"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results["_work"] = str(work)
    return results


def _table(run: dict[str, Any]) -> dict[tuple[str, str], str]:
    table: dict[tuple[str, str], str] = {}
    for label, phase, backend, calls, _form in run["record"]:
        assert calls > 0
        # One row per form: every form of a phase on the same backend.
        seen = table.setdefault((label, phase), backend)
        assert seen == backend, f"{label} {phase} ran on two backends: {run['record']}"
    return table


# ---------------------------------------------------------------------------------------------
# Without an engine: settings


def test_settings_parse_and_refuse() -> None:
    s = Settings.parse(json.dumps({"target": "prefill=torch,decode=native", "draft": "torch"}))
    assert str(s.spec_for(TARGET)) == "prefill=torch,decode=native"
    assert str(s.spec_for(DRAFT)) == "torch"
    with pytest.raises(InvalidSpecError, match="never copied"):
        Settings.parse({"target": "native"}).spec_for(DRAFT)
    with pytest.raises(InvalidSpecError, match="not JSON"):
        Settings.parse("{target: native}")
    with pytest.raises(InvalidSpecError, match="unknown key"):
        Settings.parse({"target": "native", "drafts": "torch"})
    with pytest.raises(InvalidSpecError, match="name the target"):
        Settings.parse({"draft": "torch"})
    with pytest.raises(InvalidSpecError, match="backend name -> keywords"):
        Settings.parse({"target": "native", "options": {"native": False}})
    with pytest.raises(InvalidSpecError, match="unset"):
        settings_from_env({})
    assert settings_from_env({ENV_VAR: '{"target": "torch"}'}).draft is None


def test_import_loads_no_sglang_or_torch() -> None:
    code = (
        "import sys, attn_dispatch.integrations.sglang_engine as m; "
        "print(sorted(k for k in ('torch', 'sglang') if k in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


@needs_sglang
def test_register_is_inert_and_removed_cleanly() -> None:
    code = """
import json
from sglang.srt.arg_groups import choices
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.speculative.draft_utils import DraftBackendFactory
from attn_dispatch.integrations.sglang_engine import register, unregister
held = DraftBackendFactory._create_backend  # a module-level name SGLang's hooks rebind too
kept = [held]
register(); register()
hooked = DraftBackendFactory._create_backend
state = [ATTENTION_BACKENDS.get("attn_dispatch") is not None,
         choices.ATTENTION_BACKEND_CHOICES.count("attn_dispatch"),
         choices.DRAFT_ATTENTION_BACKEND_CHOICES.count("attn_dispatch"), hooked is not kept[0],
         choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS.count("attn_dispatch")]
# The hook adds our name to the factory's map and nothing else.
class F: draft_model_runner = None; topk = 1; speculative_num_steps = 3
m = {"triton": 1}
from attn_dispatch.integrations.sglang_engine import _hooks
_hooks._factory_before(F(), "prefill_attention_backend", m, "{backend_type}")
state.append(sorted(m))
# The MLA form of our name in SGLang's two registries: DeepSeek asks our handler, Sarvam's
# registry says separate rope.
from sglang.srt.models import sarvam_moe
from sglang.srt.models.deepseek_common import attention_backend_handler as ds
state += [ds.AttentionBackendRegistry.get_handler("attn_dispatch") is _hooks._deepseek_form,
          sarvam_moe.AttentionBackendRegistry._handlers.get("attn_dispatch")
          is sarvam_moe._handle_separate_rope_backend]
unregister()
state += ["attn_dispatch" in ATTENTION_BACKENDS,
          "attn_dispatch" in choices.ATTENTION_BACKEND_CHOICES,
          DraftBackendFactory._create_backend is kept[0] and held is kept[0],
          ds.AttentionBackendRegistry.get_handler("attn_dispatch") is ds.handle_attention_triton,
          "attn_dispatch" in sarvam_moe.AttentionBackendRegistry._handlers,
          "attn_dispatch" in choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS]
print(json.dumps(state))
"""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "shims"), str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state == [
        *(True, 1, 1, True, 1, ["attn_dispatch", "triton"], True, True),
        *(False, False, True, True, False, False),
    ]


# ---------------------------------------------------------------------------------------------
# The engine


@needs_sglang
def test_greedy_tokens_are_the_target_alones(engine_runs: dict[str, Any]) -> None:
    alone = engine_runs["alone"]["tokens"]
    assert len(alone) == 4 and all(len(t) == 10 for t in alone)
    for name in ("plain", "standalone", "standalone_tree", "standalone_page4", "eagle", "eagle3"):
        assert engine_runs[name]["tokens"] == alone, name
    # The second round reused the first round's prompt from SGLang's radix cache: those
    # forwards were extends over a cached prefix.
    for name in ("alone", "plain", "standalone", "standalone_page4"):
        assert min(engine_runs[name]["cached_tokens"][2:]) >= 12, name


@needs_sglang
def test_self_draft_is_accepted(engine_runs: dict[str, Any]) -> None:
    # The target as its own draft: more than one token per verify, so the draft's multi-step
    # decode and the target's verify (chain, and the tree mask) ran on accepted drafts. A chain
    # of the target's own greedy tokens is accepted whole; SGLang's tree drafting reads each
    # branch's KV column (an approximation of its own), so a tree accepts less.
    chain = engine_runs["standalone_page4"]
    assert sum(chain["verify_ct"]) * 2 <= sum(chain["completion_tokens"]), chain
    tree = engine_runs["standalone_tree"]
    assert sum(tree["verify_ct"]) < sum(tree["completion_tokens"]), tree


@needs_sglang
def test_plain_engine_dispatch_table(engine_runs: dict[str, Any]) -> None:
    assert _table(engine_runs["plain"]) == {
        ("target", "prefill"): "sdpa",
        ("target", "decode"): "torch",
    }


@needs_sglang
@pytest.mark.parametrize(
    "name", ["standalone", "standalone_tree", "standalone_page4", "eagle", "eagle3"]
)
def test_each_runner_on_its_own_spec(engine_runs: dict[str, Any], name: str) -> None:
    assert _table(engine_runs[name]) == {**TARGET_TABLE, **DRAFT_TABLE}


@needs_sglang
def test_draft_without_spec_refused_at_start_up(engine_runs: dict[str, Any]) -> None:
    # After the other engines (the models are made); the engine never serves a request.
    proc = _run_engines(Path(engine_runs["_work"]), [REFUSED])
    assert '"tokens"' not in proc.stdout, proc.stdout
    # The draft runner's start-up (in the scheduler subprocess) raised our error, naming the
    # key to add, and the engine did not start.
    assert "InvalidSpecError: draft=None" in proc.stderr, proc.stderr[-4000:]
    assert 'add "draft": "<spec>" to ATTN_DISPATCH_SGLANG' in proc.stderr


@needs_sglang
def test_sarvam_form_reads_the_runners_own_backend() -> None:
    """SGLang's Sarvam MLA layers pick their form (separate or concatenated rope) from the
    process-wide backend pair. With the target on attn_dispatch, plain SGLang hands every
    runner the form of the pair's name: concatenated (the fallback for a name it does not know)
    before the plugin, separate (our registered form) with the plugin but without its hook,
    which a draft on SGLang's triton backend cannot take (the issue's shape mismatch). With the
    hook, each runner's own stamped backend decides; unregister puts SGLang's function back."""
    code = """
import json
from types import SimpleNamespace
from sglang.srt.models import sarvam_moe
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from attn_dispatch.integrations.sglang_engine import register, unregister, _hooks
# The process-wide pair of an engine whose target runs on attn_dispatch.
sarvam_moe.attention_backends = lambda: ("attn_dispatch", "attn_dispatch")
runners = ["flashinfer", "triton", "attn_dispatch"]  # the backend a runner's forward runs on
def forms(fn):
    out = []
    for name in runners:
        backend = SimpleNamespace(prefill_attention_backend_str=name,
                                  decode_attention_backend_str=name)
        for mode in (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2):
            with forward_context(ForwardContext(attn_backend=backend)):
                out.append(fn(SimpleNamespace(forward_mode=mode)).name[4:7])
    return out
before = forms(sarvam_moe.get_attn_forward_method)
register()
unhooked = forms(_hooks._original(sarvam_moe.get_attn_forward_method))
after = forms(sarvam_moe.get_attn_forward_method)
unregister()
print(json.dumps([before, unhooked, after, forms(sarvam_moe.get_attn_forward_method)]))
"""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "shims"), str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    before, unhooked, after, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == ["CON"] * 6  # the pair's name decides, whatever the runner runs on
    assert unhooked == ["SEP"] * 6  # ours registered, still the pair's: triton gets "SEP"
    assert after == ["SEP", "SEP", "CON", "CON", "SEP", "SEP"]  # each runner's own backend
    assert again == before


# ---------------------------------------------------------------------------------------------
# MLA


def _forms(run: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    return {(label, phase, backend, form) for label, phase, backend, _n, form in run["record"]}


@needs_sglang
def test_mla_greedy_tokens_are_sglangs_own(engine_runs: dict[str, Any]) -> None:
    alone = MLA_REFERENCE
    for name in ("mla_standalone", "mla_chunked_kv", "sarvam_draft"):
        assert engine_runs[name].get("error") is None, engine_runs[name].get("traceback")
        assert engine_runs[name]["tokens"] == alone, name
    for name in ("mla_standalone", "mla_chunked_kv"):
        assert min(engine_runs[name]["cached_tokens"][2:]) >= 12, name


@needs_sglang
def test_mla_runners_each_on_their_own_spec_and_form(engine_runs: dict[str, Any]) -> None:
    """DeepSeek's layers asked each runner's own binding for the form: prefill decompressed
    (SGLang's MHA, then its one-shot MHA over the cached prefix), verify and decode absorbed
    over the latent pool; every phase on its runner's backend."""
    run = engine_runs["mla_standalone"]
    assert _table(run) == {**TARGET_TABLE, **DRAFT_TABLE}
    assert _forms(run) == {
        ("target", "prefill", "sdpa", "mha"),
        ("target", "verify", "sdpa", "mla"),
        ("draft", "prefill", "torch", "mha"),
        ("draft", "verify", "torch", "mla"),
        ("draft", "decode", "sdpa", "mla"),
    }


@needs_sglang
def test_mla_token_tree_verify(engine_runs: dict[str, Any]) -> None:
    """A draft token tree (topk 2) verified by an MLA target over SGLang's latent pool: the
    target's greedy tokens, more than one token accepted per verify, each runner on its own
    spec with the absorbed form for verify and draft decode."""
    run = engine_runs["mla_tree"]
    assert run.get("error") is None, run.get("traceback")
    assert run["tokens"] == MLA_REFERENCE
    assert sum(run["verify_ct"]) < sum(run["completion_tokens"]), run
    assert _table(run) == {**TARGET_TABLE, **DRAFT_TABLE}
    assert {f for f in _forms(run) if f[1] != "prefill"} == {
        ("target", "verify", "sdpa", "mla"),
        ("draft", "verify", "torch", "mla"),
        ("draft", "decode", "sdpa", "mla"),
    }


@needs_sglang
def test_sarvam_draft_on_its_own_backend_runs(engine_runs: dict[str, Any]) -> None:
    run = engine_runs["sarvam_draft"]
    # The target alone is on attn_dispatch; the Sarvam draft ran on SGLang's triton backend.
    assert _table(run) == TARGET_TABLE
    assert sum(run["verify_ct"]) > 0


@needs_sglang
def test_mla_chunked_kv_prefill(engine_runs: dict[str, Any]) -> None:
    """SGLang's chunked-KV MHA over a cached prefix, every call through the target's
    binding: prefill without a prefix in SGLang's MHA, with one in chunks (filed as
    ``mha_chunked``: the new tokens' call and one per chunk), decode absorbed."""
    run = engine_runs["mla_chunked_kv"]
    assert _table(run) == {("target", "prefill"): "sdpa", ("target", "decode"): "torch"}
    assert _forms(run) == {
        ("target", "prefill", "sdpa", "mha"),
        ("target", "prefill", "sdpa", "mha_chunked"),
        ("target", "decode", "torch", "mla"),
    }
    calls = {form: n for _l, _p, _b, n, form in run["record"]}
    # 2 layers x (the new tokens' call + >= 4 chunks of <= 4 prefix tokens of 13).
    assert calls["mha_chunked"] >= 2 * (1 + 4), run["record"]
