"""``na_run``'s tensor checks (ABI 9): each call's tensors are described to the library (data,
shape, strides, dtype code, host) and checked there against the config and the plan before
any load; q's rows may be strided (a column slice of a fused QKV projection).

Straight through the C ABI, every mismatch is refused with ``NA_BAD_ARGS``; through the
handler, the refusal is explained by the Python checks (the same ``InvalidBatchError`` as
before the checks moved); the packed bytes the backend passes are the ctypes struct's.
"""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch.backends.native._lib import RUN_ARGS  # noqa: E402
from attn_dispatch.backends.native._lib import NaRunArgs  # noqa: E402
from attn_dispatch.backends.native._lib import NaStatus  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402

LIB = load()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")

QH, KVH, D, PS = 4, 2, 32, 8


def _backend(dtype: str = "float32", kind: str = "mha") -> object:
    from attn_dispatch.backends.native.backend import NativeBackend

    if kind == "mla":
        cfg = AttnConfig("mla", QH, 1, 48, 32, dtype=dtype, page_size=PS, device="cpu")
    else:
        cfg = AttnConfig("mha", QH, KVH, D, dtype=dtype, page_size=PS, device="cpu")
    return NativeBackend(cfg, num_threads=2)


def _prefill() -> AttnBatch:
    return AttnBatch.build(
        Phase.PREFILL, q_lens=[3, 5], kv_lens=[9, 13], page_tables=[[0, 1], [2, 3]],
        page_size=PS, num_pages=5,
    )  # fmt: skip


def _fused(tokens: int, dtype: torch.dtype, width: int = D) -> torch.Tensor:
    """q as vLLM's Llama hands it: the first columns of a [tokens, q + k + v] projection."""
    qkv = torch.randn(tokens, (QH + 2 * KVH) * width, dtype=dtype)
    return qkv[:, : QH * width].view(tokens, QH, width)


def test_packed_args_are_the_struct() -> None:
    # Each field at the struct's offset: the values packed in field order read back the same.
    values, expect = [], {}
    for i, (name, ctype) in enumerate(NaRunArgs._fields_):
        if issubclass(ctype, ctypes.Array):
            vals = [1000 * i + j + 1 for j in range(ctype._length_)]
            values += vals
            expect[name] = vals
        else:
            v = 0.5 * (i + 1) if ctype is ctypes.c_float else 1000 * i + 7
            values.append(v)
            expect[name] = v
    raw = RUN_ARGS.pack(*values)
    args = NaRunArgs.from_buffer_copy(raw)
    for name, want in expect.items():
        got = getattr(args, name)
        assert (list(got) if isinstance(want, list) else got) == want, name
    assert RUN_ARGS.size == ctypes.sizeof(NaRunArgs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_strided_q_rows_give_the_contiguous_answer(dtype: str, phase: Phase) -> None:
    be = _backend(dtype)
    tdtype = getattr(torch, dtype)
    if phase is Phase.DECODE:
        batch = AttnBatch.build(
            phase, q_lens=[1, 1, 1], kv_lens=[9, 3, 17], page_tables=[[0, 1], [2], [3, 4, 1]],
            page_size=PS, num_pages=5,
        )  # fmt: skip
    else:
        batch = _prefill()
    plan = be.plan(batch)
    tokens = int(batch.qo_indptr[-1])
    q = _fused(tokens, tdtype)
    assert not q.is_contiguous()
    k = torch.randn(5, PS, KVH, D, dtype=tdtype)
    v = torch.randn(5, PS, KVH, D, dtype=tdtype)
    run = be.handler(phase)
    want = run(q.contiguous(), k, v, plan, 0.2)
    assert torch.equal(run(q, k, v, plan, 0.2), want)
    out = torch.full_like(want, 7.0)
    assert run.attn_dispatch_core_checked(q, k, v, plan, 0.2, out=out) is out
    assert torch.equal(out, want)


def test_strided_q_rows_mla() -> None:
    be = _backend("bfloat16", "mla")
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[9, 5], page_tables=[[0, 1], [2]], page_size=PS,
        num_pages=3,
    )  # fmt: skip
    plan = be.plan(batch)
    q = torch.randn(2, 2 * QH, 48, dtype=torch.bfloat16)[:, :QH]  # rows 2 * QH * 48 apart
    assert not q.is_contiguous()
    k = torch.randn(3, PS, 48, dtype=torch.bfloat16)
    run = be.handler(Phase.DECODE)
    assert torch.equal(run(q, k, None, plan, 0.2), run(q.contiguous(), k, None, plan, 0.2))
    # A V cache handed to MLA (which reads none) is refused on both paths, naming v_cache.
    out = torch.empty(2, QH, 32, dtype=torch.bfloat16)
    for call in (run, run.attn_dispatch_core_checked):
        with pytest.raises(InvalidBatchError) as info:
            call(q, k, k, plan, 0.2, out=out)
        assert info.value.field == "v_cache"


