"""Adversarial inputs: every backend that runs here, fed what a buggy caller could pass.

The safety rules (docs/concepts/safety.md): no input makes a kernel read or
write outside its tensors, a handler accepts only its own backend's plans, a plan never sees
later edits to the batch, unread cache slots never affect the output (NaN included), NaN in q
gives NaN in that row, an empty batch gives an empty output, and threads sharing a plan match
serial calls.

Each case may crash a process if a backend breaks a rule (a heap overrun, a segfault), so the
cases run in a child process
(``python -m tests.adversarial.test_backends_child_process BACKEND CASE...``) that
reports one line per case; a crash fails the case it was running and the rest run again in a
new child. One child per backend serves every case, so the module costs a few interpreter
starts. The hypothesis property runs in the child too, with the active profile's example
count (``ci`` 200, ``thorough`` 5000).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# As in tests/backends/triton/test_backend.py: the triton backend runs on CPU under its
# interpreter, which must be on before the kernels are defined (the children inherit it;
# see _run_children).
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a test dependency
    pass
BACKENDS = ("torch", "triton", "native", "flashinfer")
CUDA_ONLY = {"flashinfer"}

# ---------------------------------------------------------------------------------------------
# The child: fixtures and cases. Imports of torch and attn_dispatch happen inside, so collecting
# this module in the parent stays cheap.

HQ, HKV, D, PS = 4, 2, 32, 4


class Env:
    """One backend's bindings, batches and caches for the cases (built in the child)."""

    def __init__(self, backend: str) -> None:
        import torch

        from attn_dispatch import AttnConfig
        from attn_dispatch import bind

        self.torch = torch
        self.name = backend
        cuda = torch.cuda.is_available()
        self.device = "cuda" if backend in CUDA_ONLY or (cuda and backend == "triton") else "cpu"
        # GPU kernels do not check page indices on the host (they drop or clamp them): there
        # an out-of-range index may give an error or a bounded output, never a fault.
        self.gpu = self.device == "cuda"
        self.dtype = "bfloat16" if backend == "flashinfer" else "float32"
        self.head_dim = 64 if backend == "flashinfer" else D
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.config = AttnConfig(
            "mha", HQ, HKV, self.head_dim, dtype=self.dtype, page_size=PS, device=self.device
        )
        self.small = bind(backend, self.config, label="small")
        self.big = bind(backend, self.config.replace(num_q_heads=8, num_kv_heads=4), label="big")
        self.other_ps = bind(backend, self.config.replace(page_size=2 * PS), label="ps8")
        self.num_pages = 8
        self.tdtype = getattr(torch, self.dtype)
        g = torch.Generator().manual_seed(0)
        shape = (self.num_pages, PS, HKV, self.head_dim)
        self.k = torch.randn(shape, generator=g).to(self.tdtype).to(self.device)
        self.v = torch.randn(shape, generator=g).to(self.tdtype).to(self.device)

    def batch(
        self,
        phase: Any = None,
        q_lens: tuple[int, ...] = (1, 1),
        kv_lens: tuple[int, ...] = (5, 3),
        tables: tuple[tuple[int, ...], ...] = ((3, 6), (1,)),
        page_size: int | None = PS,
        indices: Any = None,
    ) -> Any:
        from attn_dispatch import AttnBatch
        from attn_dispatch import Phase

        torch = self.torch
        phase = Phase.DECODE if phase is None else phase
        qo, kv, flat = [0], [0], []
        for q, t in zip(q_lens, tables, strict=True):
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + len(t))
            flat.extend(t)
        i32 = torch.int32
        idx = torch.tensor(flat, dtype=i32) if indices is None else indices
        batch = AttnBatch(
            phase,
            torch.tensor(qo, dtype=i32),
            torch.tensor(kv, dtype=i32),
            idx,
            torch.tensor(kv_lens, dtype=i32),
            page_size=page_size,
        )
        return batch if self.device == "cpu" else batch.to(self.device)

    def q(self, rows: int, seed: int = 1) -> Any:
        g = self.torch.Generator().manual_seed(seed)
        q = self.torch.randn(rows, HQ, self.head_dim, generator=g)
        return q.to(self.tdtype).to(self.device)

    def run(self, binding: Any, q: Any, plan: Any, k: Any = None, v: Any = None) -> Any:
        from attn_dispatch import Phase

        k = self.k if k is None else k
        v = self.v if v is None else v
        return binding.handler(Phase.DECODE)(q, k, v, plan, self.scale)

    def bounded(self, out: Any, v: Any = None) -> None:
        """|out| <= max|V|: an attention row is a weighted mean of V rows."""
        v = self.v if v is None else v
        limit = float(v.float().abs().max()) + 1e-2
        got = out.float()
        if got.numel() == 0:
            return
        assert not bool(got.isnan().any()), "NaN in the output of NaN-free inputs"
        assert float(got.abs().max()) <= limit, (
            f"|out| {float(got.abs().max())} > max|V| {limit}: read outside the cache"
        )

    def close(self, a: Any, b: Any) -> None:
        tol = 3e-2 if self.dtype == "bfloat16" else 1e-5
        self.torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol)


