"""The caller's output buffer: ``attention(..., out=buf)``.

Every backend serves it. One that declares ``Capabilities(out_buffer=True)`` gets ``out=``
in its handlers and writes the result there; for one that does not, the core copies the
handler's result into the buffer. Either way, checked here:

- with and without ``out`` the result is the same, bit for bit (same backend, same inputs),
  in every phase, kind, layer variant and FP8 format the backend declares, ``return_lse``
  included;
- the call returns ``out`` itself (``(out, lse)`` with ``return_lse=True``), through
  ``attention`` and through the direct path (``binding.handler(phase)``), and an empty
  batch returns an empty ``out`` as it is;
- a buffer of the wrong shape, dtype or device, a non-contiguous one, or one that shares
  memory with q or the caches is refused with ``InvalidBatchError`` whose ``field`` is
  ``"out"``, through ``attention`` and the direct path; for a backend that declares
  ``out_buffer``, by its own handler called without a binding too (it checks the rule
  itself: ``TensorChecks.check_out``). That last test skips for a backend that does not
  declare it, naming ``Capabilities.out_buffer``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import settings

from attn_dispatch import AttnBatch
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.testing.contract.cases import KernelCase
from attn_dispatch.testing.contract.cases import Materialised
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.cases import variant_cases
from attn_dispatch.testing.contract.harness import SLOW
from attn_dispatch.testing.contract.harness import Subject
from attn_dispatch.testing.contract.harness import contract_subject_fixture  # noqa: F401

PHASES = pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
KINDS = pytest.mark.parametrize("kind", ["mha", "mla"])

#: The buffers ``test_bad_out_is_refused`` passes: what each breaks.
BAD_OUT = (
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
)


def call(binding: Any, m: Materialised, lse: bool, **kw: Any) -> Any:
    """``attention`` on ``m`` under ``binding`` (``return_lse`` when ``lse``)."""
    if lse:
        kw["return_lse"] = True
    with attn_scope(binding, m.batch):
        return attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **m.extras(), **kw)


def fresh_out(m: Materialised, case: KernelCase) -> torch.Tensor:
    """A buffer for ``case``'s output, filled with NaN: a row the backend leaves unwritten
    shows."""
    shape = (m.q.shape[0], case.num_q_heads, case.v_head_dim)
    return torch.full(shape, float("nan"), dtype=m.q.dtype, device=m.q.device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and raw bits (NaN where both hold the same NaN)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def check_same_with_out(s: Subject, case: KernelCase) -> None:
    """``case`` with and without ``out``: the same bits, ``out`` returned, through
    ``attention`` and the binding's handler."""
    m = materialise(case, s.device)
    binding = bind(s.name, m.config, label=f"out-{s.name}")
    where = f"backend {s.name!r} on {case!r}"
    want = call(binding, m, case.lse)
    buf = fresh_out(m, case)
    got = call(binding, m, case.lse, out=buf)
    if case.lse:
        assert type(got) is tuple and got[0] is buf, f"{where}: (out, lse) must hold out itself"
        assert same_bits(got[1], want[1]), f"{where}: the lse differs with out="
        want = want[0]
    else:
        assert got is buf, f"{where}: attention(..., out=buf) must return buf itself"
    assert same_bits(buf, want), f"{where}: the result written into out differs from the result"
    direct = fresh_out(m, case)
    kw: dict[str, Any] = m.extras()
    if case.lse:
        kw["return_lse"] = True
    handler: Any = binding.handler(case.phase)  # Handler's protocol leaves out= unnamed
    res = handler(m.q, m.k_cache, m.v_cache, binding.plan(m.batch), m.sm_scale, out=direct, **kw)
    assert (res[0] if case.lse else res) is direct, f"{where}: the handler must return out"
    assert same_bits(direct, want), f"{where}: the handler's out differs from the result"


@PHASES
@KINDS
def test_out_gives_the_same_result(attn_contract_subject: Subject, kind: str, phase: Phase) -> None:
    """Drawn cases with every variant, FP8 format and ``return_lse`` declared: the same bits
    with and without ``out=``, ``out`` returned."""
    s = attn_contract_subject
    s.require(kind=kind, phase=phase)
    s.shapes_for(kind)
    serves, _ = s.served(kind, phase)

    @settings(max_examples=s.profile.scaled(s.profile.out_examples), deadline=None,
              suppress_health_check=SLOW)  # fmt: skip
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=s.limits))
    def check(case: KernelCase) -> None:
        if s.refused(case):
            return
        check_same_with_out(s, case)

    check()


def _decode(**over: Any) -> KernelCase:
    return make_case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(20, 3), **over)


