"""The output buffer (``attention(..., out=buf)``) over every built-in backend: the kit's
suite (``attn_dispatch.testing.contract.test_out``, parametrised by conftest.py), and what
only this repository checks: every built-in declares ``out_buffer``; the core's copy for a
test backend that does not; ``bind`` refusing a declared ``out`` the handler cannot take; a
backend that ignores ``out`` caught; the torch reference's MLA forms filling ``out``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import BackendUnavailableError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backend import Registry
from attn_dispatch.backend import list_backends
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks
from attn_dispatch.testing.contract.cases import KernelCase
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.test_out import *  # noqa: F403  (the kit's tests)
from attn_dispatch.testing.contract.test_out import call as _call
from attn_dispatch.testing.contract.test_out import fresh_out as _fresh
from tests.contract.conftest import BACKENDS


def test_every_builtin_declares_out() -> None:
    """The built-in backends all write into a caller's buffer themselves."""
    caps = list_backends()
    assert {b: caps[b].out_buffer for b in BACKENDS} == dict.fromkeys(BACKENDS, True)


def _plain(**over: Any) -> KernelCase:
    return make_case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(20, 3), **over)


# -- a backend that does not declare out_buffer --------------------------------------------------


class _Plain(BackendBase):
    """The torch reference behind a handler with no out= parameter."""

    name = "plain"
    calls: list[dict[str, Any]]

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        from attn_dispatch.backends.reference.backend import TorchBackend

        self.inner = TorchBackend(config)
        self.calls = []

    def plan(self, batch: Any) -> Any:
        return self.inner.plan(batch)

    def handler(self, phase: Phase) -> Any:
        def run(
            q: Any, k: Any, v: Any, plan: Any, sm_scale: float, *, return_lse: bool = False
        ) -> Any:
            self.calls.append({"return_lse": return_lse})
            return self.inner.run(q, k, v, plan, sm_scale, return_lse=return_lse)

        return run


def _registry(out_buffer: bool, factory: Any = _Plain) -> Registry:
    reg = Registry(plugins=False)
    caps = Capabilities(kinds={"mha"}, variants={"lse"}, out_buffer=out_buffer)
    reg.register("plain", capabilities=caps, factory=factory)
    return reg


def test_undeclared_backend_gets_a_copy_into_out() -> None:
    """No out= reaches the handler: the core copies its result into the buffer and returns
    the buffer (the lse beside it); the buffer rules are the same."""
    case = _plain(lse=True)
    m = materialise(case)
    binding = bind("plain", m.config, registry=_registry(False))
    backend = binding.backend(Phase.DECODE)
    want, want_lse = _call(binding, m, True)
    buf = _fresh(m, case)
    with attn_scope(binding, m.batch):
        assert attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, out=buf) is buf
        got, lse = attention(
            m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, out=buf, return_lse=True
        )
    assert got is buf and torch.equal(buf, want) and torch.equal(lse, want_lse)
    direct = _fresh(m, case)
    handler: Any = binding.handler(Phase.DECODE)
    assert (
        handler(m.q, m.k_cache, m.v_cache, binding.plan(m.batch), m.sm_scale, out=direct) is direct
    )
    assert torch.equal(direct, want)
    assert all("out" not in c for c in backend.calls)  # type: ignore[attr-defined]
    with pytest.raises(InvalidBatchError, match="shares memory with q") as err:
        _call(binding, m, False, out=m.q[:, :, : case.v_head_dim])
    assert err.value.field == "out"


def test_bind_refuses_a_declared_out_the_handler_cannot_take() -> None:
    with pytest.raises(BackendUnavailableError, match="out="):
        bind("plain", materialise(_plain()).config, registry=_registry(True))


class _Liar(_Plain):
    """Declares out_buffer, takes out=, and returns a fresh tensor instead."""

    def handler(self, phase: Phase) -> Any:
        def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float, *, out: Any = None) -> Any:
            return self.inner.run(q, k, v, plan, sm_scale)

        return run


def test_a_backend_that_ignores_out_is_caught() -> None:
    case = _plain()
    m = materialise(case)
    binding = bind("plain", m.config, registry=_registry(True, _Liar))
    with pytest.raises(InvalidBatchError, match="backend bug") as err:
        _call(binding, m, False, out=_fresh(m, case))
    assert err.value.field == "out"


