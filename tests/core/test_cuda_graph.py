"""Resolve before capture: plan outside the captured region, persistent buffers, one shape.

The CPU tests exercise everything but the graph itself (GraphedForward runs fn again on each
replay, under the captured plan and buffers). The CUDA tests capture and replay real graphs;
they skip here with a reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The triton backend runs on CPU only under its interpreter, set before its first bind.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendUnavailableError
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import UnknownBackendError
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import register_backend
from attn_dispatch.backend import unregister_backend
from attn_dispatch.cuda_graph import CaptureError
from attn_dispatch.cuda_graph import GraphedForward
from attn_dispatch.cuda_graph import assert_not_capturing
from attn_dispatch.cuda_graph import capture_decode
from tests.scale_helpers import make_batch
from tests.scale_helpers import make_cache
from tests.scale_helpers import mha_config
from tests.scale_helpers import mla_config
from tests.scale_helpers import register_scaled

NUM_PAGES = 16
KV_LENS = [6, 11, 2]  # pages per request at page_size 4: 2, 3, 1


@pytest.fixture
def scaled() -> Iterator[str]:
    yield from register_scaled("test-graph-x2", 2.0)


def step_fn(scale: float, layers: int = 2) -> Callable[..., torch.Tensor]:
    """A decode step of ``layers`` attention layers sharing one batch."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h = q
        for _ in range(layers):
            out = attention(h, k, v, sm_scale=scale)
            h = h + out[..., : h.shape[-1]]
        return h

    return step


def eager(binding: Any, batch: AttnBatch, fn: Callable[..., Any], *inputs: Any) -> Any:
    with attn_scope(binding, batch):
        return fn(*inputs)


def same_shape_batches(cfg: AttnConfig, n: int, device: str = "cpu") -> list[Any]:
    # Same requests and pages per request each step; lengths move inside their last page and
    # pages are reshuffled, so every metadata tensor changes value but not shape.
    steps = []
    for s in range(n):
        lens = [k - (s % 2) for k in KV_LENS]
        lens[2] = 1 + s % 4
        steps.append(
            make_batch(
                cfg, Phase.DECODE, [1, 1, 1], lens, num_pages=NUM_PAGES, seed=100 + s, device=device
            )
        )
    return steps


def test_plan_once_per_replay_outside_fn_and_buffers_reused(scaled: str) -> None:
    cfg = mha_config()
    binding = bind(scaled, cfg, label="draft")
    backend: Any = binding.backend(Phase.DECODE)
    k, v = make_cache(cfg, NUM_PAGES, seed=7)
    (batch0, q0), *steps = same_shape_batches(cfg, 4)
    step = step_fn(cfg.head_dim**-0.5)
    graphed = capture_decode(binding, batch0, step, q0.clone(), k, v)
    assert len(backend.plans) == 1  # planned once, before fn ran
    assert backend.runs == [graphed.plan, graphed.plan]  # both layers got the captured plan
    ptrs = [t.data_ptr() for t in graphed.buffers()]
    assert graphed.batch.kv_indices.data_ptr() in ptrs
    assert graphed.plan.page_table.data_ptr() in ptrs
    assert len(ptrs) >= 8
    for batch, q in steps:
        backend.plans.clear()
        backend.runs.clear()
        got = graphed.replay(batch, q)
        # One host plan per replay (made outside fn); both layers read the captured plan.
        assert len(backend.plans) == 1 and backend.plans[0] is not graphed.plan
        assert backend.runs == [graphed.plan, graphed.plan]
        assert [t.data_ptr() for t in graphed.buffers()] == ptrs
        assert torch.equal(graphed.batch.kv_indices, batch.kv_indices)
        assert torch.equal(graphed.batch.kv_lens, batch.kv_lens)
        torch.testing.assert_close(got, eager(binding, batch, step, q, k, v))


def test_captured_buffers_are_not_the_callers(scaled: str) -> None:
    cfg = mha_config()
    binding = bind("torch", cfg)
    k, v = make_cache(cfg, NUM_PAGES, seed=1)
    batch0, q0 = same_shape_batches(cfg, 1)[0]
    graphed = capture_decode(binding, batch0, step_fn(0.3), q0.clone(), k, v)
    assert graphed.batch.kv_indices.data_ptr() != batch0.kv_indices.data_ptr()
    want = eager(binding, batch0, step_fn(0.3), q0, k, v)
    batch0.kv_indices.zero_()  # the caller's tensors are theirs to reuse
    torch.testing.assert_close(graphed.replay(graphed.batch, q0), want)