def expect_error(fn: Callable[[], Any], field: str | None = None) -> Any:
    """Run ``fn``; it must raise one of our errors (naming ``field`` when given)."""
    from attn_dispatch import AttnDispatchError

    try:
        fn()
    except AttnDispatchError as exc:
        got = getattr(exc, "field", None)
        assert field is None or got == field, f"field {got!r} != {field!r}: {exc}"
        return exc
    raise AssertionError("no error raised")


def error_or_bounded(env: Env, fn: Callable[[], Any]) -> None:
    from attn_dispatch import AttnDispatchError

    try:
        out = fn()
    except AttnDispatchError:
        return
    env.bounded(out)


# Each case: env -> None, raising AssertionError when a rule is broken.


def case_foreign_plan(env: Env) -> None:
    # A plan of another binding (other head counts and dims) must be refused, not read.
    batch = env.batch()
    expect_error(lambda: env.run(env.small, env.q(2), env.big.plan(batch)), "plan")


def case_other_page_size(env: Env) -> None:
    b8 = env.batch(tables=((3,), (1,)), page_size=2 * PS)
    expect_error(lambda: env.run(env.small, env.q(2), env.other_ps.plan(b8)), "plan")
    # A batch built for another page size is refused at plan time.
    expect_error(lambda: env.small.plan(b8), "page_size")


def case_q_fewer_rows(env: Env) -> None:
    from attn_dispatch import Phase

    expect_error(lambda: env.run(env.small, env.q(1), env.small.plan(env.batch())), "q")
    pre = env.batch(Phase.PREFILL, q_lens=(3, 2), kv_lens=(5, 3))
    run = env.small.handler(Phase.PREFILL)
    expect_error(lambda: run(env.q(4), env.k, env.v, env.small.plan(pre), env.scale), "q")


def case_q_more_rows(env: Env) -> None:
    from attn_dispatch import Phase

    expect_error(lambda: env.run(env.small, env.q(3), env.small.plan(env.batch())), "q")
    pre = env.batch(Phase.PREFILL, q_lens=(3, 2), kv_lens=(5, 3))
    run = env.small.handler(Phase.PREFILL)
    expect_error(lambda: run(env.q(6), env.k, env.v, env.small.plan(pre), env.scale), "q")


def case_page_past_cache(env: Env) -> None:
    batch = env.batch(tables=((3, 9), (1,)))  # the cache has 8 pages
    if env.gpu:
        error_or_bounded(env, lambda: env.run(env.small, env.q(2), env.small.plan(batch)))
        return
    expect_error(lambda: env.run(env.small, env.q(2), env.small.plan(batch)), "kv_indices")


def case_v_fewer_pages(env: Env) -> None:
    plan = env.small.plan(env.batch())
    expect_error(lambda: env.run(env.small, env.q(2), plan, v=env.v[:7]), "v_cache")


def case_negative_index_after_build(env: Env) -> None:
    batch = env.batch()
    want = env.run(env.small, env.q(2), env.small.plan(batch))
    batch.kv_indices[0] = -1  # after build, before plan
    if env.gpu:
        error_or_bounded(env, lambda: env.run(env.small, env.q(2), env.small.plan(batch)))
    else:
        expect_error(lambda: env.small.plan(batch), "kv_indices")
    fresh = env.batch()
    plan = env.small.plan(fresh)
    fresh.kv_indices[0] = -1  # after plan: the plan holds its own copy
    env.close(env.run(env.small, env.q(2), plan), want)


