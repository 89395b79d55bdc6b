"""Context-parallel attention: every rank's part, merged by LSE, equals attention over all keys.

Ranks are simulated in one process here (each rank's shard built from one global cache and run
through its own binding); examples/context_parallel.py runs the same recipe on 2 processes with
gloo (tested below). The reference is the float64 oracle of the contract suite.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch.distributed import expand_state
from attn_dispatch.distributed import local_verify_mask
from attn_dispatch.distributed import owned_positions
from attn_dispatch.distributed import shard_for_rank
from attn_dispatch.state import merge_states
from tests.contract.cases import lse_tolerance
from tests.contract.cases import materialise
from tests.contract.cases import naive_state
from tests.contract.cases import tolerance
from tests.strategies import KernelCase

ROOT = Path(__file__).resolve().parents[2]


CPU_BACKENDS = ["torch", "native"]


def _case(kind: str, phase: Phase, tree: bool, dtype: str = "float32") -> KernelCase:
    mla = kind == "mla"
    q_lens = (1, 1, 1) if phase is Phase.DECODE else (3, 1, 4)
    prefix = (9, 2, 17)
    trees = ((-1, 0, 0), (-1,), (-1, 0, 1, 1)) if tree else None
    return KernelCase(
        kind=kind,
        phase=phase,
        num_q_heads=4,
        num_kv_heads=1 if mla else 2,
        head_dim=24 if mla else 16,
        v_head_dim=16,
        page_size=4,
        dtype=dtype,
        q_lens=q_lens,
        prefix_lens=prefix,
        trees=trees,
        extra_pages=3,
        seed=7,
        lse=True,
    )


def _run_cp(backend: str, case: KernelCase, world: int, layout: str, interleave: int):
    m = materialise(case)
    cfg = dataclasses.replace(m.config, tree_verify=case.phase is Phase.VERIFY)
    binding = bind(BackendSpec.uniform(backend), cfg)
    outs, lses = [], []
    for rank in range(world):
        shard = shard_for_rank(
            m.batch,
            m.k_cache,
            m.v_cache,
            rank=rank,
            world=world,
            layout=layout,
            interleave=interleave,
            masks=m.masks,
        )
        out = lse = None
        if shard.batch is not None:
            with attn_scope(binding, shard.batch):
                out, lse = attention(
                    m.q[shard.rows],
                    shard.k_cache,
                    shard.v_cache,
                    sm_scale=m.sm_scale,
                    return_lse=True,
                )
        full = expand_state(out, lse, shard, like=m.q, v_head_dim=case.v_head_dim)
        outs.append(full[0])
        lses.append(full[1])
    return m, merge_states(outs, lses)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    "phase,tree", [(Phase.DECODE, False), (Phase.VERIFY, False), (Phase.VERIFY, True)]
)
@pytest.mark.parametrize(
    "layout,interleave", [("interleaved", 1), ("interleaved", 2), ("contiguous", 1)]
)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_merged_equal_attention_over_all_keys(
    backend, kind, phase, tree, layout, interleave, world
):
    case = _case(kind, phase, tree)
    m, (out, lse) = _run_cp(backend, case, world, layout, interleave)
    ref_out, ref_lse = naive_state(m)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    atol, rtol = lse_tolerance(case.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_parts_merge_within_bf16_tolerance(backend):
    case = _case("mha", Phase.VERIFY, True, dtype="bfloat16")
    m, (out, lse) = _run_cp(backend, case, 2, "interleaved", 1)
    ref_out, ref_lse = naive_state(m)
    atol, rtol = tolerance("bfloat16")
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    atol, rtol = lse_tolerance("bfloat16")
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)


def test_every_position_owned_by_exactly_one_rank():
    for layout in ("interleaved", "contiguous"):
        for world in (1, 2, 3, 5):
            for inter in (1, 3):
                for n in (0, 1, 7, 16):
                    got = sorted(
                        t
                        for r in range(world)
                        for t in owned_positions(
                            n, rank=r, world=world, layout=layout, interleave=inter
                        )
                    )
                    assert got == list(range(n)), (layout, world, inter, n)


def test_interleaved_matches_vllm_dcp_rule():
    # vLLM: token t lives on rank (t // interleave) % world.
    got = owned_positions(12, rank=1, world=2, layout="interleaved", interleave=2)
    assert got == [2, 3, 6, 7, 10, 11]


def test_local_verify_mask_is_causal_by_global_position():
    m = local_verify_mask(3, 8, [1, 3, 5, 7])  # queries at global 5, 6, 7
    assert m.tolist() == [
        [True, True, True, False],
        [True, True, True, False],
        [True, True, True, True],
    ]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"kv_len": -1, "rank": 0, "world": 2}, "kv_len"),
        ({"kv_len": 4, "rank": 2, "world": 2}, "rank"),
        ({"kv_len": 4, "rank": 0, "world": 0}, "world"),
        ({"kv_len": 4, "rank": 0, "world": 2, "layout": "striped"}, "layout"),
        ({"kv_len": 4, "rank": 0, "world": 2, "interleave": 0}, "interleave"),
        ({"kv_len": True, "rank": 0, "world": 2}, "kv_len"),
    ],
)
def test_bad_layout_arguments_name_the_field(kwargs, field):
    kv_len = kwargs.pop("kv_len")
    with pytest.raises(InvalidBatchError) as e:
        owned_positions(kv_len, **kwargs)
    assert e.value.field == field


def test_example_two_processes_gloo():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "context_parallel.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max abs error" in proc.stdout
    assert "FAIL" not in proc.stdout
