"""Kernel reliability (issue 22, the kernel parts): on every backend that runs here.

1. Bounds: each kernel bounds every row, request and page by the tensors it was handed, so a
   plan that does not fit them (made for another batch, or forged with a smaller token
   count) is refused or dropped, never a read or write outside them. These cases may crash
   a process, so they run in a child (a crash fails the test, not the run). They call the
   kernel entries below the handlers' plan-identity check (``na_run`` through ctypes, the
   triton launch functions), so they test the kernels' own bounds.
2. Invisible keys: a key a row cannot see (causal future, a sibling draft node, outside the
   window, past kv_len, pages in no table) never affects that row, whatever it holds (NaN,
   +-inf in K or V).
3. One rule for non-finite values a row does read (docs/concepts/safety.md): a key whose
   score is not finite or a value row holding NaN/inf gives a NaN row; FP8 NaN/inf codes
   likewise; a NaN sink gives NaN, a +inf sink 0, a -inf sink is no sink. A window on a mask
   that hides prefix keys keeps the last ``window_left + 1`` keys the mask allows.
4. A hypothesis property over random batches, masks, windows and trees: fill every cache slot
   a chosen row cannot see with NaN/inf; that row equals the float64 reference, and every
   row that does read a poisoned slot is NaN.

Native runs with the default instruction-set path in this process and every other path this
CPU has in a child (``NATIVE_ATTN_ISA``); triton runs under its interpreter on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import settings

from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import list_backends
from tests.contract.cases import Materialised
from tests.contract.cases import materialise
from tests.contract.cases import naive_attention
from tests.contract.cases import tolerance
from tests.contract.cases import visible_keys
from tests.strategies import KernelCase
from tests.strategies import Limits
from tests.strategies import poisoned_cases

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["torch", "native", "triton"]
NAN, INF = math.nan, math.inf
# Set in the child that runs this module's native cases on another instruction-set path.
ISA_CHILD = os.environ.get("ATTN_RELIABILITY_ISA_CHILD") == "1"


def _skip_unavailable(backend: str) -> None:
    caps = list_backends().get(backend)
    if caps is None:
        pytest.skip(f"backend {backend!r} is not registered")
    why = caps.availability_reasons()
    if why:
        pytest.skip(f"backend {backend!r} cannot run here: {'; '.join(why)}")
    if ISA_CHILD and backend != "native":
        pytest.skip("the instruction-set child runs the native cases only")


def _case(**over: Any) -> KernelCase:
    base = dict(
        kind="mha",
        phase=Phase.PREFILL,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        v_head_dim=64,
        page_size=4,
        dtype="float32",
        q_lens=(6, 3),
        prefix_lens=(9, 0),
        trees=None,
        extra_pages=2,
        seed=7,
    )
    base.update(over)
    return KernelCase(**base)  # type: ignore[arg-type]


def _mla(**over: Any) -> KernelCase:
    return _case(kind="mla", num_q_heads=4, num_kv_heads=1, head_dim=80, v_head_dim=64, **over)


def _slot(m: Materialised, i: int, t: int) -> tuple[int, int]:
    ps = m.config.page_size
    return m.page_tables[i][t // ps], t % ps


def _set(m: Materialised, page: int, slot: int, k: float | None, v: float | None) -> None:
    """Write k / v (None: leave) into every head of one cache slot; FP8 caches go through
    float32 (exact for the values already there; NaN/inf become the format's codes)."""
    for name, val in (("k_cache", k), ("v_cache", v)):
        cache = getattr(m, name)
        if val is None:
            continue
        if cache is None:  # MLA: V is part of the latent
            cache = m.k_cache
        wide = cache.float()
        if m.config.kind == "mla" and name == "v_cache":
            wide[page, slot, : m.config.v_head_dim] = val
        else:
            wide[page, slot] = val
        cache.copy_(wide.to(cache.dtype))


def _unread_slots(m: Materialised) -> list[tuple[int, int]]:
    """Slots no request reads: past kv_len in its last page, and pages in no table."""
    ps = m.config.page_size
    used = {p for table in m.page_tables for p in table}
    out = [(p, s) for p in range(m.k_cache.shape[0]) if p not in used for s in range(ps)]
    lens = m.batch.kv_lens_host.tolist()
    for i, table in enumerate(m.page_tables):
        out += [(table[t // ps], t % ps) for t in range(lens[i], len(table) * ps)]
    return out


def _run(backend: str, m: Materialised) -> torch.Tensor:
    binding = bind(backend, m.config, label=f"reliability-{backend}")
    with attn_scope(binding, m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **m.extras())
    return out.double()


def _poison_and_check(
    backend: str,
    case: KernelCase,
    protect: tuple[int, ...],
    k_val: float | None = NAN,
    v_val: float | None = NAN,
    sinks: torch.Tensor | None = None,
) -> None:
    """Poison every slot row ``protect[i]`` of request ``i`` cannot see (and every unread
    slot); that row must equal the clean float64 reference, and every row of the batch that
    sees a poisoned key must be NaN, every other row equal the reference."""
    m = materialise(case)
    if sinks is not None:
        m.sinks = sinks
    ref = naive_attention(m)
    qo = m.batch.qo_indptr_host.tolist()
    expect_nan = torch.zeros(ref.shape[0], dtype=torch.bool)
    for i, row in enumerate(protect):
        vis = visible_keys(m, i)
        hidden = ~vis[row]
        for t in hidden.nonzero().flatten().tolist():
            _set(m, *_slot(m, i, t), k_val, v_val)
        expect_nan[qo[i] : qo[i + 1]] = (vis & hidden[None, :]).any(dim=1)
    for page, slot in _unread_slots(m):
        _set(m, page, slot, k_val, v_val)
    out = _run(backend, m)
    atol, rtol = tolerance(case.dtype)
    if case.kv_dtype is not None:
        atol, rtol = max(atol, 3e-2), max(rtol, 3e-2)
    keep = ~expect_nan
    torch.testing.assert_close(out[keep], ref[keep], atol=atol, rtol=rtol)
    # e4m3fn has no inf: +-inf is stored as +-448, a finite value that rows may read.
    stored = [torch.tensor(x).to(m.k_cache.dtype).float() for x in (k_val, v_val) if x is not None]
    if not all(bool(x.isfinite()) for x in stored):
        assert out[expect_nan].isnan().all(), "a row that reads a poisoned key must be NaN"
    for i, row in enumerate(protect):
        assert not out[qo[i] + row].isnan().any()


# -- 2. invisible keys never reach a row ----------------------------------------------------------


INVISIBLE = {
    # causal prefill: the first new token of each request; every later token is its future
    "causal-future": (_case(), (0, 0)),
    "causal-future-mla": (_mla(), (0, 0)),
    # tree verify: node 1 of [-1, 0, 0] must not see its sibling, node 2 (a bad draft)
    "tree-sibling": (
        _case(
            phase=Phase.VERIFY,
            q_lens=(3, 4),
            prefix_lens=(5, 2),
            trees=((-1, 0, 0), (-1, -1, 1, 1)),
        ),
        (1, 2),
    ),
    "tree-sibling-mla": (
        _mla(phase=Phase.VERIFY, q_lens=(3,), prefix_lens=(5,), trees=((-1, 0, 0),)),
        (1,),
    ),
    # keys before the window (prefill and a long decode that native splits)
    "window-prefill": (_case(window_left=3, q_lens=(6, 5), prefix_lens=(20, 4)), (2, 4)),
    "window-decode": (
        _case(phase=Phase.DECODE, window_left=40, q_lens=(1, 1), prefix_lens=(900, 12)),
        (0, 0),
    ),
    "window-tree": (
        _case(
            phase=Phase.VERIFY,
            window_left=4,
            q_lens=(4,),
            prefix_lens=(12,),
            trees=((-1, 0, 1, 0),),
        ),
        (2,),
    ),
    # a window on a mask that hides prefix keys: the last window_left + 1 keys it allows
    "window-hidden-prefix": (
        _case(
            phase=Phase.VERIFY,
            window_left=3,
            q_lens=(3,),
            prefix_lens=(40,),
            trees=((-1, 0, 0),),
            hidden_prefix=((36, 37, 38, 39),),
        ),
        (1,),
    ),
    # long decode (native splits it): only past-kv_len slots and unused pages are poisoned
    "past-kv-len-decode": (
        _case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(700, 5), page_size=16),
        (0, 0),
    ),
    "fp8-causal": (_case(kv_dtype="float8_e5m2", k_scale=0.5, v_scale=2.0), (1, 0)),
    "bf16-gqa-window": (
        _case(dtype="bfloat16", num_q_heads=8, num_kv_heads=2, window_left=2),
        (3, 1),
    ),
}
POISONS = {
    "nan": (NAN, NAN),
    "inf": (INF, -INF),
    "v-only-nan": (None, NAN),
    "k-only-inf": (INF, None),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", sorted(INVISIBLE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_invisible_keys_never_reach_a_row(backend: str, name: str, poison: str) -> None:
    _skip_unavailable(backend)
    case, protect = INVISIBLE[name]
    k_val, v_val = POISONS[poison]
    _poison_and_check(backend, case, protect, k_val, v_val)


# -- 3. one rule for non-finite values a row reads, and for sinks -------------------------------


READ = {
    "prefill": _case(q_lens=(5,), prefix_lens=(7,)),
    "decode-split": _case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(800, 9), page_size=16),
    "mla-decode": _mla(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(30,)),
    "tree": _case(phase=Phase.VERIFY, q_lens=(3,), prefix_lens=(4,), trees=((-1, 0, 0),)),
    "capped": _case(q_lens=(4,), prefix_lens=(3,), logit_cap=2.0),
}
READ_VALUES = {
    "k-nan": (NAN, None),
    "k-inf": (INF, None),
    "k-neg-inf": (-INF, None),
    "v-nan": (None, NAN),
    "v-inf": (None, INF),
}


@pytest.mark.parametrize("value", sorted(READ_VALUES))
@pytest.mark.parametrize("name", sorted(READ))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_key_or_value_read_gives_nan(backend: str, name: str, value: str) -> None:
    """Key 0 of each request is seen by every row: all rows are NaN (every head reads it)."""
    _skip_unavailable(backend)
    m = materialise(READ[name])
    k_val, v_val = READ_VALUES[value]
    for i in range(len(m.page_tables)):
        _set(m, *_slot(m, i, 0), k_val, v_val)
    out = _run(backend, m)
    assert out.isnan().all()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_nan_and_inf_codes_read_give_nan(backend: str, fmt: str, where: str) -> None:
    """The raw codes (e4m3fn S.1111.111 = NaN; e5m2 0x7c = inf, 0x7e = NaN) in a key or value
    every row reads: NaN rows, as torch computes them; unread codes change nothing."""
    _skip_unavailable(backend)
    for code in (0x7F, 0xFF) if fmt == "float8_e4m3fn" else (0x7C, 0xFC, 0x7E):
        for phase, ql, pl in ((Phase.PREFILL, (4,), (5,)), (Phase.DECODE, (1, 1), (600, 3))):
            case = _case(phase=phase, q_lens=ql, prefix_lens=pl, kv_dtype=fmt, page_size=16)
            m = materialise(case)
            cache = m.k_cache if where == "k" else m.v_cache
            assert cache is not None
            raw = cache.view(torch.uint8)
            for i in range(len(m.page_tables)):
                page, slot = _slot(m, i, 0)
                raw[page, slot] = code
                for page, slot in _unread_slots(m):
                    raw[page, slot] = code
            out = _run(backend, m)
            assert out.isnan().all(), (fmt, hex(code), phase)


SINK_CASES = {
    "prefill": _case(q_lens=(5, 2), prefix_lens=(7, 0), sinks=True),
    "decode-split": _case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(800, 9), page_size=16, sinks=True
    ),
    "tree": _case(
        phase=Phase.VERIFY, q_lens=(3,), prefix_lens=(4,), trees=((-1, 0, 0),), sinks=True
    ),
}


@pytest.mark.parametrize("name", sorted(SINK_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_sinks_one_rule(backend: str, name: str) -> None:
    """Heads 0..2 get sinks NaN, +inf, -inf; head 3 a finite one. NaN: NaN rows; +inf: all
    the weight, rows of 0; -inf: no sink (the plain softmax); finite: the reference."""
    _skip_unavailable(backend)
    case = SINK_CASES[name]
    m = materialise(case)
    m.sinks = torch.tensor([NAN, INF, -INF, 0.5])
    out = _run(backend, m)
    assert out[:, 0].isnan().all()
    assert (out[:, 1] == 0).all()
    plain = dataclasses.replace(m, sinks=None)
    ref = naive_attention(plain)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out[:, 2], ref[:, 2], atol=atol, rtol=rtol)
    m.sinks = torch.tensor([0.0, 0.0, 0.0, 0.5])
    torch.testing.assert_close(out[:, 3], naive_attention(m)[:, 3], atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_on_mask_hiding_prefix_keeps_last_allowed_keys(backend: str) -> None:
    """docs/guides/variants.md, "Window and tree verify": a node sees the last
    window_left + 1 keys its mask allows, even when the mask hides the prefix keys just before
    the draft (so the window reaches further back)."""
    _skip_unavailable(backend)
    case = _case(
        phase=Phase.VERIFY, window_left=5, q_lens=(3, 2), prefix_lens=(30, 9),
        trees=((-1, 0, 0), (-1, 0)), hidden_prefix=(tuple(range(22, 30)), (7, 8)),
    )  # fmt: skip
    m = materialise(case)
    out = _run(backend, m)
    torch.testing.assert_close(out, naive_attention(m), atol=2e-4, rtol=2e-4)


# -- 4. the property ------------------------------------------------------------------------------

# Small shapes: the machine is slow and triton runs in its interpreter.
PROPERTY_LIMITS = Limits(
    max_requests=3,
    max_q=9,
    max_prefix=70,
    page_sizes=(1, 4, 16),
    gqa_ratios=(1, 2),
    max_kv_heads=2,
    mha_dims=((64, 64), (40, 24)),
    mla_dims=((80, 64),),
    mla_heads=(1, 4),
    dtypes=("float32", "bfloat16"),
)
PROPERTY_EXAMPLES = {"torch": 25, "native": 40, "triton": 6}


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_unseen_slots_leave_rows_equal_to_reference(backend: str, kind: str) -> None:
    _skip_unavailable(backend)

    @settings(max_examples=PROPERTY_EXAMPLES[backend], database=None)
    @given(poisoned_cases(kind=kind, limits=PROPERTY_LIMITS))
    def prop(drawn: tuple[KernelCase, tuple[int, ...], float, float]) -> None:
        case, protect, k_val, v_val = drawn
        _poison_and_check(backend, case, protect, k_val, v_val)

    prop()


# -- 5. the other native instruction-set paths -----------------------------------------------------


def _native_isas() -> list[str]:
    from attn_dispatch.backends.native._lib import load

    lib = load()
    if isinstance(lib, str):
        return []
    return [isa for isa in lib.isa_list if isa != lib.isa]


@pytest.mark.skipif(ISA_CHILD, reason="runs in the parent only")
@pytest.mark.parametrize("isa", _native_isas() or ["none"])
def test_native_rules_on_every_instruction_set_path(isa: str) -> None:
    """This module's native cases again with NATIVE_ATTN_ISA=<isa>, for each path this CPU
    has besides the default one (which the cases above ran in this process)."""
    if isa == "none":
        pytest.skip("the native library is not built, or this CPU has one path only")
    env = {
        **os.environ,
        "PYTHONPATH": os.getcwd(),
        "NATIVE_ATTN_ISA": isa,
        "ATTN_RELIABILITY_ISA_CHILD": "1",
    }
    check = (
        "from attn_dispatch.backends.native._lib import load; import sys; "
        f"sys.exit(load().isa != {isa!r})"
    )
    assert subprocess.run([sys.executable, "-c", check], env=env, timeout=120).returncode == 0
    child = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
            "tests/adversarial/test_kernel_safety.py", "-k", "native and not bounds",
        ],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-4000:]
    assert " passed" in child.stdout and "failed" not in child.stdout


# -- 1. bounds: forged and mismatched plans (child processes) ------------------------------------


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip


_NATIVE_BOUNDS = """
    import ctypes, dataclasses, torch
    from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
    from attn_dispatch.backends.native import backend as nb

    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=4, device="cpu")
    be = nb.NativeBackend(cfg)
    big = AttnBatch.build(Phase.PREFILL, q_lens=[40, 40], kv_lens=[60, 60],
                          page_tables=[list(range(15)), list(range(15, 30))], page_size=4,
                          num_pages=30)
    small = AttnBatch.build(Phase.PREFILL, q_lens=[2], kv_lens=[2], page_tables=[[0]],
                            page_size=4, num_pages=1)
    pb, ps = be.plan(big), be.plan(small)
    q = torch.randn(2, 4, 32)
    k = torch.randn(1, 4, 2, 32)
    v = torch.randn(1, 4, 2, 32)
    out = torch.empty(2, 4, 32)
    run = be.library.cdll.na_run
    from attn_dispatch.backends.native.backend import run_args

    def call(plan, q, k, v, out, sinks=None, n_sinks=0, lse=None):
        args = run_args(q, k, v, out, sinks=sinks, sinks_numel=n_sinks, lse=lse, sm_scale=0.2,
                        num_threads=2)
        return run(be._runner, be._issued[id(plan)].plan_id, ctypes.byref(args))

    # the big plan's 80 rows and 30 pages against tensors for 2 rows and 1 page
    assert call(pb, q, k, v, out) == -1, "rows past q"
    big_q, big_out = torch.randn(80, 4, 32), torch.empty(80, 4, 32)
    assert call(pb, big_q, k, v, big_out) == -1, "pages past the cache"
    assert call(pb, big_q, torch.randn(30, 4, 2, 32), v, big_out) == -1, "pages past v"
    kk, vv = torch.randn(30, 4, 2, 32), torch.randn(30, 4, 2, 32)
    assert call(pb, big_q, kk, vv, out) == -1, "rows past out"
    assert call(pb, big_q, kk, vv, big_out, torch.zeros(2), 2) == -1, "sinks shorter than Hq"
    assert call(pb, big_q, kk, vv, big_out, lse=torch.empty(80, 2)) == -1, "lse past its rows"
    assert call(pb, big_q, kk, vv, big_out) == 0
    assert call(ps, q, k, v, out) == 0
    print("ctypes ok")

    # The handler path with a forged plan (the small plan's private record pointing at the
    # big plan's C++ id), the Python ownership check bypassed: the kernel's own bound refuses it.
    nb.check_plan = lambda *a, **k: None
    be._issued[id(ps)] = dataclasses.replace(be._issued[id(ps)], plan_id=be._issued[id(pb)].plan_id)
    forged = ps
    try:
        be.handler(Phase.PREFILL)(q, k, v, forged, 0.2)
    except InvalidBatchError as exc:
        assert exc.field == "plan", exc
        print("forged refused")
    else:
        raise SystemExit("a forged plan ran")
"""


@pytest.mark.parametrize("backend", ["native"])
def test_bounds_native_plan_that_does_not_fit_the_tensors(backend: str) -> None:
    _skip_unavailable(backend)
    child = _child(_NATIVE_BOUNDS)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "ctypes ok" in child.stdout and "forged refused" in child.stdout


_TRITON_BOUNDS = """
    import dataclasses, os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from attn_dispatch import AttnBatch, AttnConfig, Phase
    from attn_dispatch.backends.triton import _ops
    from attn_dispatch._snapshot import StepStats
    from attn_dispatch.backends.triton.backend import TritonBackend

    def _snap_with_tokens(snap, n):
        s = snap.step
        return dataclasses.replace(snap, step=StepStats(n, s.max_q_len, s.max_kv_len, s.max_page))

    cfg = AttnConfig("mha", 2, 1, 16, 16, dtype="float32", page_size=4, device="cpu")
    be = TritonBackend(cfg)
    n = 6
    batch = AttnBatch.build(Phase.DECODE, q_lens=[1] * n, kv_lens=[4] * n,
                            page_tables=[[i] for i in range(n)], page_size=4, num_pages=n)
    plan = be._plans.get(be.plan(batch), be)  # the launch record behind the handle
    k = torch.randn(n, 4, 1, 16)
    v = torch.randn(n, 4, 1, 16)
    # A snapshot claiming 1 token while the grid still walks 6 requests: the kernels must
    # bound request rows by q and the output, not by the plan. (sealed: the forged copy is
    # let past the launch's own plan checks, to test the kernels below them.)
    forged = _ops.sealed(dataclasses.replace(plan, snap=_snap_with_tokens(plan.snap, 1)))
    q = torch.randn(1, 2, 16)
    out = _ops.run_decode(be._kc, forged, q, k, v, 0.25)
    assert out.shape == (1, 2, 16) and torch.isfinite(out).all()
    full = _ops.run_decode(be._kc, plan, torch.cat([q, torch.randn(n - 1, 2, 16)]), k, v, 0.25)
    torch.testing.assert_close(out, full[:1])
    print("decode bounded")
    pb = AttnBatch.build(Phase.PREFILL, q_lens=[3] * n, kv_lens=[4] * n,
                         page_tables=[[i] for i in range(n)], page_size=4, num_pages=n)
    ep = be._plans.get(be.plan(pb), be)
    forged = _ops.sealed(dataclasses.replace(ep, snap=_snap_with_tokens(ep.snap, 2)))
    out = _ops.run_extend(be._kc, forged, torch.randn(2, 2, 16), k, v, 0.25)
    assert out.shape == (2, 2, 16) and torch.isfinite(out).all()
    print("extend bounded")

    # Issue 21: decode and extend share one tile step, so decode drops a page index outside
    # the cache like extend does (it used to give NaN): the snapshot's private copy is edited
    # here to stand for unchecked device metadata.
    two = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[8, 8],
                          page_tables=[[0, 1], [2, 3]], page_size=4, num_pages=4)
    one = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[4, 4],
                          page_tables=[[0], [2]], page_size=4, num_pages=4)
    k4, v4, q2 = k[:4], v[:4], torch.randn(2, 2, 16)
    dp = be._plans.get(be.plan(two), be)
    dp.snap.kv_indices[1] = 10**6  # request 0's second page: outside the cache
    dp.snap.kv_indices[2:] = -5  # request 1: no page inside the cache at all
    got = _ops.run_decode(be._kc, dp, q2, k4, v4, 0.25)
    want = _ops.run_decode(be._kc, be._plans.get(be.plan(one), be), q2, k4, v4, 0.25)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got[0], want[0])
    assert (got[1] == 0).all()
    print("decode drops pages")
"""


@pytest.mark.parametrize("backend", ["triton"])
def test_bounds_triton_plan_with_more_requests_than_rows(backend: str) -> None:
    _skip_unavailable(backend)
    child = _child(_TRITON_BOUNDS)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "decode bounded" in child.stdout and "extend bounded" in child.stdout
    assert "decode drops pages" in child.stdout


# -- values the native kernels hold in int32 / float32 ---------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [
        (dict(window_left=2**32), "window_left"),
        (dict(window_left=2**31), "window_left"),
        (dict(chunk=2**32), "attention_chunk_size"),
        (dict(logit_cap=1e-300), "logit_cap"),
        (dict(logit_cap=1e39), "logit_cap"),
    ],
)
def test_values_past_int32_or_float32_never_reach_a_kernel(
    over: dict[str, Any], field: str
) -> None:
    """A window or chunk past int32 (2^32 once behaved as window 0 on native) and a cap float32
    rounds to 0 or inf (1e-300 was "off" on native, a cap on torch) are refused by the config,
    once, for every backend."""
    from attn_dispatch import InvalidSpecError

    with pytest.raises(InvalidSpecError) as info:
        materialise(_case(**over))
    assert info.value.field == field
