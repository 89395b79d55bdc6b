"""One step's plans (``DispatchMetadata.prepared``): made once per step per runner and part,
reused by that runner's layers only, and never carried into the next step.

Runs ``DispatchMetadata`` on hand-made steps (vLLM imported, no engine).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from attn_dispatch.integrations.vllm._metadata import DispatchMetadata  # noqa: E402

I32 = torch.int32
BS = 16
LIB = load()
SPECS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}"),
    ),
]


def _config(**over: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        page_size=BS,
        device="cpu",
        sm_scale=0.25,
    )
    base.update(over)
    return AttnConfig(**base)


def _step(table: torch.Tensor, seq: list[int]) -> DispatchMetadata:
    n = len(seq)
    return DispatchMetadata(
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq),
        query_start_loc=torch.arange(n + 1, dtype=I32),
        seq_lens=torch.tensor(seq, dtype=I32),
        block_table=table,
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        block_size=BS,
        num_speculative_tokens=0,
        mixed="split",
    )


def _pages(plan: Any) -> list[int]:
    """The page indices a plan was made for (its private snapshot)."""
    p = plan[0]
    snap = p.snapshot if hasattr(p, "snapshot") else p.snap  # native's / torch's name
    return [int(x) for x in snap.kv_indices.tolist()]


@pytest.mark.parametrize("spec", SPECS)
def test_layers_of_one_runner_share_the_steps_plan(spec: str) -> None:
    binding = bind(spec, _config(), label="target")
    md = _step(torch.tensor([[3, 4], [7, 0]], dtype=I32), [20, 5])
    (part,) = md.parts_for(False)
    first = md.prepared(binding, False, part)
    # Every later layer of the runner reads the same plan (planned once per step).
    assert all(md.prepared(binding, False, part) is first for _ in range(4))
    assert _pages(first) == [6, 8, 14]


@pytest.mark.parametrize("spec", SPECS)
def test_two_runners_never_share_a_plan(spec: str) -> None:
    target = bind(spec, _config(), label="target")
    draft = bind(spec, _config(), label="draft")  # same config, its own backend objects
    md = _step(torch.tensor([[3, 4], [7, 0]], dtype=I32), [20, 5])
    (part,) = md.parts_for(False)
    (dpart,) = md.parts_for(True)
    a = md.prepared(target, False, part)
    b = md.prepared(draft, True, dpart)
    assert a is not b and a[0] is not b[0]
    assert a[0].owner is target.backend(part.batch.phase)
    assert b[0].owner is draft.backend(dpart.batch.phase)
    # The same runner under the other runner's phase rule is a plan of its own too.
    assert md.prepared(target, True, dpart) is not a
    # Each plan runs on its own runner's handler only: the other's refuses it.
    q = torch.randn(2, 4, 16)
    cache = torch.randn(16, BS, 2, 16)
    phase = part.batch.phase
    target.handler(phase)(q, cache, cache, a[0], 0.25)
    with pytest.raises(Exception, match="plan"):
        draft.handler(phase)(q, cache, cache, a[0], 0.25)


@pytest.mark.parametrize("spec", SPECS)
def test_a_new_step_plans_again_with_its_own_page_table(spec: str) -> None:
    binding = bind(spec, _config(), label="target")
    table = torch.tensor([[3, 4], [7, 0]], dtype=I32)
    md1 = _step(table, [20, 5])
    (p1,) = md1.parts_for(False)
    plan1 = md1.prepared(binding, False, p1)
    # vLLM edits its block table in place between steps: the built step keeps what it read,
    # and the next step's metadata plans again from the new table.
    table[0, 1] = 9
    table[1, 0] = 2
    assert p1.batch.kv_indices.tolist() == [6, 8, 14]
    md2 = _step(table, [20, 5])
    (p2,) = md2.parts_for(False)
    plan2 = md2.prepared(binding, False, p2)
    assert plan2 is not plan1 and plan2[0] is not plan1[0]
    assert _pages(plan1) == [6, 8, 14]
    assert _pages(plan2) == [6, 18, 4]


def test_a_bad_page_table_is_refused_in_every_step() -> None:
    """The checks run once per step's batch, never skipped because a previous step passed."""
    from attn_dispatch import InvalidBatchError

    binding = bind("torch", _config(), label="target")
    table = torch.tensor([[3, 4], [7, 0]], dtype=I32)
    md = _step(table, [20, 5])
    md.prepared(binding, False, md.parts_for(False)[0])
    table[1, 0] = -1
    with pytest.raises(InvalidBatchError, match="block ids must be in") as err:
        _step(table, [20, 5]).parts_for(False)
    assert err.value.field == "block_table" and err.value.request == 1


