"""The speculative-decoding demo, end to end at a tiny size."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import demo  # noqa: E402
from attn_dispatch import record_dispatch  # noqa: E402
from attn_dispatch import register_backend  # noqa: E402
from attn_dispatch import unregister_backend  # noqa: E402
from attn_dispatch._demo_models import DraftShape  # noqa: E402
from attn_dispatch._demo_models import TargetShape  # noqa: E402
from attn_dispatch._spec import BackendSpec  # noqa: E402
from attn_dispatch.backends.reference import CAPABILITIES as TORCH_CAPS  # noqa: E402

TINY = ["--max-new-tokens", "7", "--depth", "2", "--batch", "2", "--progress", "on"]


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
    rc = demo.main([*TINY, *argv], out=out)
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
            outputs, stats = demo.speculative(target, draft, prompts, opts, io.StringIO())
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
        outputs, stats = demo.speculative(target, draft, prompts, opts, io.StringIO())
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
    from attn_dispatch._demo_models import SeqKV

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
    from attn_dispatch import FormPolicy
    from attn_dispatch import Phase
    from attn_dispatch._demo_models import SeqKV
    from attn_dispatch._demo_models import greedy
    from attn_dispatch.backends.reference.backend import TorchBackend

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
