"""The caller's output buffer (``attention(..., out=buf)``) on every backend that declares it.

A backend joins by declaring ``Capabilities(out_buffer=True)``: its handlers then take
``out=`` and write the result there. The rules, checked here for each such backend:

- with and without ``out`` the result is the same, bit for bit (same backend, same inputs),
  in every phase and kind, every declared variant, ``return_lse`` included;
- the call returns ``out`` itself (``(out, lse)`` with ``return_lse=True``), through
  ``attention`` and through the direct path (``binding.handler(phase)``);
- a wrong shape, dtype or device, a non-contiguous buffer, or one that shares memory with q
  or the caches is refused with ``InvalidBatchError`` naming ``"out"`` (by the core, and by
  the backend's own handler called without a binding).

A backend that does not declare it still fills ``out``: the core copies its result there
(and never passes ``out=`` to its handler).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings

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
from tests.contract.cases import Materialised
from tests.contract.cases import materialise
from tests.contract.test_contract import BACKENDS
from tests.contract.test_contract import FEW
from tests.contract.test_contract import FEW_EXAMPLES
from tests.contract.test_contract import LIMITS
from tests.contract.test_contract import THOROUGH
from tests.contract.test_contract import _case
from tests.contract.test_contract import device_for
from tests.contract.test_contract import served
from tests.contract.test_contract import skip_if_refused
from tests.contract.test_contract import skip_if_unavailable
from tests.strategies import DEFAULT_LIMITS
from tests.strategies import KernelCase
from tests.strategies import variant_cases

OUT_EXAMPLES = 100 if THOROUGH else 15
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _declared(backend: str) -> None:
    skip_if_unavailable(backend)
    if not list_backends()[backend].out_buffer:
        pytest.skip(f"{backend!r} does not declare Capabilities(out_buffer=True)")


def test_every_builtin_declares_out() -> None:
    """The built-in backends all write into a caller's buffer themselves."""
    caps = list_backends()
    assert {b: caps[b].out_buffer for b in BACKENDS} == dict.fromkeys(BACKENDS, True)


def _bound(backend: str, case: KernelCase) -> tuple[Any, Materialised]:
    m = materialise(case, device_for(backend))
    return bind(backend, m.config, label=f"out-{backend}"), m


def _call(binding: Any, m: Materialised, lse: bool, **kw: Any) -> Any:
    if lse:
        kw["return_lse"] = True
    with attn_scope(binding, m.batch):
        return attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **m.extras(), **kw)


def _fresh(m: Materialised, case: KernelCase) -> torch.Tensor:
    # Filled with NaN: a row the backend left unwritten shows.
    shape = (m.q.shape[0], case.num_q_heads, case.v_head_dim)
    return torch.full(shape, float("nan"), dtype=m.q.dtype, device=m.q.device)


def check_same_with_out(backend: str, case: KernelCase) -> None:
    binding, m = _bound(backend, case)
    want = _call(binding, m, case.lse)
    buf = _fresh(m, case)
    got = _call(binding, m, case.lse, out=buf)
    if case.lse:
        assert type(got) is tuple and got[0] is buf
        assert torch.equal(got[1], want[1])
        want = want[0]
    else:
        assert got is buf
    # Bit for bit (NaN where the backend writes NaN: compared as raw bits).
    assert _same_bits(buf, want)
    # The direct path: the binding's checked handler takes out= too.
    direct = _fresh(m, case)
    handler = binding.handler(case.phase)
    kw: dict[str, Any] = dict(m.extras())
    if case.lse:
        kw["return_lse"] = True
    res = handler(m.q, m.k_cache, m.v_cache, binding.plan(m.batch), m.sm_scale, out=direct, **kw)
    assert (res[0] if case.lse else res) is direct
    assert _same_bits(direct, want)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_gives_the_same_result(backend: str, kind: str, phase: Phase) -> None:
    """Every declared variant (lse included), with and without out=: identical bits."""
    _declared(backend)
    serves, _ = served(backend, kind, phase)
    limits = LIMITS.get(backend, DEFAULT_LIMITS)
    lse_ok = "lse" in serves.variants

    @settings(
        max_examples=FEW if backend in FEW_EXAMPLES else OUT_EXAMPLES,
        deadline=None,
        suppress_health_check=SLOW,
    )
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=limits))
    def check(case: KernelCase) -> None:
        if lse_ok and case.seed % 2:
            case = dataclasses.replace(case, lse=True)
        check_same_with_out(backend, case)

    check()