def test_other_shapes_and_phases_are_refused_and_leave_buffers_intact() -> None:
    cfg = mha_config()
    binding = bind("torch", cfg)
    k, v = make_cache(cfg, NUM_PAGES, seed=2)
    (batch0, q0), (batch1, q1) = same_shape_batches(cfg, 2)
    step = step_fn(0.25)
    graphed = capture_decode(binding, batch0, step, q0.clone(), k, v)
    before = [t.clone() for t in graphed.buffers()]

    more = make_batch(cfg, Phase.DECODE, [1] * 4, [3, 3, 3, 3], num_pages=NUM_PAGES, seed=3)
    with pytest.raises(InvalidBatchError, match="a captured graph replays one batch shape") as e:
        graphed.replay(more[0])
    assert e.value.field.startswith("batch.")
    longer = make_batch(cfg, Phase.DECODE, [1, 1, 1], [6, 13, 2], num_pages=NUM_PAGES, seed=4)
    with pytest.raises(InvalidBatchError) as e:
        graphed.replay(*longer)  # one more page for request 1
    assert e.value.field == "batch.kv_indices"
    prefill = make_batch(cfg, Phase.PREFILL, [1, 1, 1], KV_LENS, num_pages=NUM_PAGES, seed=5)
    with pytest.raises(InvalidBatchError, match="one graph per phase"):
        graphed.replay(*prefill)
    with pytest.raises(InvalidBatchError, match=r"inputs\[0\]"):
        graphed.replay(batch1, q1[:2])
    assert isinstance(e.value, AttnDispatchError) and isinstance(e.value, ValueError)
    for t, old in zip(graphed.buffers(), before, strict=True):
        assert torch.equal(t, old)
    torch.testing.assert_close(graphed.replay(batch1, q1), eager(binding, batch1, step, q1, k, v))
    with pytest.raises(InvalidBatchError, match="DECODE"):
        capture_decode(binding, prefill[0], step, prefill[1], k, v)


def test_each_runner_replays_its_own_kernels(scaled: str) -> None:
    cfg = mha_config()
    target = bind("torch", cfg, label="target")
    draft = bind(scaled, cfg, label="draft")
    k, v = make_cache(cfg, NUM_PAGES, seed=3)
    (batch0, q0), (batch1, q1) = same_shape_batches(cfg, 2)
    step = step_fn(0.3, layers=1)
    graphs = {r.label: capture_decode(r, batch0, step, q0.clone(), k, v) for r in (target, draft)}
    want_t = eager(target, batch1, step, q1, k, v)
    want_d = eager(draft, batch1, step, q1, k, v)
    assert not torch.allclose(want_t, want_d)
    with attn_scope(draft, batch1), record_dispatch() as rec:
        # Whatever scope is open around it, a graph replays its own runner's kernels.
        got_t = graphs["target"].replay(batch1, q1).clone()
        got_d = graphs["draft"].replay(batch1, q1).clone()
    torch.testing.assert_close(got_t, want_t)
    torch.testing.assert_close(got_d, want_d)
    assert rec.counts() == {("target", "decode", "torch"): 1, ("draft", "decode", scaled): 1}
    assert [(e.label, e.backend) for e in graphs["draft"].baked] == [("draft", scaled)]


def test_another_runners_scope_inside_the_captured_region_is_refused(scaled: str) -> None:
    cfg = mha_config()
    target = bind("torch", cfg, label="target")
    draft = bind(scaled, cfg, label="draft")
    k, v = make_cache(cfg, NUM_PAGES, seed=4)
    batch0, q0 = same_shape_batches(cfg, 1)[0]

    def mixed(q: torch.Tensor) -> Any:
        out = attention(q, k, v, sm_scale=0.3)
        with attn_scope(draft, batch0):  # plans during the captured region: baked for good
            return out + attention(q, k, v, sm_scale=0.3)

    with pytest.raises(CaptureError, match="one GraphedForward per runner") as e:
        GraphedForward(target, batch0, mixed, q0)
    assert isinstance(e.value, RuntimeError)


