"""attention() inside torch.compile(fullgraph=True): one opaque op, resolved at run time.

Most compiles use Dynamo's CompileCounter backend (it runs the captured FX graph as is): what is
under test is Dynamo's tracing (no graph break, one graph, no recompile per runner), not
Inductor's code generation, which costs tens of seconds per graph on this 2-core machine.
One test uses "aot_eager", which also runs the op's fake implementation through AOTAutograd
and functionalization, as Inductor would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import attn_dispatch
import attn_dispatch.compile as adc
from attn_dispatch import InvalidBatchError
from attn_dispatch import NoActiveScopeError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch
from tests.scale_helpers import mha_config
from tests.scale_helpers import mla_config
from tests.scale_helpers import paged
from tests.scale_helpers import register_scaled


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def scaled() -> Iterator[str]:
    yield from register_scaled("test-compile-x3", 3.0)


def layer(q: torch.Tensor, k: Any, v: Any, scale: float) -> torch.Tensor:
    # Work on both sides of the op, so a break would split the graph visibly.
    out: torch.Tensor = attention(q * 1.5, k, v, sm_scale=scale)
    return torch.tanh(out) + out.sum()


def eager_layer(binding: Any, p: Any) -> Any:
    with attn_scope(binding, p.batch):
        return layer(p.q, p.k_cache, p.v_cache, p.sm_scale)


def test_fullgraph_has_no_graph_break() -> None:
    p = paged(mha_config(), Phase.DECODE, [1, 1, 1], [3, 9, 5])
    binding = bind("torch", p.config, label="target")
    with attn_scope(binding, p.batch):
        explained = torch._dynamo.explain(layer)(p.q, p.k_cache, p.v_cache, p.sm_scale)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [n.target for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.attn_dispatch.attention.default in targets or (
        torch.ops.attn_dispatch.attention in targets
    )


def test_plain_compile_without_the_op_would_break() -> None:
    # Why the op exists: the scope lookup itself is not traceable.
    from attn_dispatch import current_binding

    def reads_scope(q: torch.Tensor) -> torch.Tensor:
        return q * float(current_binding().config.num_q_heads)

    p = paged(mha_config(), Phase.DECODE, [1], [3])
    binding = bind("torch", p.config)
    compiled = torch.compile(reads_scope, fullgraph=True, backend="eager")
    with attn_scope(binding, p.batch), pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(p.q)


def test_aot_eager_fullgraph_matches_eager_prefill_and_decode() -> None:
    cfg = mha_config()
    binding = bind("torch", cfg, label="target")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for phase, q_lens, kv_lens in [
        (Phase.PREFILL, [3, 2], [3, 7]),
        (Phase.DECODE, [1, 1, 1], [4, 9, 2]),
    ]:
        p = paged(cfg, phase, q_lens, kv_lens, seed=len(q_lens))
        want = eager_layer(binding, p)
        with attn_scope(binding, p.batch):
            got = compiled(p.q, p.k_cache, p.v_cache, p.sm_scale)
        torch.testing.assert_close(got, want)


def test_two_runners_share_one_compiled_function(scaled: str) -> None:
    cfg = mha_config()
    target = bind("torch", cfg, label="target")
    draft = bind(scaled, cfg, label="draft")
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    p = paged(cfg, Phase.DECODE, [1, 1], [6, 3])

    def attn_only(runner: Any) -> Any:
        with attn_scope(runner, p.batch):
            return attention(p.q, p.k_cache, p.v_cache, sm_scale=p.sm_scale)

    base = attn_only(target)
    with record_dispatch() as rec:
        outs = []
        for runner in (target, draft, target, draft):
            with attn_scope(runner, p.batch):
                outs.append(compiled(p.q, p.k_cache, p.v_cache, p.sm_scale))
    # Each call ran its own runner's kernel: the scaled one gives 3x the attention output.
    torch.testing.assert_close(outs[0], eager_layer(target, p))
    torch.testing.assert_close(outs[1], eager_layer(draft, p))
    torch.testing.assert_close(outs[2], outs[0])
    torch.testing.assert_close(outs[3], outs[1])
    assert not torch.allclose(outs[0], outs[1])
    torch.testing.assert_close(attn_only(draft), base * 3.0)
    # One trace served both runners: dispatch happened at run time, not at trace time.
    assert counter.frame_count == 1
    assert rec.counts() == {("target", "decode", "torch"): 2, ("draft", "decode", scaled): 2}


def test_compiled_call_resolves_at_run_time_outside_a_scope_raises() -> None:
    p = paged(mha_config(), Phase.DECODE, [1], [5])
    binding = bind("torch", p.config)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    with attn_scope(binding, p.batch):
        compiled(p.q, p.k_cache, p.v_cache, p.sm_scale)
    with pytest.raises(NoActiveScopeError):
        compiled(p.q, p.k_cache, p.v_cache, p.sm_scale)
    assert counter.frame_count == 1


def test_mla_needs_v_head_dim_and_compiles_with_it() -> None:
    cfg = mla_config()
    p = paged(cfg, Phase.VERIFY, [2, 3], [5, 8])
    binding = bind("torch", cfg, label="mla")
    with attn_scope(binding, p.batch):
        want = attention(p.q, p.k_cache, None, sm_scale=p.sm_scale)  # eager: no width needed

        def mla_layer(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return adc.attention_op(q, k, None, sm_scale=p.sm_scale, v_head_dim=8) * 2

        got = torch.compile(mla_layer, fullgraph=True, backend="aot_eager")(p.q, p.k_cache)
        torch.testing.assert_close(got, want * 2)
        assert got.shape == (5, 2, 8)
        with pytest.raises(InvalidBatchError, match="v_head_dim"):
            adc.attention_op(p.q, p.k_cache, None, sm_scale=p.sm_scale)
        # A width that disagrees with the backend's output is refused, never misread.
        with pytest.raises(InvalidBatchError, match=r"expects \(5, 2, 6\)"):
            adc.attention_op(p.q, p.k_cache, None, sm_scale=p.sm_scale, v_head_dim=6)


def test_op_registration_passes_opcheck() -> None:
    p = paged(mha_config(), Phase.PREFILL, [2, 1], [4, 6])
    binding = bind("torch", p.config)
    with attn_scope(binding, p.batch):
        torch.library.opcheck(
            torch.ops.attn_dispatch.attention.default,
            (p.q, p.k_cache, p.v_cache, p.sm_scale, p.config.v_head_dim),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
        )


def test_eager_attention_is_untouched() -> None:
    # The substitution applies only while Dynamo traces; eager callers keep the plain function.
    from attn_dispatch import _scope

    assert attn_dispatch.attention is _scope.attention
    p = paged(mla_config(), Phase.DECODE, [1], [3])
    with attn_scope(bind("torch", p.config), p.batch):
        out = attention(p.q, p.k_cache, None, sm_scale=p.sm_scale)
    assert out.shape == (1, 2, 8)


def test_op_is_kept_out_of_inductor_cuda_graphs() -> None:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert tag in torch.ops.attn_dispatch.attention.default.tags


def test_mla_attention_without_width_names_the_fix_or_falls_back() -> None:
    cfg = mla_config()
    p = paged(cfg, Phase.DECODE, [1, 1], [3, 6])
    binding = bind("torch", cfg)

    def mla(q: torch.Tensor, k: torch.Tensor) -> Any:
        return attention(q, k, None, sm_scale=p.sm_scale)

    with attn_scope(binding, p.batch):
        want = mla(p.q, p.k_cache)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"v_head_dim=<config\.v_head_dim>"):
            torch.compile(mla, fullgraph=True, backend="eager")(p.q, p.k_cache)
        torch._dynamo.reset()
        # Without fullgraph it is one graph break around the plain eager call.
        got = torch.compile(mla, backend="eager")(p.q, p.k_cache)
    torch.testing.assert_close(got, want)


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


_COMPILE_AND_RUN = """
from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, attn_scope, bind
cfg = AttnConfig(kind="mha", num_q_heads=2, num_kv_heads=1, head_dim=4, dtype="float32")
b = bind("torch", cfg)
batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[2], page_tables=[[0, 1]], page_size=1)
q, k = torch.randn(1, 2, 4), torch.randn(2, 1, 1, 4)
f = torch.compile(lambda q, k: attention(q, k, k, sm_scale=0.5), fullgraph=True, backend="eager")
with attn_scope(b, batch):
    torch.testing.assert_close(f(q, k), attention(q, k, k, sm_scale=0.5))
