"""The plugin without an engine: ``register`` only under the vLLM it was tested with, the state
each engine keeps (its own, dropped with it), and decode context parallel's step on one rank.

vLLM imported, no engine: the impl is built under ``set_current_vllm_config`` with a stand-in
config holding what it reads.
"""

from __future__ import annotations

import gc
import logging
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends import registry  # noqa: E402

from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch.integrations import vllm as plugin  # noqa: E402
from attn_dispatch.integrations.transformers import UnsupportedModelError  # noqa: E402
from attn_dispatch.integrations.vllm import backend  # noqa: E402
from attn_dispatch.integrations.vllm._metadata import DispatchMetadata  # noqa: E402

I32 = torch.int32


# ---------------------------------------------------------------------------------------------
# register(): vLLM's CPU_ATTN taken over only under the tested release series


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, str]]:
    """``register_backend`` calls, recorded instead of made (vLLM's registry is process-wide)."""
    calls: list[tuple[Any, str]] = []
    monkeypatch.setattr(registry, "register_backend", lambda *a: calls.append(a))
    return calls


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1+cpu"])
def test_register_takes_over_cpu_attn_on_the_tested_series(
    version: str,
    registered: list[tuple[Any, str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.DEBUG, logger="attn_dispatch"):
        plugin.register()
    assert registered == [(registry.AttentionBackendEnum.CPU_ATTN, plugin.BACKEND_PATH)]
    assert caplog.records == []


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "dev"])
def test_register_leaves_another_vllm_untouched_with_one_log_line(
    version: str,
    registered: list[tuple[Any, str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.DEBUG, logger="attn_dispatch"):
        plugin.register()
    assert registered == []  # CPU_ATTN stays vLLM's own
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert f"vLLM {version} " in text and "0.32.x" in text and "no effect" in text
    assert "\n" not in text


def test_the_installed_vllm_is_a_tested_one(registered: list[tuple[Any, str]]) -> None:
    # The engine tests run on this vLLM: the plugin must take over under it.
    assert plugin.vllm_series(vllm.__version__) in plugin.TESTED_VLLM
    plugin.register()
    assert [path for _, path in registered] == [plugin.BACKEND_PATH]


# ---------------------------------------------------------------------------------------------
# Per-engine state


class _CompilationConfig:
    """Stands for vLLM's CompilationConfig: the one object every runner of an engine shares."""


def _engine_config(spec: str = "torch") -> Any:
    return SimpleNamespace(
        additional_config={"attn_dispatch": {"target": spec}},
        model_config=SimpleNamespace(dtype=torch.float32),
        cache_config=SimpleNamespace(block_size=32),
        speculative_config=None,
        compilation_config=_CompilationConfig(),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def _layer(config: Any, heads: int = 4) -> Any:
    with set_current_vllm_config(config):
        return backend.AttnDispatchCPUImpl(heads, 32, 0.17, 2, None, None, "auto")


def test_each_engine_binds_its_own_and_drops_it_with_the_engine() -> None:
    """Alike layers of one engine share a binding; a second engine in the same process binds
    its own (was: a process-wide cache shared them across engines and never let go)."""
    first = _engine_config()
    a, b = _layer(first), _layer(first)
    assert a.dispatch.binding is b.dispatch.binding
    assert _layer(first, heads=8).dispatch.binding is not a.dispatch.binding  # another config
    other = _layer(_engine_config())
    assert other.dispatch.binding is not a.dispatch.binding
    assert other.dispatch.binding.backend(Phase.PREFILL) is not a.dispatch.binding.backend(
        Phase.PREFILL
    )


def _engine_and_layer() -> tuple[weakref.ref[Any], Any]:
    """An engine's layer, gone when this returns: a weak reference to its backend object, and
    a layer of a second engine that lives on."""
    first = _engine_config()
    layers = [_layer(first), _layer(first)]
    other = _layer(_engine_config())
    return weakref.ref(layers[0].dispatch.binding.backend(Phase.PREFILL)), other


def test_an_engines_bindings_go_with_the_engine() -> None:
    gone, other = _engine_and_layer()
    gc.collect()
    assert gone() is None  # vLLM dropped the engine (its config and layers): its backends too
    assert other.dispatch.binding.backend(Phase.PREFILL) is not None


def test_an_inactive_engine_keeps_vllms_own_attention() -> None:
    config = _engine_config()
    config.additional_config = {}
    layer = _layer(config)
    assert layer.dispatch is None and layer.dcp_dispatch is None
    assert layer.can_return_lse_for_decode is False


# ---------------------------------------------------------------------------------------------
# Decode context parallel: one step on one rank


def _dcp_metadata(
    q_lens: list[int], seq: list[int], table: torch.Tensor, *, block: int, interleave: int
) -> DispatchMetadata:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return DispatchMetadata(
        num_actual_tokens=starts[-1],
        max_query_len=max(q_lens),
        max_seq_len=max(seq),
        query_start_loc=torch.tensor(starts, dtype=I32),
        seq_lens=torch.tensor(seq, dtype=I32),
        block_table=table,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_size=block,
        num_speculative_tokens=0,
        mixed="split",
        interleave=interleave,
    )


SEQ = [5, 9, 2]


@pytest.mark.parametrize(
    ("interleave", "expect"),
    [
        # Decodes over 5, 9 and 2 tokens, 2 ranks; token t on rank (t // interleave) % 2.
        (1, {0: [3, 5, 1], 1: [2, 4, 1]}),
        (2, {0: [3, 5, 2], 1: [2, 4, 0]}),
        (4, {0: [4, 5, 2], 1: [1, 4, 0]}),
    ],
)
def test_dcp_decode_reads_each_ranks_share(interleave: int, expect: dict[int, list[int]]) -> None:
    assert [expect[0][i] + expect[1][i] for i in range(3)] == SEQ  # every token on one rank
    table = torch.tensor([[3, 9], [4, 6], [7, 0]], dtype=I32)
    for rank, lens in expect.items():
        md = _dcp_metadata([1, 1, 1], SEQ, table, block=4, interleave=interleave)
        if 0 in lens:  # a request with no token on this rank is refused, naming it
            with pytest.raises(UnsupportedModelError, match=r"request 2 \(2 tokens\) has no token"):
                md.dcp_step(2, rank)
            continue
        step = md.dcp_step(2, rank)
        assert step.prompt is None and step.decode is not None
        assert step.decode.kv_lens.tolist() == lens
        assert step.decode_rows.tolist() == [0, 1, 2]
        # Each request's first ceil(local / 4) blocks, page 2b (K of block b).
        want = [2 * int(table[i, b]) for i, n in enumerate(lens) for b in range(-(-n // 4))]
        assert step.decode.kv_indices.tolist() == want


def test_dcp_prompt_and_refusals() -> None:
    table = torch.tensor([[3, 9], [4, 6]], dtype=I32)
    # A prompt without cached context (6 tokens) and a decode: both served.
    step = _dcp_metadata([6, 1], [6, 7], table, block=4, interleave=1).dcp_step(2, 1)
    assert step.prompt is not None and step.prompt.phase is Phase.PREFILL
    assert step.prompt_rows.tolist() == list(range(6)) and step.prompt_pages == 2
    assert step.decode is not None and step.decode.kv_lens.tolist() == [3]
    # A chunk over a cached prefix is not served under DCP.
    with pytest.raises(UnsupportedModelError, match="request 0 runs 3 new tokens over 4 cached"):
        _dcp_metadata([3, 1], [7, 7], table, block=4, interleave=1).dcp_step(2, 0)
    # The step's inputs go through the step checks: a bad block id names the request.
    bad = torch.tensor([[3, 9], [-4, 6]], dtype=I32)
    with pytest.raises(InvalidBatchError, match="block ids must be in") as err:
        _dcp_metadata([1, 1], [5, 7], bad, block=4, interleave=1).dcp_step(2, 0)
    assert err.value.field == "block_table" and err.value.request == 1
    narrow = torch.tensor([[3], [4]], dtype=I32)
    with pytest.raises(InvalidBatchError, match="share of seq_lens 5 at block_size 4 needs 2"):
        _dcp_metadata([1, 1], [9, 3], narrow, block=4, interleave=1).dcp_step(2, 0)


def test_dcp_local_lengths_are_the_layouts_counts() -> None:
    from attn_dispatch.distributed import owned_positions
    from attn_dispatch.integrations.vllm._dcp import local_lengths

    lens = list(range(0, 70))
    for world in (1, 2, 3, 4):
        for interleave in (1, 2, 3, 16):
            for rank in range(world):
                got = local_lengths(lens, world=world, rank=rank, interleave=interleave)
                want = [
                    len(owned_positions(n, rank=rank, world=world, interleave=interleave))
                    for n in lens
                ]
                assert got == want, (world, interleave, rank)


# ---------------------------------------------------------------------------------------------
# vLLM's output buffer: each part's result is written into it, not allocated and copied


def _step_metadata(
    q_lens: list[int], seq: list[int], table: torch.Tensor, *, mixed: str
) -> DispatchMetadata:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return DispatchMetadata(
        num_actual_tokens=starts[-1],
        max_query_len=max(q_lens),
        max_seq_len=max(seq),
        query_start_loc=torch.tensor(starts, dtype=I32),
        seq_lens=torch.tensor(seq, dtype=I32),
        block_table=table,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_size=32,
        num_speculative_tokens=0,
        mixed=mixed,
    )


@pytest.mark.parametrize(
    ("q_lens", "seq", "mixed", "direct"),
    [
        ([1, 1, 5], [40, 9, 5], "split", True),  # decodes, then a prompt: two row slices
        ([1, 3], [40, 20], "extend", True),  # one part over every row
        ([1, 0, 1], [40, 7, 9], "extend", False),  # rows skip a request: scattered rows
    ],
)
@pytest.mark.parametrize("spec", ["torch", "native"])
def test_forward_writes_into_vllms_output_buffer(
    spec: str,
    q_lens: list[int],
    seq: list[int],
    mixed: str,
    direct: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The impl hands vLLM's ``output`` to ``attention`` as ``out=`` (a row slice of it per
    part, same memory), so no layer allocates a result and copies it; scattered rows fall back
    to a copy. Either way the rows equal ``attention`` without a buffer, and padding rows past
    the step's tokens are left untouched."""
    from attn_dispatch import attention
    from attn_dispatch.backends.native._lib import load

    if spec == "native" and isinstance(load(), str):
        pytest.skip(f"native library: {load()}")
    layer = _layer(_engine_config(spec))
    heads, dim = 4, 32
    tokens = sum(q_lens) + 2  # vLLM pads a step's query beyond its tokens
    torch.manual_seed(0)
    # vLLM's query: a view of the fused qkv projection (not contiguous).
    qkv = torch.randn(tokens, (heads + 2 * 2) * dim)
    query = qkv[:, : heads * dim].view(tokens, heads, dim)
    kv_cache = torch.randn(6, 2, 32, 2 * dim)
    table = torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=I32)[: len(q_lens)]
    md = _step_metadata(q_lens, seq, table, mixed=mixed)
    # vLLM's buffer: [tokens, heads * dim] made once per layer call, handed over as a view.
    buffer = torch.full((tokens, heads * dim), 7.0)
    output = buffer.view(tokens, heads, dim)

    calls: list[tuple[Any, Any]] = []

    def recording(*args: Any, **kw: Any) -> Any:
        result = attention(*args, **kw)
        calls.append((kw.get("out"), result))
        return result

    monkeypatch.setattr(backend, "attention", recording)
    returned = layer.forward(
        SimpleNamespace(layer_name="l0"), query, None, None, kv_cache, md, output
    )
    assert returned is output
    parts = md.parts_for(False)
    assert len(calls) == len(parts)
    row_bytes = heads * dim * buffer.element_size()
    for (out, result), part in zip(calls, parts, strict=True):
        if direct:
            assert isinstance(part.rows, slice)
            # vLLM's own memory, at the part's first row; the call returned it, nothing else.
            assert out is not None and result is out
            assert out.data_ptr() == buffer.data_ptr() + part.rows.start * row_bytes
            assert out.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        else:
            assert out is None and isinstance(part.rows, torch.Tensor)
    # The same rows as attention without a buffer, through the step's own scopes.
    k_cache, v_cache = layer._pages(kv_cache, layer.dispatch)
    for part in parts:
        with md.scope(layer.dispatch.binding, False, part):
            want = attention(query[part.rows].contiguous(), k_cache, v_cache)
        torch.testing.assert_close(output[part.rows], want)
    n = sum(q_lens)
    assert bool((buffer[n:] == 7.0).all())