@pytest.mark.parametrize("spec", SPECS)
def test_a_runners_layers_enter_one_scope_per_step(spec: str) -> None:
    """One scope per runner and part per step (with the step's plan), entered by every layer
    of the runner; another runner, or the next step, gets its own."""
    from attn_dispatch import attention

    binding = bind(spec, _config(), label="target")
    other = bind(spec, _config(), label="draft")
    table = torch.tensor([[3, 4], [7, 0]], dtype=I32)
    md = _step(table, [20, 5])
    (part,) = md.parts_for(False)
    scope = md.scope(binding, False, part)
    assert md.scope(binding, False, part) is scope
    assert scope.plan is md.prepared(binding, False, part)[0]
    assert md.scope(other, False, part) is not scope
    assert _step(table, [20, 5]).scope(binding, False, part) is not scope
    # Entered once per layer: each layer's result is the runner's handler on the step's plan.
    q = torch.randn(2, 4, 16)
    k, v = torch.randn(16, BS, 2, 16), torch.randn(16, BS, 2, 16)
    want = binding.handler(part.batch.phase)(q, k, v, scope.plan, 0.25)
    for _ in range(3):
        with scope:
            got = attention(q, k, v)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("spec", SPECS)
def test_q_rows_of_a_fused_projection_go_as_they_come_where_the_backend_reads_them(
    spec: str,
) -> None:
    """vLLM's q is a column slice of the QKV projection: a backend that declares
    ``reads_strided_q_rows`` (native) takes it without a copy, any other gets a contiguous
    one; the answer is the contiguous q's either way."""
    from attn_dispatch import attention
    from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

    binding = bind(spec, _config(), label="target")
    md = _step(torch.tensor([[3, 4], [7, 0]], dtype=I32), [20, 5])
    (part,) = md.parts_for(False)
    impl = object.__new__(AttnDispatchCPUImpl)
    impl._strided_q = {}
    reads = impl._reads_strided_q(binding, part.batch.phase)
    assert reads is (spec == "native")
    assert impl._reads_strided_q(binding, part.batch.phase) is reads  # asked once
    assert len(impl._strided_q) == 1
    q = torch.randn(2, (4 + 2 * 2) * 16)[:, : 4 * 16].view(2, 4, 16)
    assert not q.is_contiguous()
    k, v = torch.randn(16, BS, 2, 16), torch.randn(16, BS, 2, 16)
    scope = md.scope(binding, False, part)
    want = binding.handler(part.batch.phase)(q.contiguous(), k, v, scope.plan, 0.25)
    out = torch.empty(2, 4, 16)
    with scope:
        attention(q if reads else q.contiguous(), k, v, out=out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_kv_rows_once_per_slot_mapping() -> None:
    """The KV write's rows are computed once per forward's slot mapping (every layer of the
    KV group is handed the same tensor) and again for any other tensor, equal or not."""
    from attn_dispatch.integrations.vllm._metadata import kv_rows

    md = _step(torch.tensor([[3, 4], [7, 0]], dtype=I32), [20, 5])
    slots = torch.tensor([3 * BS + 5, 7 * BS, -1, -1], dtype=torch.int64)
    first = md.kv_rows(slots, BS)
    assert md.kv_rows(slots, BS) is first
    # Block b's K is page 2b: slot s goes to row 2 * BS * (s // BS) + s % BS; padding is left.
    assert first.rows.tolist() == [2 * BS * 3 + 5, 2 * BS * 7]
    assert first.count == 4 and first.keep is not None
    assert first.keep.tolist() == [True, True, False, False]
    again = md.kv_rows(slots.clone(), BS)
    assert again is not first and again.rows.tolist() == first.rows.tolist()
    full = kv_rows(torch.tensor([1, 2], dtype=torch.int32), BS)
    assert full.keep is None and full.rows.tolist() == [1, 2] and full.count == 2


def test_sinks_are_converted_once_per_load() -> None:
    """A layer's sinks reach the kernels as float32, converted once, and again only after
    vLLM writes its tensor (a weight reload)."""
    from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

    impl = object.__new__(AttnDispatchCPUImpl)
    impl.sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)
    impl._sinks = None
    first = impl._sinks_f32()
    assert first.dtype == torch.float32 and first.tolist() == [0.5, -1.0, 2.0, 0.0]
    assert impl._sinks_f32() is first
    impl.sinks.add_(1.0)  # an in-place reload
    second = impl._sinks_f32()
    assert second is not first and second.tolist() == [1.5, 0.0, 3.0, 1.0]