def test_out_buffer_must_be_a_bool() -> None:
    with pytest.raises(InvalidSpecError, match="out_buffer"):
        Capabilities(kinds={"mha"}, out_buffer=1)  # type: ignore[arg-type]


# -- MLA: the decompressed forms ------------------------------------------------------------------

LAT, ROPE, NOPE, VD, H, PS = 16, 8, 12, 10, 2, 4


def test_torch_mla_forms_fill_out() -> None:
    """The absorbed form writes a [T, H, latent] buffer; the decompressed forms a
    [T, H, mha_v_head_dim] one (MHA: by the backend; MHA_CHUNKED, which merges its chunks
    into a fresh tensor: by the core's copy), with the lse beside it."""
    g = torch.Generator().manual_seed(5)
    config = AttnConfig(
        kind="mla", num_q_heads=H, num_kv_heads=1, head_dim=LAT + ROPE, v_head_dim=LAT,
        dtype="float32", page_size=PS, mha_head_dim=NOPE + ROPE, mha_v_head_dim=VD,
        return_lse=True,
    )  # fmt: skip
    q_lens, prefix = [4, 2], [13, 6]
    kv_lens = [a + b for a, b in zip(q_lens, prefix, strict=True)]
    tables, at = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // PS)
        tables.append(list(range(at, at + n)))
        at += n
    b = AttnBatch.build(
        Phase.PREFILL, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=PS
    )
    cache = torch.randn(at, PS, LAT + ROPE, generator=g)
    w_uk = torch.randn(H, NOPE, LAT, generator=g) / 4
    w_uv = torch.randn(H, VD, LAT, generator=g) / 4

    def up_proj(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lat, rope = rows[:, :LAT], rows[:, LAT:]
        k = torch.cat(
            [torch.einsum("nl,hdl->nhd", lat, w_uk), rope[:, None, :].expand(-1, H, -1)], dim=-1
        )
        return k, torch.einsum("nl,hvl->nhv", lat, w_uv)

    t = b.num_tokens
    policies = {
        AttnForm.MLA: FormPolicy.absorbed_only(),
        AttnForm.MHA: FormPolicy(short_prefix_max=10**6),
        AttnForm.MHA_CHUNKED: FormPolicy(no_prefix=AttnForm.MHA_CHUNKED, short_prefix_max=0),
    }
    for form, policy in policies.items():
        binding = bind("torch", config, options={"torch": {"form_policy": policy}})
        with attn_scope(binding, b):
            assert attention_form() is form
            if form is AttnForm.MLA:
                q = torch.randn(t, H, LAT + ROPE, generator=g)
                args: tuple[Any, ...] = (q, cache, None)
                extra: dict[str, Any] = {}
                width = LAT
            else:
                q = torch.randn(t, H, NOPE + ROPE, generator=g)
                k, v = up_proj(gather_latent(cache, b))
                width = VD
                if form is AttnForm.MHA:
                    args, extra = (q, k, v), {}
                else:
                    ends = torch.cumsum(b.kv_lens_host, 0).tolist()
                    new = torch.cat(
                        [torch.arange(e - n, e) for e, n in zip(ends, q_lens, strict=True)]
                    )
                    args = (q, k[new], v[new])
                    extra = {
                        "prefix": lambda: latent_prefix_chunks(cache, b, up_proj, chunk_tokens=5)
                    }

            def run(args: tuple[Any, ...] = args, extra: dict[str, Any] = extra, **kw: Any) -> Any:
                more = {n: f() for n, f in extra.items()}
                fn: Any = attention  # positional tensors, keywords from the caller
                return fn(*args, sm_scale=0.2, return_lse=True, **more, **kw)

            want, want_lse = run()
            buf = torch.full((t, H, width), float("nan"))
            got, lse = run(out=buf)
            assert got is buf and torch.equal(buf, want) and torch.equal(lse, want_lse)
            with pytest.raises(InvalidBatchError, match="shape") as err:
                run(out=torch.empty(t, H, width + 1))
            assert err.value.field == "out"