def test_mla_decode_replays_the_form_chosen_at_capture() -> None:
    cfg = mla_config()
    binding = bind("torch", cfg, label="mla")
    k, _ = make_cache(cfg, NUM_PAGES, seed=5)
    steps = [
        make_batch(cfg, Phase.DECODE, [1, 1], [6 - s, 3 + s], num_pages=NUM_PAGES, seed=s)
        for s in range(3)
    ]

    def step(q: torch.Tensor) -> Any:
        return attention(q, k, None, sm_scale=0.2)

    graphed = capture_decode(binding, steps[0][0], step, steps[0][1].clone())
    with attn_scope(binding, steps[0][0]):
        assert graphed.form is attention_form()
    for batch, q in steps[1:]:
        torch.testing.assert_close(graphed.replay(batch, q), eager(binding, batch, step, q))


# -- a backend with a value baked into its plan, and one that re-plans in place ----------------


@dataclasses.dataclass(frozen=True)
class LenPlan:
    kv_lens: torch.Tensor
    longest: int  # a host value the run uses: baked into a graph


class LenBackend(BackendBase):
    """Toy backend: output = q * longest + kv_lens (per token); plan keeps ``longest``."""

    name = "test-lens"

    def __init__(self, config: AttnConfig, *, in_place: bool = False) -> None:
        self.config = config
        self.replans = 0
        if in_place:
            self.update_plan = self._update_plan

    def plan(self, batch: AttnBatch) -> LenPlan:
        return LenPlan(batch.kv_lens.float(), batch.max_kv_len)

    def _update_plan(self, plan: LenPlan, batch: AttnBatch) -> None:
        self.replans += 1
        plan.kv_lens.copy_(batch.kv_lens)

    def handler(self, phase: Phase) -> Callable[..., torch.Tensor]:
        def run(q: Any, k: Any, v: Any, plan: LenPlan, sm_scale: float) -> Any:
            return q * plan.longest + plan.kv_lens[:, None, None]

        return run


@pytest.fixture
def lens_backend() -> Iterator[str]:
    register_backend(
        "test-lens", capabilities=Capabilities(kinds={"mha"}), factory=LenBackend, replace=True
    )
    yield "test-lens"
    unregister_backend("test-lens")


def test_a_value_baked_into_the_plan_is_refused(lens_backend: str) -> None:
    cfg = mha_config()
    binding = bind(lens_backend, cfg)
    q = torch.ones(3, cfg.num_q_heads, cfg.head_dim)
    b0 = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * 3, kv_lens=[5, 6, 7], page_tables=[[0, 1]] * 3, page_size=4
    )
    b1 = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * 3, kv_lens=[7, 5, 6], page_tables=[[1, 0]] * 3, page_size=4
    )
    b2 = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * 3, kv_lens=[5, 8, 6], page_tables=[[1, 0]] * 3, page_size=4
    )

    def fwd(x: torch.Tensor) -> Any:
        return attention(x, None, None, sm_scale=1.0)

    graphed = capture_decode(binding, b0, fwd, q)
    torch.testing.assert_close(graphed.replay(b1), eager(binding, b1, fwd, q))  # same longest
    with pytest.raises(InvalidBatchError, match="baked this value in") as e:
        graphed.replay(b2)
    assert e.value.field == "plan.longest"


def test_backend_update_plan_replans_in_place(lens_backend: str) -> None:
    cfg = mha_config()
    binding = bind(lens_backend, cfg, options={lens_backend: {"in_place": True}})
    q = torch.ones(2, cfg.num_q_heads, cfg.head_dim)
    b0 = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[2, 3], page_tables=[[0], [1]], page_size=4
    )
    b1 = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[4, 1], page_tables=[[1], [0]], page_size=4
    )
    graphed = capture_decode(binding, b0, lambda x: attention(x, None, None, sm_scale=1.0), q)
    ptr = graphed.plan.kv_lens.data_ptr()
    out = graphed.replay(b1)
    lens: Any = binding.backend(Phase.DECODE)
    assert lens.replans == 1
    assert graphed.plan.kv_lens.data_ptr() == ptr
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([3 + 4.0, 3 + 1.0]))