def test_out_of_an_empty_batch(attn_contract_subject: Subject) -> None:
    """SGLang's IDLE forward (no requests): an empty ``out`` is returned as it is."""
    s = attn_contract_subject
    case = s.declared(_decode())
    m = materialise(case, s.device)
    empty = AttnBatch.build(
        Phase.DECODE, q_lens=[], kv_lens=[], page_tables=[], page_size=case.page_size
    ).to(m.q.device)
    buf = m.q.new_empty((0, case.num_q_heads, case.v_head_dim))
    with attn_scope(bind(s.name, m.config), empty):
        got = attention(m.q[:0], m.k_cache, m.v_cache, sm_scale=m.sm_scale, out=buf)
    assert got is buf, f"{s.name!r}: an empty batch must return the empty out itself"


def bad_buffers(m: Materialised, case: KernelCase) -> dict[str, tuple[Any, str]]:
    """name -> (a buffer the rule refuses, a word its message must contain). Moves ``m.q``
    into a larger storage, so a buffer can start in the middle of q's bytes."""
    t, h, dv = m.q.shape[0], case.num_q_heads, case.v_head_dim
    size = t * h * dv
    good: dict[str, Any] = dict(dtype=m.q.dtype, device=m.q.device)
    other = torch.float16 if m.q.dtype != torch.float16 else torch.float32
    assert m.v_cache is not None
    n = m.q.numel()
    big = torch.empty(2 * n + size, dtype=m.q.dtype, device=m.q.device)
    big[:n].copy_(m.q.view(-1))
    m.q = big[:n].view(m.q.shape)
    v_flat = m.v_cache.view(-1)
    return {
        "not a tensor": ([[0.0]], "torch.Tensor"),
        "rows": (torch.empty(t + 1, h, dv, **good), "shape"),
        "heads": (torch.empty(t, h + 1, dv, **good), "shape"),
        "width": (torch.empty(t, h, dv + 1, **good), "shape"),
        "dtype": (torch.empty(t, h, dv, dtype=other, device=m.q.device), "dtype"),
        "device": (torch.empty(t, h, dv, dtype=m.q.dtype, device="meta"), "on meta"),
        "strided": (torch.empty(t, dv, h, **good).transpose(1, 2), "contiguous"),
        # Starts where q starts.
        "q itself": (big[:size].view(t, h, dv), "shares memory with q"),
        # Starts inside q's bytes: no data_ptr is equal, the spans overlap.
        "q shifted": (big[n // 2 : n // 2 + size].view(t, h, dv), "with q"),
        "k_cache": (m.k_cache.view(-1)[:size].view(t, h, dv), "with k_cache"),
        "v_cache": (v_flat[v_flat.numel() - size :].view(t, h, dv), "with v_cache"),
    }


def _bad_setup(s: Subject, bad: str) -> tuple[Any, Materialised, Any, str]:
    case = s.declared(_decode(num_q_heads=4, num_kv_heads=2))
    m = materialise(case, s.device)
    binding = bind(s.name, m.config, label=f"out-{s.name}")
    buf, word = bad_buffers(m, case)[bad]
    return binding, m, buf, word


def _refuses(s: Subject, bad: str, run: Any, how: str, word: str) -> None:
    with pytest.raises(InvalidBatchError, match=word) as err:
        run()
    assert err.value.field == "out", (
        f"{s.name!r}: out ({bad}) {how} refused naming {err.value.field!r}, not 'out'"
    )


@pytest.mark.parametrize("bad", BAD_OUT)
def test_bad_out_is_refused(attn_contract_subject: Subject, bad: str) -> None:
    """Through ``attention`` and the binding's handler: ``InvalidBatchError``, field
    ``"out"``, whether or not the backend declares ``out_buffer`` (the core's rule)."""
    s = attn_contract_subject
    binding, m, buf, word = _bad_setup(s, bad)
    plan = binding.plan(m.batch)
    handler: Any = binding.handler(Phase.DECODE)
    _refuses(s, bad, lambda: call(binding, m, False, out=buf), "through attention", word)
    _refuses(
        s,
        bad,
        lambda: handler(m.q, m.k_cache, m.v_cache, plan, m.sm_scale, out=buf),
        "through binding.handler",
        word,
    )


@pytest.mark.parametrize("bad", BAD_OUT)
def test_bad_out_is_refused_by_the_handler(attn_contract_subject: Subject, bad: str) -> None:
    """The backend's own handler, called without a binding (a framework may): it checks the
    buffer itself (``TensorChecks.check_out``)."""
    s = attn_contract_subject
    if not s.caps.out_buffer:
        pytest.skip(
            f"{s.name!r} does not declare Capabilities(out_buffer=True): its handlers never "
            "receive out= (the core copies into the buffer)"
        )
    binding, m, buf, word = _bad_setup(s, bad)
    plan = binding.plan(m.batch)
    raw: Any = binding.route(Phase.DECODE).raw
    _refuses(
        s,
        bad,
        lambda: raw(m.q, m.k_cache, m.v_cache, plan, m.sm_scale, out=buf),
        "by the handler",
        word,
    )
