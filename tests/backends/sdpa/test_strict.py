"""The sdpa backend held to the rules every backend follows (issue 44, item 2).

- rows that see no key are an empty state: LSE -inf (the fused kernels say 0), output 0;
  with sinks the LSE is the sink and the output stays 0, as in the reference backend;
- the LSE is float32 whatever the inputs or torch's default dtype;
- K/V views of a larger storage are read only where the view reaches (the in-place path
  reads the cache through ``as_strided``, which could reach the whole storage);
- prefix chunks of the chunked MLA form with too few rows or other heads are refused, not
  answered from fewer keys.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch.backends.reference.backend import TorchBackend
from attn_dispatch.backends.sdpa.backend import SdpaBackend

ROOT = Path(__file__).resolve().parents[3]


def _tree_batch_with_an_empty_row() -> AttnBatch:
    # Built with a valid mask, then edited in place (the batch's tensors are the caller's):
    # the plan's snapshot copies the edited mask, whose second row allows no key.
    built = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    batch = AttnBatch.build(Phase.VERIFY, q_lens=[2], kv_lens=[6], page_tables=[[1, 0]],
                            page_size=4, num_pages=2, masks=[built])  # fmt: skip
    empty_row = built.clone()
    empty_row[1] = False
    assert batch.custom_mask is not None
    batch.custom_mask.copy_(empty_row.flatten())
    return batch


@pytest.mark.parametrize("sinks", [False, True])
def test_a_row_that_sees_no_key_is_an_empty_state(sinks: bool) -> None:
    cfg = AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=4, device="cpu",
                     tree_verify=True, sinks=sinks, return_lse=True)  # fmt: skip
    batch = _tree_batch_with_an_empty_row()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=g)
    k, v = torch.randn(2, 4, 2, 16, generator=g), torch.randn(2, 4, 2, 16, generator=g)
    extra = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])} if sinks else {}
    got = {}
    for backend in (SdpaBackend(cfg), TorchBackend(cfg)):
        run: Any = backend.handler(Phase.VERIFY)
        got[backend.name] = run(q, k, v, backend.plan(batch), 0.25, return_lse=True, **extra)
    out, lse = got["sdpa"]
    assert lse.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    want_row = extra["sinks"] if sinks else torch.full((4,), -math.inf)
    assert torch.equal(lse[1], want_row), lse[1]
    # the other row, and the empty one, as the reference gives them
    torch.testing.assert_close(out, got["torch"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, got["torch"][1], atol=1e-5, rtol=1e-5)


def test_lse_is_float32_whatever_the_default_dtype() -> None:
    """Every path that returns an LSE: the one-call path, several calls, an empty batch and
    the chunked-prefix form, with torch's default dtype set to float64 (a child process:
    the default dtype is process state)."""
    code = """
        import torch
        from attn_dispatch import AttnBatch, AttnConfig, Phase
        from attn_dispatch.backends.sdpa.backend import SdpaBackend
        torch.set_default_dtype(torch.float64)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[1]
            cfg = AttnConfig("mha", 4, 4, 16, 16, dtype=name, page_size=4, device="cpu",
                             return_lse=True)
            be = SdpaBackend(cfg)
            k = torch.randn(4, 4, 4, 16, dtype=torch.float32).to(dtype)
            for q_lens, kv_lens, tables in (([2], [5], [[1, 0]]), ([1, 3], [3, 6], [[2], [3, 1]]),
                                            ([], [], [])):
                batch = AttnBatch.build(Phase.PREFILL, q_lens=q_lens, kv_lens=kv_lens,
                                        page_tables=tables, page_size=4, num_pages=4)
                q = torch.randn(sum(q_lens), 4, 16, dtype=torch.float32).to(dtype)
                _, lse = be.handler(Phase.PREFILL)(q, k, k, be.plan(batch), 0.25,
                                                   return_lse=True)
                assert lse.dtype == torch.float32, (name, q_lens, lse.dtype)
            batch = AttnBatch.build(Phase.PREFILL, q_lens=[2], kv_lens=[5],
                                    page_tables=[[1, 0]], page_size=4, num_pages=4)
            q = torch.randn(2, 4, 16, dtype=torch.float32).to(dtype)
            chunk = (torch.randn(3, 4, 16, dtype=torch.float32).to(dtype),) * 2 + ([0, 3],)
            _, lse = be.run_chunked(q, q, q, batch, 0.25, [chunk], return_lse=True)
            assert lse.dtype == torch.float32, (name, "chunked", lse.dtype)
        print("ok")
    """
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0 and "ok" in child.stdout, child.stderr[-3000:]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_cache_view_is_read_only_where_it_reaches(in_place: bool, kv_heads: int) -> None:
    """K/V caches that are views into a larger storage whose other pages hold NaN: the
    answer is the reference's on contiguous copies (no NaN came from outside the view),
    with requests read in place (consecutive pages, up to the view's last page) or gathered."""
    cfg = AttnConfig("mha", 4, kv_heads, 16, 16, dtype="float32", page_size=4, device="cpu")
    g = torch.Generator().manual_seed(4)
    k_store = torch.full((12, 4, kv_heads, 16), math.nan)
    v_store = torch.full((12, 4, kv_heads, 16), math.nan)
    k, v = k_store[3:9], v_store[3:9]  # pages 0..5 of the view
    k.copy_(torch.randn(6, 4, kv_heads, 16, generator=g))
    v.copy_(torch.randn(6, 4, kv_heads, 16, generator=g))
    batch = AttnBatch.build(Phase.PREFILL, q_lens=[3, 2], kv_lens=[12, 7],
                            page_tables=[[3, 4, 5], [0, 1]], page_size=4, num_pages=6)  # fmt: skip
    q = torch.randn(5, 4, 16, generator=g)
    sdpa = SdpaBackend(cfg, in_place=in_place)
    plan = sdpa.plan(batch)
    assert plan.in_place == (2 if in_place else 0)
    out = sdpa.handler(Phase.PREFILL)(q, k, v, plan, 0.25)
    ref = TorchBackend(cfg)
    want = ref.handler(Phase.PREFILL)(q, k.clone(), v.clone(), ref.plan(batch), 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def _chunked_case() -> tuple[SdpaBackend, AttnBatch, torch.Tensor]:
    cfg = AttnConfig("mha", 4, 4, 16, 16, dtype="float32", page_size=4, device="cpu")
    batch = AttnBatch.build(Phase.PREFILL, q_lens=[2], kv_lens=[5], page_tables=[[1, 0]],
                            page_size=4, num_pages=2)  # fmt: skip
    return SdpaBackend(cfg), batch, torch.randn(2, 4, 16, generator=torch.Generator())


@pytest.mark.parametrize(
    ("k_shape", "indptr", "needle"),
    [
        ((2, 4, 16), [0, 3], "within the chunk's 2 rows"),  # too few rows for the indptr
        ((3, 2, 16), [0, 3], "[rows, 4, 16]"),  # another head count
        ((3, 4, 8), [0, 3], "[rows, 4, 16]"),  # another width
        ((3, 4, 16), [3, 0], "non-decreasing"),
        ((3, 4, 16), [0, 1, 3], "want 2"),
    ],
)
def test_prefix_chunks_that_do_not_fit_are_refused(
    k_shape: tuple[int, ...], indptr: list[int], needle: str
) -> None:
    be, batch, q = _chunked_case()
    k_c = torch.randn(*k_shape)
    v_c = torch.randn(*k_shape)
    with pytest.raises(InvalidBatchError) as err:
        be.run_chunked(q, q, q, batch, 0.25, [(k_c, v_c, indptr)])
    assert err.value.field == "prefix" and needle in str(err.value), err.value
    ref = TorchBackend(be.config)  # the reference form refuses the same chunk
    with pytest.raises(InvalidBatchError):
        ref.run_chunked(q, q, q, batch, 0.25, [(k_c, v_c, indptr)])


def test_prefix_chunks_that_fit_match_the_reference() -> None:
    be, batch, q = _chunked_case()
    g = torch.Generator().manual_seed(8)
    k_c, v_c = torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, 16, generator=g)
    got = be.run_chunked(q, q, q, batch, 0.25, [(k_c, v_c, [0, 3])])
    want = TorchBackend(be.config).run_chunked(q, q, q, batch, 0.25, [(k_c, v_c, [0, 3])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_captured_decode_replays_each_new_step() -> None:
    """A plan is a handle, so a CUDA-graph replay re-plans through ``update_plan`` (the
    records stay with the backend); off CUDA the replay runs eagerly on the captured plan."""
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch.cuda_graph import capture_decode

    cfg = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8, sm_scale=0.25)
    binding = bind("sdpa", cfg)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return attention(q, k, v)

    def batch(lens: list[int], tables: list[list[int]]) -> AttnBatch:
        return AttnBatch.build(Phase.DECODE, q_lens=[1] * len(lens), kv_lens=lens,
                               page_tables=tables, page_size=8)  # fmt: skip

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
    graphed = capture_decode(binding, batch([7, 3], [[0], [2]]), step, q, k, k,
                             max_pages_per_request=2)  # fmt: skip
    for lens, tables in (([8, 4], [[0], [2]]), ([9, 5], [[0, 1], [3]])):
        new = batch(lens, tables)
        got = graphed.replay(new, q)
        with attn_scope(binding, new):
            torch.testing.assert_close(got, step(q, k, k))
    backend: Any = binding.backend(Phase.DECODE)
    with pytest.raises(InvalidBatchError):  # another token count than the captured plan's
        backend.update_plan(graphed.plan, batch([4, 4, 4], [[0], [1], [2]]))