class _Buffers:
    """Stands in for a kernel library's wrapper: plain object, persistent buffer inside."""

    def __init__(self) -> None:
        self.lens = torch.zeros(2)


@dataclasses.dataclass(frozen=True)
class OpaquePlan:
    buffers: _Buffers


class OpaqueBackend(BackendBase):
    name = "test-opaque"

    def __init__(self, config: AttnConfig, *, in_place: bool = False) -> None:
        self.buffers = _Buffers()
        self.plans_in_place = in_place

    def plan(self, batch: AttnBatch) -> OpaquePlan:
        self.buffers.lens.copy_(batch.kv_lens)  # refills the same buffer on every plan
        return OpaquePlan(self.buffers)

    def handler(self, phase: Phase) -> Callable[..., Any]:
        return lambda q, k, v, plan, scale: q * 0 + plan.buffers.lens[:, None, None]


@pytest.fixture
def opaque_backend() -> Iterator[str]:
    register_backend(
        "test-opaque",
        capabilities=Capabilities(kinds={"mha"}),
        factory=OpaqueBackend,
        replace=True,
    )
    yield "test-opaque"
    unregister_backend("test-opaque")


def test_a_plan_holding_opaque_objects_needs_plans_in_place(opaque_backend: str) -> None:
    cfg = mha_config()
    q = torch.ones(2, cfg.num_q_heads, cfg.head_dim)
    b0, b1 = (
        AttnBatch.build(
            Phase.DECODE, q_lens=[1, 1], kv_lens=lens, page_tables=[[0], [1]], page_size=4
        )
        for lens in ([2, 3], [4, 1])
    )

    def fwd(x: torch.Tensor) -> Any:
        return attention(x, None, None, sm_scale=1.0)

    with pytest.raises(CaptureError, match=r"plan\.buffers \(_Buffers\)") as e:
        capture_decode(bind(opaque_backend, cfg), b0, fwd, q)
    assert "plans_in_place" in str(e.value)
    binding = bind(opaque_backend, cfg, options={opaque_backend: {"in_place": True}})
    graphed = capture_decode(binding, b0, fwd, q)
    ptr = graphed.plan.buffers.lens.data_ptr()
    torch.testing.assert_close(graphed.replay(b1)[:, 0, 0], torch.tensor([4.0, 1.0]))
    assert graphed.plan.buffers.lens.data_ptr() == ptr


def test_assert_not_capturing_is_quiet_outside_capture() -> None:
    assert_not_capturing()
    batch, _ = same_shape_batches(mha_config(), 1)[0]
    with pytest.raises(CaptureError, match="CUDA batch"):
        GraphedForward(bind("torch", mha_config()), batch, lambda: None, capture=True)


# -- CUDA: real capture and replay ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none on this machine)"
)
GPU_BACKENDS = ["torch", "triton", "flashinfer"]


def graph_options(name: str, num_pages: int, scale: float) -> dict[str, dict[str, Any]]:
    """Bind options a backend needs to be captured (FlashInfer: its graph-mode wrappers)."""
    if name == "flashinfer":
        opts = {"use_cuda_graph": True, "max_num_pages": num_pages, "sm_scale": scale}
        return {name: opts}
    return {}


def bind_or_skip(name: str, cfg: AttnConfig, label: str, **options: Any) -> Any:
    try:
        return bind(name, cfg, label=label, options=options or None)
    except (UnknownBackendError, IncompatibleBackendError, BackendUnavailableError) as exc:
        pytest.skip(f"backend {name!r} cannot serve this config here: {exc}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16"])  # one dtype: FlashInfer JIT-builds per dtype
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_cuda_capture_and_replay_matches_eager_per_runner(name: str, dtype: str) -> None:
    cfg = AttnConfig(
        kind="mha",
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=dtype,
        page_size=16,
        device="cuda",
    )
    target = bind_or_skip(name, cfg, "target", **graph_options(name, 64, cfg.head_dim**-0.5))
    draft = bind_or_skip("torch", cfg, "draft")
    k, v = make_cache(cfg, 64, seed=0, device="cuda")
    lens = [100, 37, 250, 16]
    steps = [
        make_batch(
            cfg, Phase.DECODE, [1] * 4, [n - s for n in lens], num_pages=64, seed=s, device="cuda"
        )
        for s in range(4)
    ]
    step = step_fn(cfg.head_dim**-0.5)
    pool = torch.cuda.graph_pool_handle()
    graphs = [
        capture_decode(r, steps[0][0], step, steps[0][1].clone(), k, v, pool=pool)
        for r in (target, draft)
    ]
    assert all(g.graph is not None for g in graphs)
    for batch, q in steps[1:]:
        for runner, graphed in zip((target, draft), graphs, strict=True):
            got = graphed.replay(batch, q).clone()
            torch.cuda.synchronize()
            want = eager(runner, batch, step, q, k, v)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@needs_cuda