def _plain(**over: Any) -> KernelCase:
    return _case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(20, 3), **over)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_an_empty_batch(backend: str) -> None:
    """SGLang's IDLE forward: an empty out is returned as it is."""
    _declared(backend)
    case = _plain()
    skip_if_refused(backend, case)
    binding, m = _bound(backend, case)
    empty = AttnBatch.build(
        Phase.DECODE, q_lens=[], kv_lens=[], page_tables=[], page_size=case.page_size
    ).to(m.q.device)
    buf = m.q.new_empty((0, case.num_q_heads, case.v_head_dim))
    with attn_scope(binding, empty):
        assert attention(m.q[:0], m.k_cache, m.v_cache, sm_scale=m.sm_scale, out=buf) is buf


def _bad_buffers(m: Materialised, case: KernelCase) -> dict[str, tuple[Any, str]]:
    """name -> (a buffer the rule refuses, a word the message must contain)."""
    t, h, dv = m.q.shape[0], case.num_q_heads, case.v_head_dim
    good = dict(dtype=m.q.dtype, device=m.q.device)
    other = torch.float16 if m.q.dtype != torch.float16 else torch.float32
    assert m.v_cache is not None
    v_flat = m.v_cache.view(-1)
    # q inside a larger storage: a buffer can then start in the middle of q's bytes.
    n = m.q.numel()
    big = torch.empty(2 * n, dtype=m.q.dtype, device=m.q.device)
    big[:n].copy_(m.q.view(-1))
    m.q = big[:n].view(m.q.shape)
    return {
        "not a tensor": ([[0.0]], "torch.Tensor"),
        "rows": (torch.empty(t + 1, h, dv, **good), "shape"),  # type: ignore[arg-type]
        "heads": (torch.empty(t, h + 1, dv, **good), "shape"),  # type: ignore[arg-type]
        "width": (torch.empty(t, h, dv + 1, **good), "shape"),  # type: ignore[arg-type]
        "dtype": (torch.empty(t, h, dv, dtype=other, device=m.q.device), "dtype"),
        "device": (torch.empty(t, h, dv, dtype=m.q.dtype, device="meta"), "on meta"),
        "strided": (torch.empty(t, dv, h, **good).transpose(1, 2), "contiguous"),  # type: ignore[arg-type]
        "q itself": (m.q, "shares memory with q"),
        # A view that starts inside q's bytes: no data_ptr is equal, the spans overlap.
        "q shifted": (big[n // 2 : n // 2 + t * h * dv].view(t, h, dv), "with q"),
        "k_cache": (m.k_cache.view(-1)[: t * h * dv].view(t, h, dv), "with k_cache"),
        "v_cache": (v_flat[v_flat.numel() - t * h * dv :].view(t, h, dv), "with v_cache"),
    }


@pytest.mark.parametrize(
    "bad",
    [
        "not a tensor",
        "rows",
        "heads",
        "width",
        "dtype",
        "device",
        "strided",
        "q itself",
        "q shifted",
        "k_cache",
        "v_cache",
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_out_is_refused(backend: str, bad: str) -> None:
    """Through attention(), the direct path, and the backend's own handler (no binding)."""
    _declared(backend)
    # q and v of one width, so q's bytes can pose as an out buffer.
    case = _plain(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64)
    skip_if_refused(backend, case)
    binding, m = _bound(backend, case)
    buf, word = _bad_buffers(m, case)[bad]
    plan = binding.plan(m.batch)
    raw = binding.route(Phase.DECODE).raw
    for call in (
        lambda: _call(binding, m, False, out=buf),
        lambda: binding.handler(Phase.DECODE)(m.q, m.k_cache, m.v_cache, plan, m.sm_scale, out=buf),
        lambda: raw(m.q, m.k_cache, m.v_cache, plan, m.sm_scale, out=buf),
    ):
        with pytest.raises(InvalidBatchError, match=word) as err:
            call()
        assert err.value.field == "out"


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
    handler = binding.handler(Phase.DECODE)
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
    for k in kv_lens:
        n = -(-k // PS)
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
                return attention(*args, sm_scale=0.2, return_lse=True, **more, **kw)

            want, want_lse = run()
            buf = torch.full((t, H, width), float("nan"))
            got, lse = run(out=buf)
            assert got is buf and torch.equal(buf, want) and torch.equal(lse, want_lse)
            with pytest.raises(InvalidBatchError, match="shape") as err:
                run(out=torch.empty(t, H, width + 1))
            assert err.value.field == "out"