def case_kv_lens_edited_after_build(env: Env) -> None:
    batch = env.batch()
    want = env.run(env.small, env.q(2), env.small.plan(batch))
    batch.kv_lens[0] = 40  # more tokens than its pages hold
    if env.gpu:
        error_or_bounded(env, lambda: env.run(env.small, env.q(2), env.small.plan(batch)))
    else:
        expect_error(lambda: env.small.plan(batch))
    fresh = env.batch()
    plan = env.small.plan(fresh)
    fresh.kv_lens[0] = 40
    env.close(env.run(env.small, env.q(2), plan), want)


def case_kv_indptr_edited_after_build(env: Env) -> None:
    batch = env.batch()
    want = env.run(env.small, env.q(2), env.small.plan(batch))
    batch.kv_indptr[1] = 7  # past the end of kv_indices
    if env.gpu:
        error_or_bounded(env, lambda: env.run(env.small, env.q(2), env.small.plan(batch)))
    else:
        expect_error(lambda: env.small.plan(batch))
    fresh = env.batch()
    plan = env.small.plan(fresh)
    fresh.kv_indptr[1] = 7
    env.close(env.run(env.small, env.q(2), plan), want)


def case_strided_indices(env: Env) -> None:
    torch = env.torch
    dense = env.batch()
    want = env.run(env.small, env.q(2), env.small.plan(dense))
    spread = torch.tensor([3, -5, 6, -5, 1], dtype=torch.int32)[::2]  # a strided view
    assert not spread.is_contiguous()
    strided = env.batch(indices=spread)
    env.close(env.run(env.small, env.q(2), env.small.plan(strided)), want)


def case_nan_in_unread_slots(env: Env) -> None:
    batch = env.batch()  # request 0: pages 3, 6 (5 tokens); request 1: page 1 (3 tokens)
    want = env.run(env.small, env.q(2), env.small.plan(batch))
    k, v = env.k.clone(), env.v.clone()
    for page in (0, 2, 4, 5, 7):  # in no table
        k[page] = float("nan")
        v[page] = float("inf") if page == 4 else float("nan")
    k[6, 1:] = float("nan")  # past request 0's kv_len (slot 0 of page 6 is token 4)
    v[6, 1:] = float("nan")
    k[1, 3:] = float("nan")  # past request 1's kv_len
    v[1, 3:] = float("nan")
    got = env.run(env.small, env.q(2), env.small.plan(batch), k=k, v=v)
    env.close(got, want)


def case_nan_in_q(env: Env) -> None:
    batch = env.batch()
    q = env.q(2)
    want = env.run(env.small, q, env.small.plan(batch))
    q[1] = float("nan")
    got = env.run(env.small, q, env.small.plan(batch))
    assert bool(got[1].isnan().all()), f"row 1 should be NaN, got {got[1]}"
    env.close(got[0], want[0])


def case_no_page_size_kv_len_past_pages(env: Env) -> None:
    # Built without page_size, AttnBatch cannot check pages; the bound backend must.
    batch = env.batch(kv_lens=(9, 3), tables=((3, 6), (1,)), page_size=None)  # 9 > 2 * 4
    expect_error(lambda: env.small.plan(batch), "kv_indptr")


def case_empty_batch(env: Env) -> None:
    batch = env.batch(q_lens=(), kv_lens=(), tables=())
    out = env.run(env.small, env.q(0), env.small.plan(batch))
    assert tuple(out.shape) == (0, HQ, env.head_dim), tuple(out.shape)


