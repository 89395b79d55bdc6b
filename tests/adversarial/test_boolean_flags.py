"""One rule for boolean flags, on every path: a Python ``bool`` or our error naming the field.

The rule (docs: the attention call and backend options): ``True`` and ``False`` only. Truthy
stand-ins are refused, not read: ``"yes"`` and ``"false"`` (a string is always truthy), ``1``
and ``0``, ``None`` on a raw route, and numpy's and torch's bools too -- ``numpy.bool_`` is no
``bool`` subclass, and reading a 0-dim tensor's truth would be a device sync on CUDA and an
implicit conversion everywhere. The raw routes (a backend's handler called directly, as
frameworks that own their plans do) follow it as ``attention()`` and ``AttnConfig`` do.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import list_backends

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

np = pytest.importorskip("numpy")

NOT_BOOLS: list[Any] = ["yes", "false", 1, 0, 1.0, None, np.bool_(True), torch.tensor(True)]
IDS = ["str-yes", "str-false", "int-1", "int-0", "float", "None", "numpy-bool", "torch-bool"]
BACKENDS = ["torch", "native", "triton"]


def _cfg(**over: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16,
        dtype="float32", page_size=4, device="cpu", return_lse=True,
    )  # fmt: skip
    base.update(over)
    return AttnConfig(**base)


def _problem() -> tuple[AttnBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 3], page_tables=[[2, 0], [1]], page_size=4
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=g)
    k = torch.randn(3, 4, 2, 16, generator=g)
    return batch, q, k, torch.randn(3, 4, 2, 16, generator=g)


def _available(backend: str) -> None:
    caps = list_backends().get(backend)
    if caps is None or caps.availability_reasons():
        pytest.skip(f"backend {backend!r} cannot run here")


@pytest.mark.parametrize("value", NOT_BOOLS, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_route_return_lse_must_be_a_bool(backend: str, value: Any) -> None:
    _available(backend)
    binding = bind(backend, _cfg())
    be = binding.backend(Phase.DECODE)
    batch, q, k, v = _problem()
    plan = be.plan(batch)
    run: Any = be.handler(Phase.DECODE)  # the raw route, return_lse= included
    with pytest.raises(InvalidBatchError) as info:
        run(q, k, v, plan, 0.25, return_lse=value)
    assert info.value.field == "return_lse"
    assert repr(value) in str(info.value)
    # and the two bools work
    out = run(q, k, v, plan, 0.25, return_lse=False)
    got, lse = run(q, k, v, plan, 0.25, return_lse=True)
    torch.testing.assert_close(got, out)
    assert lse.shape == (2, 4)


@pytest.mark.parametrize("value", [v for v in NOT_BOOLS if v is not None], ids=IDS[:5] + IDS[6:])
def test_attention_return_lse_must_be_a_bool(value: Any) -> None:
    batch, q, k, v = _problem()
    with attn_scope(bind("torch", _cfg()), batch), pytest.raises(InvalidBatchError) as info:
        attention(q, k, v, sm_scale=0.25, return_lse=value)
    assert info.value.field == "return_lse"


@pytest.mark.parametrize("value", NOT_BOOLS, ids=IDS)
@pytest.mark.parametrize("flag", ["causal", "return_lse", "sinks", "tree_verify"])
def test_config_flags_must_be_bools(flag: str, value: Any) -> None:
    with pytest.raises(InvalidSpecError) as info:
        _cfg(**{flag: value})
    assert info.value.field == flag


@pytest.mark.parametrize("value", NOT_BOOLS, ids=IDS)
@pytest.mark.parametrize(
    ("backend", "option"), [("torch", "validate"), ("native", "cascade"), ("triton", "validate")]
)
def test_backend_flag_options_must_be_bools(backend: str, option: str, value: Any) -> None:
    _available(backend)
    with pytest.raises(InvalidSpecError) as info:
        bind(backend, _cfg(), options={backend: {option: value}})
    assert info.value.field == option