print("OK")
"""


def test_fullgraph_works_after_a_plain_import() -> None:
    # No `import attn_dispatch.compile`: the op is registered when Dynamo loads (torch.compile
    # loads it), and not before: importing the package or binding loads neither Dynamo nor
    # triton (which must not load before TRITON_INTERPRET is chosen) nor the op.
    proc = _fresh(
        "import sys, torch, attn_dispatch\n"
        "from attn_dispatch import AttnConfig, bind\n"
        "bind('torch', AttnConfig('mha', 2, 1, 4, dtype='float32'))\n"
        "for name in ('torch._dynamo', 'triton', 'attn_dispatch.compile'):\n"
        "    assert name not in sys.modules, name\n"
        "assert not hasattr(torch.ops.attn_dispatch, 'attention')\n" + _COMPILE_AND_RUN
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_fullgraph_works_when_dynamo_was_loaded_first() -> None:
    proc = _fresh(
        "import sys, torch, torch._dynamo\n"
        "import attn_dispatch\n"
        "assert 'attn_dispatch.compile' in sys.modules  # registered at import\n"
        "assert not any(type(f).__name__ == '_DynamoFinder' for f in sys.meta_path)\n"
        + _COMPILE_AND_RUN
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_the_explicit_import_still_works_and_the_finder_leaves_after_one_import() -> None:
    proc = _fresh(
        "import sys, torch, attn_dispatch\n"
        "assert sum(type(f).__name__ == '_DynamoFinder' for f in sys.meta_path) == 1\n"
        "import attn_dispatch.compile\n"
        "assert not any(type(f).__name__ == '_DynamoFinder' for f in sys.meta_path)\n"
        + _COMPILE_AND_RUN
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_a_failed_registration_names_the_line_to_add_and_spares_dynamo() -> None:
    # Registration must never break torch.compile for other code: Dynamo still loads, and a
    # RuntimeWarning names the one line that shows the full error.
    proc = _fresh(
        "import sys, warnings, torch, attn_dispatch\n"
        "sys.modules['attn_dispatch.compile'] = None  # its import now fails\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch._dynamo\n"
        "(w,) = [w for w in caught if w.category is RuntimeWarning]\n"
        "assert 'import attn_dispatch.compile' in str(w.message), w.message\n"
        "f = torch.compile(lambda x: x + 1, fullgraph=True, backend='eager')\n"
        "assert f(torch.ones(1)) == 2\n"
        "print('OK')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_compiled_and_eager_attention_take_the_same_arguments() -> None:
    import inspect

    eager = inspect.signature(attention)
    assert inspect.signature(adc._attention_in_graph) == eager
    assert list(eager.parameters) == ["q", "k_cache", "v_cache", "sm_scale", "group", "extras"]


def test_compiled_call_takes_the_scale_from_the_config() -> None:
    cfg = mha_config().replace(sm_scale=0.3)
    p = paged(cfg, Phase.DECODE, [1, 1], [3, 7])
    binding = bind("torch", cfg)

    def no_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v) * 2  # type: ignore[no-any-return]

    with attn_scope(binding, p.batch):
        want = attention(p.q, p.k_cache, p.v_cache, sm_scale=0.3) * 2
        got = torch.compile(no_scale, fullgraph=True, backend="eager")(p.q, p.k_cache, p.v_cache)
        torch.testing.assert_close(got, want)
        # The op itself takes the config's scale too.
        got_w = adc.attention_op(p.q, p.k_cache, p.v_cache, v_head_dim=cfg.v_head_dim)
        torch.testing.assert_close(got_w * 2, want)
    with attn_scope(bind("torch", mha_config()), p.batch):
        with pytest.raises(InvalidBatchError, match="sm_scale"):
            adc.attention_op(p.q, p.k_cache, p.v_cache)


# -- issue 24: the attention state (return_lse=True) through the op ---------------------------


def lse_layer(q: torch.Tensor, k: Any, v: Any, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention(q * 1.5, k, v, sm_scale=scale, return_lse=True)
    return torch.tanh(out) + out.sum(), lse * 2


def test_return_lse_compiles_fullgraph_and_matches_eager() -> None:
    cfg = mha_config().replace(return_lse=True)
    binding = bind("torch", cfg, label="target")
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lse_layer, fullgraph=True, backend=counter)
    aot = torch.compile(lse_layer, fullgraph=True, backend="aot_eager")
    for phase, q_lens, kv_lens in [
        (Phase.PREFILL, [3, 2], [3, 7]),
        (Phase.DECODE, [1, 1, 1], [4, 9, 2]),
    ]:
        p = paged(cfg, phase, q_lens, kv_lens, seed=len(q_lens))
        with attn_scope(binding, p.batch):
            want = lse_layer(p.q, p.k_cache, p.v_cache, p.sm_scale)
            got = compiled(p.q, p.k_cache, p.v_cache, p.sm_scale)
            got_aot = aot(p.q, p.k_cache, p.v_cache, p.sm_scale)
        for g in (got, got_aot):
            torch.testing.assert_close(g[0], want[0])
            torch.testing.assert_close(g[1], want[1])
        assert got[1].dtype == torch.float32 and got[1].shape == (sum(q_lens), 4)
    assert counter.frame_count >= 1
    p = paged(cfg, Phase.DECODE, [1], [3])
    with attn_scope(binding, p.batch):
        explained = torch._dynamo.explain(lse_layer)(p.q, p.k_cache, p.v_cache, p.sm_scale)
    assert explained.graph_break_count == 0, explained.break_reasons
    targets = [n.target for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.attn_dispatch.attention_lse.default in targets


def test_return_lse_op_opcheck_and_refusals() -> None:
    cfg = mha_config().replace(return_lse=True)
    p = paged(cfg, Phase.PREFILL, [2, 1], [4, 6])
    with attn_scope(bind("torch", cfg), p.batch):
        torch.library.opcheck(
            torch.ops.attn_dispatch.attention_lse.default,
            (p.q, p.k_cache, p.v_cache, p.sm_scale, cfg.v_head_dim),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
        )
        out, lse = adc.attention_op(p.q, p.k_cache, p.v_cache, sm_scale=p.sm_scale, return_lse=True)
        want_out, want_lse = attention(
            p.q, p.k_cache, p.v_cache, sm_scale=p.sm_scale, return_lse=True
        )
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
        with pytest.raises(InvalidBatchError) as info:
            adc.attention_op(p.q, p.k_cache, p.v_cache, sm_scale=p.sm_scale, return_lse=1)  # type: ignore[arg-type]
        assert info.value.field == "return_lse"
    # A config without return_lse refuses the state in compiled code too.
    plain = mha_config()
    with attn_scope(bind("torch", plain), p.batch):
        with pytest.raises(InvalidBatchError, match=r"AttnConfig\(return_lse=True\)"):
            adc.attention_op(p.q, p.k_cache, p.v_cache, sm_scale=p.sm_scale, return_lse=True)