def case_threads_share_a_plan(env: Env) -> None:
    # carry_scope: workers see the caller's scope and plan; results match serial calls.
    from attn_dispatch import Phase
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import carry_scope

    # Long sequences over a larger cache, so split-KV kernels (per-call scratch) are used.
    torch = env.torch
    g = torch.Generator().manual_seed(9)
    pages = 64
    k = torch.randn(pages, PS, HKV, env.head_dim, generator=g).to(env.tdtype).to(env.device)
    v = torch.randn(pages, PS, HKV, env.head_dim, generator=g).to(env.tdtype).to(env.device)
    # (native splits a request's keys across threads from ~300 keys; the interpreter is slow)
    lens = (230, 150, 97) if env.name == "triton" else (600, 400, 300)
    tables = tuple(
        tuple(int(p) for p in torch.randint(0, pages, (-(-n // PS),), generator=g)) for n in lens
    )
    batch = env.batch(Phase.DECODE, q_lens=(1, 1, 1), kv_lens=lens, tables=tables)
    qs = [env.q(3, seed=s) for s in range(4)]
    with attn_scope(env.small, batch):
        serial = [attention(q, k, v, sm_scale=env.scale) for q in qs]
        got: list[Any] = [None] * len(qs)
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                for _ in range(3 if env.name == "triton" else 25):
                    out = attention(qs[i], k, v, sm_scale=env.scale)
                    if got[i] is None or not bool(torch.equal(out, got[i])):
                        got[i] = out if got[i] is None else got[i]
                        env.close(out, serial[i])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=carry_scope(work), args=(i,)) for i in range(len(qs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for a, b in zip(got, serial, strict=True):
        env.close(a, b)


def _mla(env: Env) -> tuple[Any, Any, float]:
    """An absorbed-MLA binding of the same backend (latent 64 + rope 16), and its cache."""
    from attn_dispatch import AttnConfig
    from attn_dispatch import bind

    torch = env.torch
    wide = env.name == "flashinfer"
    d, dv = (576, 512) if wide else (80, 64)
    cfg = AttnConfig(
        "mla", 16 if wide else 2, 1, d, dv, dtype=env.dtype, page_size=PS, device=env.device
    )
    g = torch.Generator().manual_seed(3)
    k = torch.randn(env.num_pages, PS, d, generator=g).to(env.tdtype).to(env.device)
    return bind(env.name, cfg, label="mla"), k, d**-0.5


def case_mla_page_past_cache_and_foreign_plan(env: Env) -> None:
    from attn_dispatch import Phase

    mla, k, scale = _mla(env)
    run = mla.handler(Phase.DECODE)
    heads, d = mla.config.num_q_heads, mla.config.head_dim
    q = env.torch.randn(2, heads, d).to(env.tdtype).to(env.device)
    batch = env.batch(tables=((3, 9), (1,)))  # the cache has 8 pages
    if env.gpu:
        error_or_bounded(env, lambda: run(q, k, None, mla.plan(batch), scale))
    else:
        expect_error(lambda: run(q, k, None, mla.plan(batch), scale), "kv_indices")
    expect_error(lambda: run(q, k, None, env.small.plan(env.batch()), scale), "plan")


def case_mla_nan_in_unread_slots(env: Env) -> None:
    from attn_dispatch import Phase

    mla, k, scale = _mla(env)
    run = mla.handler(Phase.DECODE)
    heads, d = mla.config.num_q_heads, mla.config.head_dim
    g = env.torch.Generator().manual_seed(8)
    q = env.torch.randn(2, heads, d, generator=g).to(env.tdtype).to(env.device)
    batch = env.batch()  # pages 3, 6 (5 tokens) and 1 (3 tokens)
    want = run(q, k, None, mla.plan(batch), scale)
    dirty = k.clone()
    for page in (0, 2, 4, 5, 7):
        dirty[page] = float("nan")
    dirty[6, 1:] = float("inf")
    dirty[1, 3:] = float("nan")
    env.close(run(q, dirty, None, mla.plan(batch), scale), want)


CASES: dict[str, Callable[[Env], None]] = {
    name.removeprefix("case_"): fn
    for name, fn in dict(globals()).items()
    if name.startswith("case_") and callable(fn)
}


def property_malformed(env: Env, examples: int) -> None:
    """Random malformed batches and mismatched plans: an AttnDispatchError, or an output
    inside the convex hull of the cache values (|out| <= max|V|)."""
    from hypothesis import HealthCheck
    from hypothesis import given
    from hypothesis import settings

    from attn_dispatch import AttnDispatchError
    from tests.strategies import malformed_scenarios

    torch = env.torch

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(malformed_scenarios(env.num_pages, PS))
    def check(s: dict[str, Any]) -> None:
        from attn_dispatch import AttnBatch

        try:
            batch = env.batch(
                s["phase"],
                tuple(s["q_lens"]),
                tuple(s["kv_lens"]),
                tuple(tuple(t) for t in s["tables"]),
                page_size=None if s["no_page_size"] else PS,
            )
        except AttnDispatchError:
            return

        def edit(b: AttnBatch) -> None:
            for name, at, value in s["edits"]:
                t = getattr(b, name)
                if t.numel():
                    t[at % t.numel()] = value

        planner = {"own": env.small, "big": env.big, "ps8": env.other_ps}[s["plan_from"]]
        try:
            if s["when"] == "before_plan":
                edit(batch)
            plan = planner.plan(batch)
            if s["when"] == "after_plan":
                edit(batch)
            rows = int(batch.qo_indptr_host[-1]) + s["rows"] if batch.num_requests else 0
            q = env.q(max(rows, 0))
            v = env.v[: s["v_pages"]]
            out = env.small.handler(s["phase"])(q, env.k, v, plan, env.scale)
        except AttnDispatchError:
            return
        env.bounded(out, env.v)
        assert out.shape[0] == q.shape[0]

    with torch.no_grad():
        check()


def child_main(argv: list[str]) -> None:
    """``python -m tests.adversarial.test_backends_child_process BACKEND CASE...``
    (``property:N`` for the property)."""
    backend, names = argv[0], argv[1:]
    env = Env(backend)
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        try:
            if name.startswith("property:"):
                property_malformed(env, int(name.split(":", 1)[1]))
            else:
                CASES[name](env)
        except BaseException as exc:  # one line per case, whatever happened
            text = f"{type(exc).__name__}: {exc}"
            print(json.dumps({"case": name, "ok": False, "detail": text[-3000:]}), flush=True)
        else:
            print(json.dumps({"case": name, "ok": True, "detail": ""}), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: one child per backend, re-spawned past a crash.


def _examples() -> int:
    return 5000 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 200


def _available(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or None."""
    import torch

    from attn_dispatch.backend import list_backends

    if backend in CUDA_ONLY and not torch.cuda.is_available():
        return f"{backend} needs CUDA (none on this machine)"
    caps = list_backends().get(backend)
    if caps is None:
        return f"{backend} is not registered"
    why = caps.availability_reasons()
    return f"{backend} cannot run here: {'; '.join(why)}" if why else None


_RESULTS: dict[str, dict[str, dict[str, Any]]] = {}


def _run_children(backend: str, names: list[str]) -> dict[str, dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_INTERPRET", "1")
    import torch

    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)
    results: dict[str, dict[str, Any]] = {}
    left = list(names)
    while left:
        done = subprocess.run(
            [sys.executable, "-m", "tests.adversarial.test_backends_child_process", backend, *left],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        started = None
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "start" in msg:
                started = msg["start"]
            else:
                results[msg["case"]] = msg
        if started is not None and started not in results:
            tail = (done.stderr or "")[-2000:]
            results[started] = {
                "case": started,
                "ok": False,
                "detail": f"the process crashed (exit {done.returncode}) in this case:\n{tail}",
            }
        elif started is None or done.returncode != 0:
            for name in left:
                results.setdefault(
                    name,
                    {"case": name, "ok": False, "detail": f"child failed:\n{done.stderr[-3000:]}"},
                )
        left = [n for n in left if n not in results]
    return results


def _result(backend: str, name: str) -> dict[str, Any]:
    why = _available(backend)
    if why is not None:
        pytest.skip(why)
    if backend not in _RESULTS:
        _RESULTS[backend] = _run_children(backend, [*CASES, f"property:{_examples()}"])
    return _RESULTS[backend][name if name in CASES else f"property:{_examples()}"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_case(backend: str, case: str) -> None:
    res = _result(backend, case)
    assert res["ok"], f"{backend} / {case}: {res['detail']}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_batches_raise_or_stay_in_the_convex_hull(backend: str) -> None:
    res = _result(backend, "property")
    assert res["ok"], f"{backend}: {res['detail']}"


if __name__ == "__main__":
    child_main(sys.argv[1:])
