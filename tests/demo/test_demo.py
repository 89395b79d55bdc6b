"""The speculative-decoding demo, end to end at a tiny size."""

from __future__ import annotations

import io
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import Phase  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch import demo  # noqa: E402
from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch._spec import BackendSpec  # noqa: E402
from attn_dispatch.backend import register_backend  # noqa: E402
from attn_dispatch.backend import unregister_backend  # noqa: E402
from attn_dispatch.backends.reference import CAPABILITIES as TORCH_CAPS  # noqa: E402
from attn_dispatch.demo.shapes import DraftShape  # noqa: E402
from attn_dispatch.demo.shapes import TargetShape  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--size", "tiny", "--dtype", "float32", "--max-new-tokens", "7", "--depth", "2"]
TINY += ["--batch", "2", "--progress", "rounds"]


@pytest.fixture
def torch2() -> Iterator[str]:
    """The reference kernels under a second name: a second backend to tell runners apart."""
    register_backend(
        "torch2",
        capabilities=TORCH_CAPS,
        factory="attn_dispatch.backends.reference.backend:TorchBackend",
        replace=True,
    )
    yield "torch2"
    unregister_backend("torch2")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_demo(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = demo.main([*TINY, *argv], out=out, err=out)
    return rc, out.getvalue()


def test_demo_defaults_match_target_greedy() -> None:
    rc, text = run_demo()
    assert rc == 0, text
    assert "identical to target greedy: yes" in text
    assert "each runner dispatched only to its own backends: yes" in text
    assert "round    1:" in text  # progress lines
    assert "acceptance rate:" in text and "tokens/s:" in text


def test_each_runner_dispatches_only_to_its_own_backend(torch2: str) -> None:
    opts = demo.DemoOptions(max_new_tokens=12, depth=3, batch=3, page_size=2)
    with torch.inference_mode():
        target, draft = demo.build(
            opts,
            device="cpu",
            dtype="float32",
            target_spec=BackendSpec.uniform("torch"),
            draft_spec=BackendSpec.uniform(torch2),
            # Attention matters more in this target: a wrong tree mask changes its tokens.
            target_shape=TargetShape(out_scale=0.8, mlp_scale=0.05),
        )
        prompts = demo.prompts_for(opts, target.model.shape.vocab)
        reference = demo.target_greedy(target, prompts, opts.max_new_tokens)
        with record_dispatch() as rec:
            outputs, stats = demo.speculative(target, draft, prompts, opts)
    assert outputs == reference
    layers_t, layers_d = target.model.shape.layers, draft.model.shape.layers
    counts = rec.counts()
    assert set(counts) == {
        ("target", "prefill", "torch"),
        ("target", "verify", "torch"),
        ("draft", "prefill", "torch2"),
        ("draft", "decode", "torch2"),
    }
    # One VERIFY forward per round, one call per layer.
    assert counts[("target", "verify", "torch")] == stats.rounds * layers_t
    assert counts[("target", "prefill", "torch")] == layers_t
    assert counts[("draft", "decode", "torch2")] % layers_d == 0
    assert 0 < stats.accepted < stats.drafted
    assert stats.branch_hits[1] > 0  # paths through the tree's second branch were accepted
    # Rejected and finished requests gave every page back.
    assert target.allocator.num_free == target.num_pages
    assert draft.allocator.num_free == draft.num_pages


def test_greedy_equality_holds_with_rejections_and_one_branch(torch2: str) -> None:
    # A draft that agrees less (its own larger perturbation) forces rejections mid-chain, so the
    # cache compaction and page freeing paths run.
    opts = demo.DemoOptions(max_new_tokens=10, depth=3, branch=1, batch=2, page_size=3, seed=3)
    with torch.inference_mode():
        target, draft = demo.build(
            opts,
            device="cpu",
            dtype="float32",
            target_spec=BackendSpec.uniform(torch2),
            draft_spec=BackendSpec.uniform("torch"),
            target_shape=TargetShape(layers=1, out_scale=0.35, mlp_scale=0.2),
            draft_shape=DraftShape(out_scale=0.3, mlp_scale=0.3),
        )
        prompts = demo.prompts_for(opts, target.model.shape.vocab)
        reference = demo.target_greedy(target, prompts, opts.max_new_tokens)
        outputs, stats = demo.speculative(target, draft, prompts, opts)
    assert outputs == reference
    assert stats.accepted < stats.drafted  # some drafted tokens were rejected


def test_cli_specs_are_used_as_given(torch2: str) -> None:
    rc, text = run_demo("--target-spec", "torch", "--draft-spec", "prefill=torch,decode=torch2")
    assert rc == 0, text
    assert "target  torch    torch   torch" in text
    assert "draft   torch    torch2  torch" in text
    # The draft's prefill (prompt, catch-up) ran on torch, its DECODE steps on torch2.
    assert "draft   decode   torch2" in text
    assert "draft   prefill  torch " in text


def test_cli_unknown_spec_is_an_error_not_a_fallback() -> None:
    rc, text = run_demo("--draft-spec", "nosuchkernel")
    assert rc == 2
    assert "unknown attention backend 'nosuchkernel'" in text


def test_legacy_global_shows_the_leak(torch2: str) -> None:
    rc, text = run_demo("--legacy-global", "--target-spec", "torch", "--draft-spec", torch2)
    assert rc == 1
    assert "draft start-up: global attention_backend = 'torch2' (overwrites 'torch')" in text
    # The target's MLA prefill ran the draft's backend and failed in the kernel.
    assert "target  prefill  torch2   failed" in text
    assert "identical to target greedy: no" in text
    assert "28528" in text


def test_tree_verify_logits_equal_each_path_decoded_alone() -> None:
    # Each node of a verified tree must see the prefix, its ancestors and itself only, at its
    # depth's position: its logits equal a plain forward over prefix + its path.
    from attn_dispatch import Phase
    from attn_dispatch import tree_mask
    from attn_dispatch.demo.runner import SeqKV

    opts = demo.DemoOptions(page_size=3)
    with torch.inference_mode():
        target, _ = demo.build(
            opts,
            device="cpu",
            dtype="float32",
            target_spec=BackendSpec.uniform("torch"),
            draft_spec=BackendSpec.uniform("torch"),
            target_shape=TargetShape(out_scale=1.0, mlp_scale=0.5),  # context matters a lot
        )
        prompt = [5, 17, 33, 2, 71, 9, 40]
        nodes = [11, 12, 13, 14, 15, 16, 17]
        parents = [-1, 0, 1, 0, 3, 4, 1]  # root; two chains and a fork under node 1
        seq = SeqKV()
        target.reserve(seq, len(prompt) + len(nodes))
        demo.step(
            target,
            Phase.PREFILL,
            [demo.Request(list(seq.pages), 0, prompt, list(range(len(prompt))))],
        )
        depth = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        tree, _ = demo.step(
            target,
            Phase.VERIFY,
            [
                demo.Request(
                    list(seq.pages),
                    len(prompt),
                    nodes,
                    [len(prompt) + d for d in depth],
                    tree_mask(parents, prefix_len=len(prompt)),
                )
            ],
        )
        for j in range(len(nodes)):
            path = []
            k = j
            while k >= 0:
                path.append(nodes[k])
                k = parents[k]
            tokens = prompt + path[::-1]
            alone = SeqKV()
            target.reserve(alone, len(tokens))
            logits, _ = demo.step(
                target,
                Phase.PREFILL,
                [demo.Request(list(alone.pages), 0, tokens, list(range(len(tokens))))],
            )
            target.release(alone)
            torch.testing.assert_close(tree[j], logits[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("policy", "forms"),
    [
        ("absorbed", {"mla"}),
        ("default", {"mha"}),  # the reference's policy: decompressed prefill, one shot
        ("chunked", {"mha_chunked"}),
    ],
)
def test_target_forms_give_the_same_tokens(policy: str, forms: set[str]) -> None:
    # The form is the runner's own backend's choice (its form_policy); the model follows
    # attention_form(). A second PREFILL on a cached prefix exercises the prefix paths.
    from attn_dispatch import AttnForm
    from attn_dispatch import Phase
    from attn_dispatch.backend import FormPolicy
    from attn_dispatch.backends.reference.backend import TorchBackend
    from attn_dispatch.demo.layers import greedy
    from attn_dispatch.demo.runner import SeqKV

    chunked = AttnForm.MHA_CHUNKED
    policies = {
        "absorbed": FormPolicy.absorbed_only(),
        "default": None,
        "chunked": FormPolicy(no_prefix=chunked, short_prefix=chunked, long_prefix=chunked),
    }

    from attn_dispatch.backends.reference import DEFAULT_FORM_POLICY

    register_backend(
        "torch_forms",
        capabilities=TORCH_CAPS,
        factory=TorchBackend,
        form_policy=policies[policy] or DEFAULT_FORM_POLICY,  # declared with the entry
        replace=True,
    )
    try:
        opts = demo.DemoOptions(page_size=2)
        results = {}
        with torch.inference_mode():
            for name in ("torch", "torch_forms"):
                target, _ = demo.build(
                    opts,
                    device="cpu",
                    dtype="float32",
                    target_spec=BackendSpec.uniform(name),
                    draft_spec=BackendSpec.uniform("torch"),
                    target_shape=TargetShape(out_scale=0.8),
                )
                with record_dispatch() as rec:
                    seqs = [SeqKV(), SeqKV()]
                    parts = [([3, 1, 4, 1, 5], [9, 2, 6]), ([2, 7, 1], [8, 2, 8, 1])]
                    logits = []
                    for k in range(2):  # the prompt, then more tokens on its cache
                        reqs = []
                        for seq, part in zip(seqs, parts, strict=True):
                            toks = part[k]
                            target.reserve(seq, seq.length + len(toks))
                            pos = list(range(seq.length, seq.length + len(toks)))
                            reqs.append(demo.Request(list(seq.pages), seq.length, toks, pos))
                            seq.length += len(toks)
                        out, _ = demo.step(target, Phase.PREFILL, reqs)
                        logits.append(out)
                results[name] = (torch.cat(logits), {e.form for e in rec.events})
        ref, ref_forms = results["torch"]
        got, got_forms = results["torch_forms"]
        assert got_forms == forms
        assert ref_forms == {"mha"}
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert greedy(got) == greedy(ref)
    finally:
        unregister_backend("torch_forms")


def test_defaults_fill_only_what_the_user_left_out(torch2: str) -> None:
    from attn_dispatch import AttnConfig

    tcfg = AttnConfig(
        kind="mla", num_q_heads=4, num_kv_heads=1, head_dim=80, v_head_dim=64,
        dtype="float32", page_size=4, tree_verify=True,
    )  # fmt: skip
    dcfg = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
    native = demo._binds("native", tcfg) and demo._binds("native", dcfg)
    given = BackendSpec.uniform("nosuchkernel")
    t, d = demo.default_specs(tcfg, dcfg, given, None)
    assert t is given  # a user's choice is never replaced, even one that cannot bind
    t, d = demo.default_specs(tcfg, dcfg, BackendSpec.uniform("torch"), None)
    assert d == BackendSpec.uniform("native" if native else "torch")  # another one if possible
    t, d = demo.default_specs(tcfg, dcfg, None, BackendSpec.uniform(torch2))
    assert d == BackendSpec.uniform(torch2)
    assert t == BackendSpec.uniform("native" if native else "torch")


def _demo_subprocess(
    tmp_path: Path, *argv: str, env: dict[str, str] | None = None, block_numpy: bool = False
) -> subprocess.CompletedProcess[str]:
    paths = [str(ROOT)]
    if block_numpy:
        # A fresh environment has torch but no numpy: `import numpy` fails and
        # importlib.util.find_spec("numpy") is None, as here.
        (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None\n')
        paths.insert(0, str(tmp_path))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}
    if env is None:
        full_env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-m", "attn_dispatch", "demo", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=tmp_path,
        timeout=120,
    )


def test_first_run_without_numpy_prints_no_warning(tmp_path: Path) -> None:
    proc = _demo_subprocess(tmp_path, *TINY, block_numpy=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical to target greedy: yes" in proc.stdout
    assert "warning" not in proc.stderr.lower(), proc.stderr
    # The emulation is real: without the demo's guard torch does warn here.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    assert "NumPy" in probe.stderr


def test_help_documents_every_option(tmp_path: Path) -> None:
    proc = _demo_subprocess(tmp_path, "--help")
    assert proc.returncode == 0
    actions = [a for a in demo.cli.parser()._actions if a.option_strings]
    assert len(actions) >= 17
    for action in actions:
        assert action.help, action.option_strings
        assert action.option_strings[-1] in proc.stdout
    assert "exit status" in proc.stdout


def test_triton_runs_under_the_interpreter_and_says_why_not_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--max-new-tokens", "4", "--target-spec", "triton", "--draft-spec", "triton"]
    # Binding checks availability before it builds (imports) the triton backend.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, text = run_demo(*argv)
    assert rc == 2
    assert "needs a CUDA device, or TRITON_INTERPRET=1" in text
    argv = [*TINY, *argv]
    interp = _demo_subprocess(tmp_path, *argv, env={"TRITON_INTERPRET": "1"})
    assert interp.returncode == 0, interp.stdout + interp.stderr
    assert "target  triton   triton  triton" in interp.stdout
    assert "target  verify   triton   mla" in interp.stdout
    assert "identical to target greedy: yes" in interp.stdout


def test_bfloat16_target_keeps_fp32_attention_and_exact_tokens() -> None:
    rc, text = run_demo("--dtype", "bfloat16", "--max-new-tokens", "12")
    assert rc == 0, text
    assert "dtype bfloat16" in text
    assert "target attention float32, kv dtype target float32" in text
    assert "identical to target greedy: yes" in text


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_cache_runs_on_the_default_backends(kv_dtype: str) -> None:
    rc, text = run_demo("--kv-dtype", kv_dtype)
    assert rc == 0, text
    assert f"kv dtype target {kv_dtype}, draft {kv_dtype} (--kv-dtype)" in text
    # native serves FP8 caches: the target keeps its default backend.
    assert re.search(r"target +native +native +native", text), text
    assert "identical to target greedy: yes" in text


def test_fp8_kv_cache_on_a_forced_backend_that_cannot_run_is_the_bind_error() -> None:
    # flashinfer cannot run on a CPU: the explicit choice is refused, never replaced.
    rc, text = run_demo("--kv-dtype", "float8_e4m3fn", "--target-spec", "flashinfer")
    assert rc == 2, text
    assert text.startswith("error:") and "flashinfer" in text, text


def test_fp8_caches_hold_fp8_with_per_layer_scales_that_never_clip() -> None:
    from attn_dispatch.demo.engine import DemoOptions
    from attn_dispatch.demo.factory import build
    from attn_dispatch.demo.layers import FP8_MAX

    target, draft = build(
        DemoOptions(size="tiny"),
        device="cpu",
        dtype="float32",
        target_spec=None,
        draft_spec=None,
        kv_dtype="float8_e4m3fn",
    )
    tm, dm = target.model, draft.model
    assert tm.make_caches(2, 4, "cpu")[0][0].dtype == torch.float8_e4m3fn
    assert {c.dtype for pair in dm.make_caches(2, 1, "cpu") for c in pair} == {torch.float8_e4m3fn}
    assert all(s is not None and s > 0 for s in tm.k_scales)
    assert len(set(tm.k_scales)) == len(tm.k_scales)  # one per layer
    # The scale bounds what a layer writes: no stored value reaches the format's edge.
    from attn_dispatch import AttnBatch
    from attn_dispatch import Phase

    tokens = torch.randint(0, tm.shape.vocab, (24,), generator=torch.Generator().manual_seed(0))
    pages = list(range(24 // target.page_size))
    batch = AttnBatch.build(
        Phase.PREFILL,
        q_lens=[24],
        kv_lens=[24],
        page_tables=[pages],
        page_size=target.page_size,
        num_pages=target.num_pages,
    )
    with torch.inference_mode():
        target.forward(batch, tokens.tolist(), list(range(24)), target.rows(pages, range(24)))
    peak = max(float(k.float().abs().max()) for k, _ in target.caches)
    assert 0.0 < peak < FP8_MAX[torch.float8_e4m3fn]


def test_report_shows_per_forward_times_and_the_speedup() -> None:
    rc, text = run_demo()
    assert rc == 0, text
    for row in ("target          prefill", "target          verify", "target, greedy  decode"):
        assert re.search(rf"{row} +\d+ +\d+\.\d\d", text), text
    assert re.search(r"draft           decode +\d+ +\d+\.\d\d", text), text
    assert re.search(r"a draft decode costs (1/\d+|\d+\.\d\dx) of a target decode", text)
    m = re.search(
        r"tokens/s: ([\d.]+) speculative, ([\d.]+) target-only greedy .*: speedup ([\d.]+)x", text
    )
    assert m, text
    spec, greedy, speedup = (float(g) for g in m.groups())
    assert speedup == pytest.approx(spec / greedy, abs=0.01)
    # The greedy reference ran on the target's binding too (its decode calls).
    assert (
        re.search(r"target  decode   torch    -     \d+", text) or "target  decode   native" in text
    )


def test_default_size_is_the_weight_bound_target() -> None:
    args = demo.cli.parser().parse_args([])
    assert args.size == "base"
    shape = demo.sizes()["base"].target
    assert 100e6 <= shape.params <= 200e6
    draft = demo.sizes()["base"].draft
    assert draft.params(shape.rank, shape.vocab) * 10 <= shape.params


def test_auto_dtype_is_one_of_the_measured() -> None:
    from attn_dispatch.demo.factory import choose_dtype

    dtype, why = choose_dtype("base", "cpu", hidden=256, mlp=512, rows=2)
    assert dtype in ("float32", "bfloat16")
    assert "float32" in why and "bfloat16" in why
    assert torch.backends.cpu.get_cpu_capability() in why
    # The verify's rows are timed too (a 2-row win alone once picked a dtype whose verify
    # forwards were slow).
    dtype, why = choose_dtype("base", "cpu", hidden=256, mlp=512, rows=2, verify_rows=18)
    assert dtype in ("float32", "bfloat16")
    assert "[2x256] and [18x256]" in why and why.count(" + ") == 2


def test_accept_walks_the_longest_agreeing_path() -> None:
    from attn_dispatch.demo.engine import Tree
    from attn_dispatch.demo.engine import accept

    tree = Tree(chains=[[7, 8, 9], [5, 6, 4]], pages=[[], []])
    nodes, parents, depths = tree.flatten(root=1)
    assert nodes == [1, 7, 8, 9, 5, 6, 4]
    assert parents == [-1, 0, 1, 2, 0, 4, 5]
    assert depths == [0, 1, 2, 3, 1, 2, 3]
    # The target picks 5 after the root, 6 after 5, then 3 (not the drafted 4).
    choice = [5, 0, 0, 0, 6, 3, 0]
    v = accept(nodes, parents, choice)
    assert v.accepted == [4, 5] and v.bonus == 3
    assert accept(nodes, parents, [2, 0, 0, 0, 0, 0, 0]).accepted == []


def test_legacy_runner_reads_the_global_at_forward_time(torch2: str) -> None:
    from attn_dispatch.demo.legacy import LegacyGlobals
    from attn_dispatch.demo.legacy import LegacyRunner

    legacy = LegacyGlobals()
    opts = demo.DemoOptions(max_new_tokens=4)
    with torch.inference_mode():
        target, draft = demo.build(
            opts,
            device="cpu",
            dtype="float32",
            target_spec=BackendSpec.uniform("torch"),
            draft_spec=BackendSpec.uniform(torch2),
            legacy=legacy,
        )
        assert isinstance(target, LegacyRunner) and isinstance(draft, LegacyRunner)
        assert legacy.attention_backend == torch2  # the draft started last
        with pytest.raises(Exception):  # noqa: B017 - whatever the wrong kernel raises
            demo.speculative(target, draft, demo.prompts_for(opts, 96), opts)
    assert legacy.log[("target", "prefill", torch2, "failed")] == 1
    assert not any(k[2] == "torch" for k in legacy.log)  # the target's own choice never ran


def test_progress_bar_draws_on_its_stream_after_the_delay() -> None:
    from attn_dispatch.demo.report import Bar

    stream = io.StringIO()
    bar = Bar(stream, enabled=True, delay=0.0)
    bar.start("greedy")
    bar(3, 12)
    assert "greedy" in stream.getvalue() and "3/12 tokens" in stream.getvalue()
    bar.clear()
    quiet = io.StringIO()
    Bar(quiet, enabled=True, delay=60.0)(3, 12)
    assert quiet.getvalue() == ""


def test_race_gives_each_decoding_its_own_output_and_time() -> None:
    from attn_dispatch.demo import engine
    from attn_dispatch.demo.compare import race
    from attn_dispatch.demo.runner import Runner

    opts = demo.DemoOptions(max_new_tokens=9, depth=2)
    with torch.inference_mode():
        target, draft = demo.build(
            opts, device="cpu", dtype="float32", target_spec=None, draft_spec=None
        )
        alone = Runner("target", target.model, target.attn_binding, num_pages=target.num_pages)
        prompts = demo.prompts_for(opts, target.model.shape.vocab)
        stats = engine.Stats()
        seen: list[int] = []
        outs, seconds = race(
            {
                "spec": engine.speculative_steps(target, draft, prompts, opts, stats),
                "greedy": engine.greedy_steps(alone, prompts, opts.max_new_tokens),
            },
            2 * opts.max_new_tokens,
            lambda done, total: seen.append(done),
        )
        solo_out, solo_stats = demo.speculative(target, draft, prompts, opts)
        solo_ref = demo.target_greedy(alone, prompts, opts.max_new_tokens)
    ref, out = outs["greedy"], outs["spec"]
    assert ref == solo_ref and out == solo_out == ref
    assert stats.rounds == solo_stats.rounds and stats.accepted == solo_stats.accepted
    assert stats.accepts == solo_stats.accepts and stats.drafted == opts.depth * len(stats.accepts)
    assert seconds["greedy"] > 0 and seconds["spec"] > 0
    assert seen == sorted(seen) and seen[-1] == 2 * 2 * opts.max_new_tokens
    # Every page went back to both runners' free lists.
    for r in (target, alone, draft):
        assert r.allocator.num_free == r.num_pages


def test_a_full_cache_is_an_error_with_its_numbers() -> None:
    from attn_dispatch.demo.runner import CacheFullError
    from attn_dispatch.demo.runner import PageAllocator

    pool = PageAllocator(3, "target")
    assert pool.alloc(2) == [0, 1]
    with pytest.raises(CacheFullError) as info:
        pool.alloc(2)
    assert isinstance(info.value, MemoryError)
    assert (info.value.requested, info.value.free, info.value.num_pages) == (2, 1, 3)
    assert pool.num_free == 1  # the failed request took nothing
    rc, text = run_demo("--num-pages", "3")
    assert rc == 2
    assert "pages requested" in text and "--num-pages" in text


def test_isolation_line_says_no_when_a_runner_dispatches_outside_its_spec(
    torch2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The target's spec names torch, but its layers reach a binding on torch2: the report reads
    # the target's own record_dispatch events, so it says no (and the exit status is 1).
    from attn_dispatch.demo import factory

    real_bind = factory.bind

    def leaky_bind(spec: Any, config: Any, **kwargs: Any) -> Any:
        return real_bind(torch2 if kwargs.get("label") == "target" else spec, config, **kwargs)

    monkeypatch.setattr(factory, "bind", leaky_bind)
    rc, text = run_demo("--target-spec", "torch", "--draft-spec", "torch")
    assert rc == 1, text
    assert "each runner dispatched only to its own backends: no" in text
    assert re.search(r"runner 'target' verify: \d+ calls to 'torch2' as 'target' \(its spec", text)
    assert "runner 'draft'" not in text  # the draft stayed on its own backend


def test_isolation_is_read_per_runner_forward_not_from_the_event_label(torch2: str) -> None:
    # Runner "a" opens runner "b"'s scope: every event says "b" on b's backend, which agrees
    # with b's spec; only attributing events to the forward that made them catches it.
    from attn_dispatch import Phase
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch.demo.report import isolation_line
    from attn_dispatch.demo.report import leaks
    from attn_dispatch.demo.runner import Runner
    from attn_dispatch.demo.runner import SeqKV

    opts = demo.DemoOptions()
    with torch.inference_mode():
        _, draft = demo.build(
            opts, device="cpu", dtype="float32", target_spec=None, draft_spec=None
        )
        cfg = draft.attn_binding.config
        a = Runner("a", draft.model, bind("torch", cfg, label="a"), num_pages=16)
        b = Runner("b", draft.model, bind(torch2, cfg, label="b"), num_pages=16)
        seq = SeqKV()
        a.reserve(seq, 3)
        req = demo.Request(list(seq.pages), 0, [1, 2, 3], [0, 1, 2])
        demo.step(a, Phase.PREFILL, [req])
        assert leaks([a, b]) == []
        assert isolation_line([]).endswith(": yes")
        a.scope = lambda batch: attn_scope(b, batch)  # type: ignore[method-assign]
        demo.step(a, Phase.PREFILL, [req])
    found = leaks([a, b])
    assert len(found) == 1
    assert found[0].startswith("runner 'a' prefill:") and "'torch2' as 'b'" in found[0]
    assert isolation_line(found).startswith("each runner dispatched only to its own backends: no")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--device", "cuda:abc"], "--device='cuda:abc': not a device name"),
        (["--device", "meta"], "the demo runs on 'cpu' or 'cuda[:N]'"),
        (["--seed", "99999999999999999999999"], "must be in [0, 2**62)"),
        (["--target-spec", "prefill="], "no backend for decode"),
        (["--num-pages", "1"], "pages requested"),
        (["--shared-prefix", "-1"], "--shared-prefix: must be >= 0, got -1"),
    ],
)
def test_bad_input_is_one_error_line_without_a_traceback(
    tmp_path: Path, argv: list[str], words: str
) -> None:
    proc = _demo_subprocess(tmp_path, *TINY, *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert words in proc.stderr, proc.stderr


def test_cuda_device_without_cuda_is_our_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the device is valid here")
    rc, text = run_demo("--device", "cuda")
    assert rc == 2
    assert text.startswith("error: --device='cuda': CUDA is not available on this machine")


def _imports(path: Path, package: str, known: set[str]) -> set[str]:
    """Every ``package`` module ``path`` imports, at any level (function bodies too): the
    suite's one scanner (tests/imports.py)."""
    from tests.imports import path_imports

    name = package if path.stem == "__init__" else f"{package}.{path.stem}"
    return path_imports(path, name, known, prefix=package)


def test_demo_modules_are_small_and_import_no_cycle() -> None:
    package = "attn_dispatch.demo"
    folder = ROOT / "attn_dispatch" / "demo"
    modules = {
        (package if p.stem == "__init__" else f"{package}.{p.stem}"): p for p in folder.glob("*.py")
    }
    for name, path in modules.items():
        assert len(path.read_text().splitlines()) <= 400, name
    graph = {
        name: _imports(path, package, set(modules)) & set(modules) for name, path in modules.items()
    }
    assert "attn_dispatch.demo.cli" in graph[package]  # the package re-exports main

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [name for name in graph if reaches(name, name, {name})]
    assert cycles == [], {n: sorted(graph[n]) for n in cycles}


def _spy_tables(runner: Any) -> list[tuple[Phase, list[list[int]]]]:
    """Record the phase and page tables of every forward of ``runner``."""
    seen: list[tuple[Phase, list[list[int]]]] = []
    forward = runner.forward

    def spy(batch: Any, *args: Any) -> Any:
        ptr, idx = batch.kv_indptr.tolist(), batch.kv_indices.tolist()
        seen.append((batch.phase, [idx[a:b] for a, b in itertools.pairwise(ptr)]))
        return forward(batch, *args)

    runner.forward = spy
    return seen


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_shared_prefix_is_one_copy_and_decodes_the_tokens_of_private_copies(backend: str) -> None:
    from attn_dispatch.demo import engine
    from attn_dispatch.demo.runner import Runner

    opts = demo.DemoOptions(max_new_tokens=6, batch=3, page_size=4, shared_prefix=10)
    shared_pages = opts.shared_prefix // opts.page_size  # whole pages only: 2
    with torch.inference_mode():
        target, _ = demo.build(
            opts, device="cpu", dtype="float32", target_spec=None, draft_spec=None
        )
        if not demo._binds(backend, target.attn_binding.config):
            pytest.skip(f"the {backend} backend cannot serve the demo's target here")
        spec = BackendSpec.uniform(backend)
        binding = bind(spec, target.attn_binding.config, label="target")
        shared = Runner("target", target.model, binding, num_pages=target.num_pages, spec=spec)
        private = Runner("target", target.model, binding, num_pages=target.num_pages, spec=spec)
        prompts = demo.prompts_for(opts, target.model.shape.vocab)
        tables = {"shared": _spy_tables(shared), "private": _spy_tables(private)}
        out_shared = engine.target_greedy(shared, prompts, opts.max_new_tokens, opts.shared_prefix)
        *_, out_private = engine.greedy_steps(
            private, prompts, opts.max_new_tokens, opts.shared_prefix, private=True
        )
    # One system prompt, then each request's own (different) tokens.
    assert all(p[:10] == prompts[0][:10] for p in prompts)
    assert len({tuple(p[10:13]) for p in prompts}) == 3
    assert out_shared == out_private
    # The prefix's whole pages are written once, by a PREFILL of their own ...
    phase, first = tables["shared"][0]
    assert phase is Phase.PREFILL and len(first) == 1 and len(first[0]) == shared_pages
    # ... and every later page table starts with those page ids; private tables do not share.
    for phase, reqs in tables["shared"][1:]:
        assert all(t[:shared_pages] == first[0] for t in reqs), (phase, reqs)
    for phase, reqs in tables["private"][1:]:
        heads = [tuple(t[:shared_pages]) for t in reqs]
        assert len(set(heads)) == len(heads), (phase, reqs)
    assert private.allocator.peak - shared.allocator.peak == (opts.batch - 1) * shared_pages
    for r in (shared, private):
        assert r.allocator.num_free == r.num_pages  # shared pages freed once, at the end


def test_speculative_decoding_over_a_shared_prefix_equals_private_greedy() -> None:
    from attn_dispatch.demo import engine
    from attn_dispatch.demo.runner import Runner

    opts = demo.DemoOptions(max_new_tokens=8, batch=2, depth=2, page_size=3, shared_prefix=7)
    with torch.inference_mode():
        target, draft = demo.build(
            opts, device="cpu", dtype="float32", target_spec=None, draft_spec=None
        )
        prompts = demo.prompts_for(opts, target.model.shape.vocab)
        draft_tables = _spy_tables(draft)
        outputs, stats = demo.speculative(target, draft, prompts, opts)
        alone = Runner("target", target.model, target.attn_binding, num_pages=target.num_pages)
        *_, reference = engine.greedy_steps(alone, prompts, opts.max_new_tokens, 7, private=True)
    assert stats.rounds > 0 and outputs == reference
    # The draft (page_size 1) shares all 7 prefix pages.
    _, first = draft_tables[0]
    assert len(first) == 1 and len(first[0]) == 7
    assert all(t[:7] == first[0] for _, reqs in draft_tables[1:] for t in reqs)
    for r in (target, draft, alone):
        assert r.allocator.num_free == r.num_pages


def test_demo_shared_prefix_prints_what_sharing_saved() -> None:
    rc, text = run_demo("--shared-prefix", "9", "--batch", "3")
    assert rc == 0, text
    assert "identical to target greedy: yes" in text
    assert "tokens identical with and without sharing: yes" in text
    assert "each runner dispatched only to its own backends: yes" in text
    assert re.search(
        r"target: its 2 whole pages of 4 tokens are the same page ids in all 3 page tables, "
        r"written once: 4 pages \([\d.]+ KiB\) saved",
        text,
    ), text
    assert re.search(r"draft: 9 pages of 1 token shared the same way: 18 pages", text), text
    assert re.search(r"shared pages +as bound +\d+ +\d+\.\d+ +\d+\.\d+", text), text
    assert re.search(r"private copies +- +\d+ +\d+\.\d+ +\d+\.\d+", text), text
    assert re.search(r"run side by side taking turns \(native \w+; ms: medians\)", text), text
    assert re.search(r"vs private copies: attention \d+\.\d\dx, whole forward \d+\.\d\dx", text)
    # Cascade on/off: measured where the native backend has the option, else said so (no number).
    off_row = re.search(r"shared pages +off +\d+", text)
    off_ratio = re.search(r"vs shared pages with cascade=False: attention \d+\.\d\dx", text)
    unmeasured = "cascade on/off not measured: this native backend has no cascade option" in text
    assert (bool(off_row) and bool(off_ratio)) != unmeasured, text


def test_cascade_off_names_why_it_cannot_be_measured() -> None:
    from attn_dispatch.demo.compare import cascade_off

    opts = demo.DemoOptions()
    with torch.inference_mode():
        target, _ = demo.build(
            opts,
            device="cpu",
            dtype="float32",
            target_spec=BackendSpec.uniform("torch"),
            draft_spec=None,
        )
    binding, why = cascade_off(target)
    assert binding is None and why.startswith("the target decodes on 'torch'")


@pytest.mark.parametrize(("field", "value"), [("shared_prefix", -1), ("batch", 0), ("depth", 1.5)])
def test_demo_options_refuse_bad_counts(field: str, value: object) -> None:
    from attn_dispatch import InvalidSpecError

    with pytest.raises(InvalidSpecError, match=field) as info:
        demo.DemoOptions(**{field: value})
    assert info.value.field == field and info.value.value == value


def test_demo_shared_prefix_shorter_than_a_page_shares_no_target_page() -> None:
    rc, text = run_demo("--shared-prefix", "3", "--target-spec", "torch")
    assert rc == 0, text
    assert "target: its 0 whole pages of 4 tokens" in text and "0 pages (0.0 KiB) saved" in text
    assert "draft: 3 pages of 1 token shared the same way: 3 pages" in text
    assert "no ratio: the system prompt fills no whole page of 4 tokens" in text
    assert "vs private copies:" not in text
    assert "tokens identical with and without sharing: yes" in text