def test_cuda_planning_inside_a_capture_is_refused() -> None:
    cfg = AttnConfig(
        kind="mha",
        num_q_heads=4,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        page_size=16,
        device="cuda",
    )
    batch, _ = make_batch(cfg, Phase.DECODE, [1], [20], num_pages=4, seed=0, device="cuda")
    binding = bind("torch", cfg)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="resolve and plan before capture"):
        with torch.cuda.graph(graph):
            GraphedForward(binding, batch, lambda: None)


# ---------------------------------------------------------------- growing sequences (capacity)


def _graph_backends() -> list[str]:
    # Backends that declare graph support: a plan copied field by field (torch), an
    # update_plan (triton), or plans_in_place (flashinfer, CUDA only: its own CUDA test).
    return ["torch", "triton"]


@pytest.mark.parametrize("backend", _graph_backends())
def test_one_graph_replays_growing_sequences_across_page_boundaries(backend: str) -> None:
    from attn_dispatch.backend import list_backends

    why = list_backends()[backend].availability_reasons()
    if why:
        pytest.skip(f"{backend} cannot run here: {'; '.join(why)}")
    cfg = mha_config(dim=16)  # triton's narrowest tile
    binding = bind(backend, cfg, label="draft")
    ps, capacity = cfg.page_size, 4
    k, v = make_cache(cfg, NUM_PAGES, seed=11)
    free = list(range(NUM_PAGES - 1, -1, -1))
    lens = [3, 6, 1]
    tables: list[list[int]] = [[], [], []]

    def batch_for(lens: list[int]) -> AttnBatch:
        for i, n in enumerate(lens):
            while len(tables[i]) * ps < n:  # a request crossed into a new page
                tables[i].append(free.pop())
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1, 1, 1], kv_lens=lens, page_tables=tables, page_size=ps
        )

    step = step_fn(cfg.head_dim**-0.5, layers=1)
    g = torch.Generator().manual_seed(5)
    q0 = torch.randn(3, cfg.num_q_heads, cfg.head_dim, generator=g)
    graphed = capture_decode(
        binding, batch_for(lens), step, q0.clone(), k, v, max_pages_per_request=capacity
    )
    crossings = 0
    for _ in range(9):
        before = [len(t) for t in tables]
        lens = [n + 1 for n in lens]
        batch = batch_for(lens)
        crossings += sum(len(t) != b for t, b in zip(tables, before, strict=True))
        q = torch.randn(3, cfg.num_q_heads, cfg.head_dim, generator=g)
        got = graphed.replay(batch, q).clone()
        torch.testing.assert_close(got, eager(binding, batch, step, q, k, v), atol=2e-5, rtol=2e-5)
    assert crossings >= 3 and max(len(t) for t in tables) == capacity
    last, last_q = batch, q
    want = eager(binding, last, step, last_q, k, v)
    lens[1] = capacity * ps + 1  # needs a fifth page: past the captured capacity
    with pytest.raises(InvalidBatchError, match="max_pages_per_request") as err:
        graphed.replay(batch_for(lens), last_q)
    assert err.value.field == "kv_indptr" and err.value.request == 1
    # The refused step left the captured buffers as they were.
    torch.testing.assert_close(graphed.replay(last, last_q), want, atol=2e-5, rtol=2e-5)


def test_capacity_must_be_a_positive_int() -> None:
    cfg = mha_config()
    binding = bind("torch", cfg)
    k, v = make_cache(cfg, NUM_PAGES, seed=1)
    batch0, q0 = same_shape_batches(cfg, 1)[0]
    with pytest.raises(InvalidBatchError, match="positive int"):
        capture_decode(binding, batch0, step_fn(0.3), q0, k, v, max_pages_per_request=0)