@pytest.mark.parametrize("count", [1, 7, 256, 257, 600])
def test_kv_rows_small_and_large_steps_agree(count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few slots become rows as Python ints (``_LIST_SLOTS``), many with tensor ops: the
    same rows, count and padding mask, with and without padding slots."""
    from attn_dispatch.integrations.vllm import _metadata

    g = torch.Generator().manual_seed(count)
    slots = torch.randperm(40 * BS, generator=g)[:count]
    padded = slots.clone()
    padded[count // 2 :: 3] = -1
    for s in (slots, padded, slots.to(I32)):
        monkeypatch.setattr(_metadata, "_LIST_SLOTS", 256)
        got = _metadata.kv_rows(s, BS)
        monkeypatch.setattr(_metadata, "_LIST_SLOTS", 0)
        want = _metadata.kv_rows(s, BS)
        assert got.rows.dtype == want.rows.dtype == torch.int64
        assert got.rows.tolist() == want.rows.tolist()
        assert got.count == want.count == count
        assert (got.keep is None) == (want.keep is None) == bool((s >= 0).all())
        if got.keep is not None:
            assert got.keep.tolist() == want.keep.tolist()
        kept = s[s >= 0].tolist()
        assert got.rows.tolist() == [2 * BS * (x // BS) + x % BS for x in kept]


def _kv_impl(kv_dtype: str) -> Any:
    """An ``AttnDispatchCPUImpl`` as far as its KV write reads it (GQA 4/2 x 16, page BS)."""
    from attn_dispatch.integrations.vllm._layers import LayerDispatch
    from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

    cfg = _config(dtype="bfloat16", kv_dtype=kv_dtype)
    impl = object.__new__(AttnDispatchCPUImpl)
    impl._views = None
    impl.dispatch = LayerDispatch(
        label="target",
        binding=bind("torch", cfg, label="target"),
        config=cfg,
        kv_torch_dtype=getattr(torch, kv_dtype),
        fp8=False,
    )
    return impl


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("padded", [False, True])
def test_native_kv_write_matches_the_torch_path(
    kv_dtype: str, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's KV write through ``na_kv_write`` leaves the cache byte for byte as the
    torch path (``kv_rows`` + ``index_copy_``) does: K at page 2b, V at 2b + 1, padding slots
    (and the token rows past the slot mapping) not written, a bf16 key into a float32 cache
    converted."""
    if isinstance(LIB, str):
        pytest.skip(f"native library: {LIB}")
    from attn_dispatch.integrations.vllm import backend as be

    blocks = 6
    cache = torch.randn(blocks, 2, BS, 2 * 16).to(getattr(torch, kv_dtype))
    qkv = torch.randn(7, 8 * 16, dtype=torch.bfloat16)
    _, key, value = qkv.split([64, 32, 32], dim=-1)
    key, value = key.view(7, 2, 16), value.view(7, 2, 16)
    slots = torch.tensor([0, 3 * BS + 5, blocks * BS - 1, 2 * BS, 4 * BS + 9, 7], dtype=torch.int64)
    if padded:
        slots[1::2] = -1
    layer = type("Layer", (), {"layer_name": "l0"})()
    got = cache.clone()
    assert be._kv_write() is not None
    _kv_impl(kv_dtype).do_kv_cache_update(layer, key, value, got, slots)
    monkeypatch.setattr(be, "_KV_WRITE", [None])  # the torch path
    want = cache.clone()
    _kv_impl(kv_dtype).do_kv_cache_update(layer, key, value, want, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got, cache)


@pytest.mark.parametrize("native", [True, False])
def test_kv_write_refuses_a_slot_past_the_cache(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot past the layer's blocks is our ``InvalidBatchError`` naming ``slot_mapping``, on
    the native write and on the torch path alike, and no row of the step is written."""
    from attn_dispatch import InvalidBatchError
    from attn_dispatch.integrations.vllm import backend as be

    if native and isinstance(LIB, str):
        pytest.skip(f"native library: {LIB}")
    if not native:
        monkeypatch.setattr(be, "_KV_WRITE", [None])
    blocks = 3
    cache = torch.randn(blocks, 2, BS, 32, dtype=torch.bfloat16)
    before = cache.clone()
    key = value = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    layer = type("Layer", (), {"layer_name": "l0"})()
    slots = torch.tensor([1, blocks * BS, -1], dtype=torch.int64)
    with pytest.raises(InvalidBatchError, match="slot_mapping") as info:
        _kv_impl("bfloat16").do_kv_cache_update(layer, key, value, cache, slots)
    assert f"token 1's slot {blocks * BS}" in str(info.value)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("native", [True, False])
def test_kv_write_rederives_views_for_a_smaller_cache_over_the_same_memory(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's page views are kept per cache tensor's memory, shape, strides and dtype: a
    cache over the same storage with fewer blocks gets its own views, so a slot in the blocks
    it no longer holds is refused (``slot_mapping``) and nothing is written, as for any cache
    that small; before, the first cache's larger views were reused for the same pointer."""
    from attn_dispatch import InvalidBatchError
    from attn_dispatch.integrations.vllm import backend as be

    if native and isinstance(LIB, str):
        pytest.skip(f"native library: {LIB}")
    if not native:
        monkeypatch.setattr(be, "_KV_WRITE", [None])
    big = torch.zeros(4, 2, BS, 32, dtype=torch.bfloat16)
    impl = _kv_impl("bfloat16")
    layer = type("Layer", (), {"layer_name": "l0"})()
    key = value = torch.ones(1, 2, 16, dtype=torch.bfloat16)
    slot = torch.tensor([3 * BS], dtype=torch.int64)  # block 3: in the 4-block cache only
    impl.do_kv_cache_update(layer, key, value, big, slot)
    assert int(big[3, :, 0].ne(0).sum()) > 0
    small = big[:2]  # the same data pointer, 2 blocks
    assert small.data_ptr() == big.data_ptr()
    before = big.clone()
    with pytest.raises(InvalidBatchError, match="slot_mapping"):
        impl.do_kv_cache_update(layer, key * 2, value * 2, small, slot)
    assert torch.equal(big.view(torch.uint8), before.view(torch.uint8))
    k, _ = impl._pages(small, impl.dispatch)
    assert k.shape[0] == 2 * 2 - 1  # the small cache's pages, not the big one's