def _abi_call(be: object, plan: object, **over: object) -> int:
    """na_run with the described tensors of a fitting call, one description replaced."""
    from attn_dispatch.backends.native.backend import run_args

    tensors = {
        "q": torch.randn(8, QH, D),
        "k": torch.randn(5, PS, KVH, D),
        "v": torch.randn(5, PS, KVH, D),
        "out": torch.empty(8, QH, D),
    }
    for name in ("q", "k", "v", "out"):
        if name in over:
            tensors[name] = over.pop(name)  # type: ignore[assignment]
    args = run_args(
        tensors["q"], tensors["k"], tensors["v"], tensors["out"], sm_scale=0.2, num_threads=1
    )
    for name, value in over.items():
        if isinstance(value, tuple):
            getattr(args, name)[:] = value
        else:
            setattr(args, name, value)
    be_any: object = be
    return int(
        be_any._run(be_any._runner, be_any._issued[id(plan)].plan_id, ctypes.byref(args))  # type: ignore[attr-defined]
    )


_BAD = {
    "q dtype": {"q_dtype": 1},
    "q dtype unknown": {"q_dtype": -1},
    "k dtype": {"k_dtype": 2},
    "v dtype": {"v_dtype": 1},
    "not host": {"host": 0},
    "q rows": {"q": torch.randn(7, QH, D)},
    "q heads": {"q": torch.randn(8, QH + 1, D)},
    "q dim": {"q": torch.randn(8, QH, D + 1)},
    "q heads not dense": {"q": torch.randn(8, 2 * QH, D)[:, ::2]},
    "q dims not dense": {"q": torch.randn(8, QH, 2 * D)[:, :, ::2]},
    "q negative row stride": {"q_stride": (-QH * D, D, 1)},
    "k pages below the plan": {"k": torch.randn(3, PS, KVH, D), "v": torch.randn(3, PS, KVH, D)},
    "k page size": {"k": torch.randn(5, PS + 1, KVH, D)},
    "k heads": {"k": torch.randn(5, PS, KVH + 1, D)},
    "k not contiguous": {"k": torch.randn(5, PS, KVH, 2 * D)[..., ::2]},
    "v not contiguous": {"v": torch.randn(5, PS, 2 * KVH, D)[:, :, ::2]},
    "v pages != k pages": {"v": torch.randn(6, PS, KVH, D)},
    "v width": {"v": torch.randn(5, PS, KVH, D + 1)},
    "out rows": {"out": torch.empty(7, QH, D)},
    "k described with the plan's pages but strides of another": {"k_stride": (1, 1, 1, 1)},
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_the_library_refuses_each_tensor_that_does_not_fit(case: str) -> None:
    be = _backend()
    plan = be.plan(_prefill())  # type: ignore[attr-defined]
    assert _abi_call(be, plan) == NaStatus.OK
    assert _abi_call(be, plan, **dict(_BAD[case])) == NaStatus.BAD_ARGS


@pytest.mark.parametrize(
    ("what", "field"),
    [
        ("k pages", "kv_indices"),
        ("q dtype", "q"),
        ("q heads not dense", "q"),
        ("v not contiguous", "v_cache"),
        ("k on meta", "k_cache"),
    ],
)
def test_the_core_checked_path_names_what_does_not_fit(what: str, field: str) -> None:
    # The handler's variant for a binding's calls checks the tensors in C only; a refusal is
    # explained by the Python checks: the same error class and field as a direct call's.
    be = _backend()
    plan = be.plan(_prefill())  # type: ignore[attr-defined]
    q, k, v = torch.randn(8, QH, D), torch.randn(5, PS, KVH, D), torch.randn(5, PS, KVH, D)
    if what == "k pages":
        k, v = k[:3], v[:3]
    elif what == "q dtype":
        q = q.double()
    elif what == "q heads not dense":
        q = torch.randn(8, 2 * QH, D)[:, ::2]
    elif what == "v not contiguous":
        v = torch.randn(5, PS, 2 * KVH, D)[:, :, ::2]
    else:
        k = k.to("meta")
    run = be.handler(Phase.PREFILL)  # type: ignore[attr-defined]
    out = torch.empty(8, QH, D)
    with pytest.raises(InvalidBatchError) as direct:
        run(q, k, v, plan, 0.2)
    with pytest.raises(InvalidBatchError) as checked:
        run.attn_dispatch_core_checked(q, k, v, plan, 0.2, out=out)
    assert checked.value.field == direct.value.field == field
    assert str(checked.value) == str(direct.value)
