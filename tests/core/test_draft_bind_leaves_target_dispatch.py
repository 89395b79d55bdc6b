"""The seed bug (SGLang issue 28528) as a regression test.

A target runner with DeepSeek-like MLA layers binds its kernels first; then a draft runner
binds an MHA-only backend. With attn_dispatch the target's dispatch is unchanged in every
phase. The same scenario written the old way, with a process-global setting read at forward
time, leaks the draft's choice into the target: that half of the test shows the bug class is
real, so the first half is not passing by accident.
"""

from __future__ import annotations

from typing import Any

import pytest

from attn_dispatch import BackendSpec
from attn_dispatch import Binding
from attn_dispatch import DispatchEvent
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch
from attn_dispatch import resolve
from attn_dispatch.backend import Capabilities
from tests.strategies import MHA_ONLY_CAPS
from tests.strategies import EchoHandler
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import mla_config
from tests.strategies import register_echo

pytestmark = pytest.mark.usefixtures("registry_snapshot")

MLA_CAPS = Capabilities(
    kinds={"mla"}, devices={"cpu"}, head_dims={576}, v_head_dims={512}, dtypes={"bfloat16"}
)


class ModelRunner:
    """The part of a framework's model runner that matters here."""

    def __init__(self, label: str, spec: BackendSpec, config: Any) -> None:
        self.label = label
        self.attn_binding: Binding = bind(spec, config, label=label)

    def forward(self, phase: Phase, layers: int = 3) -> list[Any]:
        with attn_scope(self, FakeBatch(phase)):
            return [attention(None, None, sm_scale=1.0) for _ in range(layers)]


def _register_kernels() -> None:
    register_echo("mla_kernel", MLA_CAPS, replace=True)  # stands in for FlashMLA / cutlass MLA
    register_echo("mla_prefill", MLA_CAPS, replace=True)
    register_echo("mha_only", MHA_ONLY_CAPS, replace=True)  # FlashInfer's MHA path, say


def _start_target_then_draft() -> tuple[ModelRunner, ModelRunner, dict[Phase, EchoHandler]]:
    _register_kernels()
    target = ModelRunner(
        "target", BackendSpec.parse("prefill=mla_prefill,decode=mla_kernel"), mla_config()
    )
    before = {p: target.attn_binding.handler(p) for p in Phase}
    draft = ModelRunner("draft", BackendSpec.uniform("mha_only"), mha_config(dtype="bfloat16"))
    return target, draft, before


def test_target_dispatch_unchanged_by_draft() -> None:
    target, draft, before = _start_target_then_draft()
    expected = {
        Phase.PREFILL: "mla_prefill",
        Phase.DECODE: "mla_kernel",
        Phase.VERIFY: "mla_prefill",
    }  # verify follows verify_mode="prefill"
    assert {p: target.attn_binding.handler(p) for p in Phase} == before
    for p in Phase:
        with attn_scope(target):
            assert resolve(p) is before[p]
            assert resolve(p).backend == expected[p]
            with attn_scope(draft):  # the draft runs inside the target's step
                assert resolve(p).backend == "mha_only"
            assert resolve(p) is before[p]

    with record_dispatch() as rec:
        for p in Phase:
            out_t = target.forward(p)
            out_d = draft.forward(p, layers=2)
            assert {o[0] for o in out_t} == {expected[p]}
            assert {o[0] for o in out_d} == {"mha_only"}
    want = []
    for p in Phase:
        want += [DispatchEvent("target", p, expected[p], form="mla")] * 3  # absorbed MLA
        want += [DispatchEvent("draft", p, "mha_only")] * 2
    assert rec.events == want
    assert not any(e.label == "target" and e.backend == "mha_only" for e in rec.events)


def test_target_mla_on_mha_only_backend_refused_at_bind() -> None:
    _start_target_then_draft()
    with pytest.raises(IncompatibleBackendError) as info:
        bind(BackendSpec.uniform("mha_only"), mla_config(), label="target")
    err = info.value
    assert err.label == "target"
    assert set(err.reasons) == set(Phase)
    for backend, reasons in err.reasons.values():
        assert backend == "mha_only"
        assert "kind 'mla' is not supported (supported: 'mha')" in reasons
    assert "verify -> 'mha_only': kind 'mla' is not supported" in str(err)


def test_global_setting_read_at_forward_time_leaks() -> None:
    """SGLang's old pattern: start-up writes the backend name into process-global settings,
    and the forward reads it back. The draft's start-up overwrites the target's choice."""
    _register_kernels()
    global_settings: dict[str, str] = {}
    kernels = {
        name: bind(name, cfg).handler(Phase.DECODE)
        for name, cfg in (("mla_kernel", mla_config()), ("mha_only", mha_config()))
    }

    class GlobalRunner:
        def __init__(self, backend: str) -> None:
            global_settings["decode_attention_backend"] = backend  # "init the global server args"

        def forward(self) -> Any:
            kernel = kernels[global_settings["decode_attention_backend"]]  # read at forward time
            return kernel(None, None, None, None, 1.0)

    target = GlobalRunner("mla_kernel")
    assert target.forward()[0] == "mla_kernel"  # correct while the target is alone
    GlobalRunner("mha_only")  # the draft starts up
    assert target.forward()[0] == "mha_only"  # leaked: the target now runs the MHA-only kernel

    # The same two runners with attn_dispatch: the draft's start-up cannot reach the target.
    t, d, _ = _start_target_then_draft()
    assert {o[0] for o in t.forward(Phase.DECODE)} == {"mla_kernel"}
    assert {o[0] for o in d.forward(Phase.DECODE)} == {"mha_only"}


def test_real_mla_numbers_unchanged_by_draft() -> None:
    """With the torch reference: the target's MLA output is bit-identical before and after a
    draft is bound and run in between."""
    torch = pytest.importorskip("torch")
    from attn_dispatch import AttnBatch

    _register_kernels()
    cfg = mla_config(page_size=4, dtype="float32")
    target = bind("torch", cfg, label="target")
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 4, 576, generator=gen)
    q = torch.randn(1, 16, 576, generator=gen)
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1], kv_lens=[7], page_tables=[[2, 0]], page_size=4
    )

    def run() -> Any:
        with attn_scope(target, batch):
            return attention(q, k_cache, None, sm_scale=576**-0.5)

    first = run()
    assert first.shape == (1, 16, 512)
    draft = bind("mha_only", mha_config(), label="draft")
    with attn_scope(draft, FakeBatch(Phase.DECODE)):
        attention(None, None, sm_scale=1.0)
        second = run()  # the target nested inside the draft's scope
    assert torch.equal(first, second) and torch.equal(first, run())
    # And the numbers are MLA's: softmax(q k^T) v over the 7 tokens, v = k[..., :512].
    keys = torch.cat([k_cache[2], k_cache[0]])[:7]
    p = torch.softmax((q[0] @ keys.T) * 576**-0.5, dim=-1)
    torch.testing.assert_close(first[0], p @ keys[:, :512], rtol=1e-5, atol=1e-5)
