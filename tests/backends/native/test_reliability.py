"""The native backend across fork and exit, its return codes, thread counts and concurrency.

Crash- and hang-prone cases run in child processes with timeouts (a hang fails the test
instead of stopping the suite):

- fork: a process that loaded native and ran torch's OpenMP team, then forks before its first
  native call (os.fork, multiprocessing's fork), or loads native only in the child: the child's
  call finishes with the parent's answer (the library runs on its own pool there), never hangs;
  spawn works too;
- exit: a daemon thread still serving with a backend while the interpreter exits keeps its
  runner (freed with the backend object, not by an exit hook);
- codes: each C return code and error field is named in Python (``NaStatus``, ``NaField``),
  checked against the library's own list at load, and mapped to its own message and error;
- thread counts beyond int32 are refused instead of wrapping; the C side refuses < 1;
- two threads on two runners run at once (each caller gets worker threads of its own).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch._errors import BackendUnavailableError  # noqa: E402
from attn_dispatch._errors import InvalidBatchError  # noqa: E402
from attn_dispatch._errors import InvalidSpecError  # noqa: E402
from attn_dispatch.backends.native._lib import NaField  # noqa: E402
from attn_dispatch.backends.native._lib import NaStatus  # noqa: E402
from attn_dispatch.backends.native._lib import codes_mismatch  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from attn_dispatch.backends.native._lib import mirrored_codes  # noqa: E402
from attn_dispatch.backends.native.backend import run_args  # noqa: E402

LIB = load()
ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")

# What every child below shares: a backend, a decode batch long enough to split over two
# threads, and torch's OpenMP team started by a matmul.
_SETUP = textwrap.dedent(
    """
    import os, sys
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, Phase
    from attn_dispatch.backends.native.backend import NativeBackend

    CFG = AttnConfig("mha", 8, 2, 32, 32, dtype="float32", page_size=4, device="cpu")
    BATCH = AttnBatch.build(Phase.DECODE, q_lens=[1] * 16, kv_lens=[300] * 16,
                            page_tables=[list(range(75 * i, 75 * i + 75)) for i in range(16)],
                            page_size=4, num_pages=1200)
    g = torch.Generator().manual_seed(0)
    Q = torch.randn(16, 8, 32, generator=g)
    K = torch.randn(1200, 4, 2, 32, generator=g)
    V = torch.randn(1200, 4, 2, 32, generator=g)

    def native_call(be):
        return be.handler(Phase.DECODE)(Q, K, V, be.plan(BATCH), 0.2)

    def torch_team():
        torch.set_num_threads(2)
        a = torch.randn(384, 384)
        (a @ a).sum()
    """
)


def _child(body: str, *, timeout: int = 120) -> str:
    """Runs _SETUP + body in a fresh interpreter; returns stdout (fails on error or hang)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NATIVE_ATTN_OWN_POOL", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SETUP + textwrap.dedent(body)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung (killed after {timeout} s): {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# -- fork ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("loaded", ["before-fork", "in-child"])
def test_os_fork_after_torch_team_before_first_native_call(loaded: str) -> None:
    # "before-fork": the library is loaded (a backend built) in the parent, which then runs
    # torch's team and forks before any native call. "in-child": the parent never loads the
    # library; the child loads it first. Either way the child's 2-thread call must finish
    # with the answer of a 1-thread call (plans and results do not depend on the count).
    out = _child(
        f"""
        import faulthandler
        import attn_dispatch.backends.native._lib as lib
        torch_team()
        be = NativeBackend(CFG, num_threads=2) if {loaded!r} == "before-fork" else None
        assert bool(lib._cache) == (be is not None)
        torch_team()
        pid = os.fork()
        if pid == 0:
            # A hang in the child ends it (exit 1) instead of the test's timeout.
            faulthandler.dump_traceback_later(60, exit=True)
            try:
                got = native_call(be if be is not None else NativeBackend(CFG, num_threads=2))
                ref = native_call(NativeBackend(CFG, num_threads=1))
                os._exit(0 if torch.equal(got, ref) else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        """
    )
    assert "CHILD 0" in out, out


_MP_SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp

    BE = None

    def work(_):
        # fork: the parent's backend (runner and library inherited); spawn: a fresh one.
        be = BE if BE is not None else NativeBackend(CFG, num_threads=2)
        return native_call(be)

    if __name__ == "__main__":
        method = sys.argv[1]
        torch_team()
        BE = NativeBackend(CFG, num_threads=2)
        expect = native_call(BE) if method == "spawn" else None
        torch_team()
        with mp.get_context(method).Pool(1) as pool:
            got = pool.map_async(work, [0]).get(timeout=90)[0]
        if expect is None:
            expect = native_call(BE)
        print("SAME", torch.equal(got, expect))
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_child_after_torch_team(method: str, tmp_path: Path) -> None:
    import multiprocessing

    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {method!r} is not available here")
    script = tmp_path / "mp_native.py"
    script.write_text(_SETUP + _MP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NATIVE_ATTN_OWN_POOL", None)
    try:
        done = subprocess.run(
            [sys.executable, str(script), method],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {method} child hung: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SAME True" in done.stdout, done.stdout


# -- exit ---------------------------------------------------------------------------------------


def test_runner_outlives_exit_hooks_while_a_daemon_thread_serves() -> None:
    # An exit hook registered before anything is imported runs last, after every other exit
    # hook (weakref's finalizers among them, registered at the first finalizer): a daemon
    # thread still serving then must find its runner.
    first = textwrap.dedent(
        """
        import atexit, queue, threading
        results = queue.Queue()
        go = threading.Event()

        def last_hook():
            go.set()
            print("DAEMON", results.get(timeout=60), flush=True)

        atexit.register(last_hook)
        """
    )
    body = textwrap.dedent(
        """
        def serve(be):
            go.wait()
            try:
                native_call(be)
                results.put("OK")
            except Exception as exc:
                results.put(f"{type(exc).__name__}: {exc}")

        be = NativeBackend(CFG, num_threads=1)
        native_call(be)
        threading.Thread(target=serve, args=(be,), daemon=True).start()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", first + _SETUP + body],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert "DAEMON OK" in done.stdout, (done.stdout, done.stderr[-3000:])


def test_runner_is_freed_with_the_backend_object() -> None:
    from attn_dispatch.backends.native.backend import NativeBackend

    assert not isinstance(LIB, str)
    be = NativeBackend(_config(), num_threads=1)
    runner = be._runner
    del be
    import gc

    gc.collect()
    # The library no longer has it: a plan on that id is refused as an unknown runner.
    assert _plan_on(runner) == NaStatus.UNKNOWN_RUNNER


# -- codes --------------------------------------------------------------------------------------


def test_codes_match_the_library() -> None:
    assert not isinstance(LIB, str)
    assert codes_mismatch(LIB.cdll) is None
    listed = bytes(LIB.cdll.na_codes()).decode().split(",")
    assert {pair.split("=")[0] for pair in listed} == set(mirrored_codes())


def test_a_code_that_differs_is_reported() -> None:
    assert not isinstance(LIB, str)
    wrong = {**mirrored_codes(), "NA_BAD_THREADS": -99}
    assert "code NA_BAD_THREADS differs" in str(codes_mismatch(LIB.cdll, wrong))
    extra = {**mirrored_codes(), "NA_NEW_CODE": -8}
    assert "library: missing" in str(codes_mismatch(LIB.cdll, extra))
    fewer = {k: v for k, v in mirrored_codes().items() if k != "NA_E_MASK"}
    assert "mirror in" in str(codes_mismatch(LIB.cdll, fewer))
    assert "missing" in str(codes_mismatch(LIB.cdll, fewer))


def test_a_library_whose_codes_differ_is_refused_at_load() -> None:
    out = _child(
        """
        import enum
        from attn_dispatch.backends.native import _lib
        members = {m.name: m.value for m in _lib.NaStatus}
        members["BAD_THREADS"] = -70
        _lib.NaStatus = enum.IntEnum("NaStatus", members)
        from attn_dispatch._errors import BackendUnavailableError
        try:
            NativeBackend(CFG)  # the library is loaded (and checked) here
        except BackendUnavailableError as exc:
            print("REFUSED", exc)
        else:
            print("LOADED")
        """
    )
    assert "REFUSED" in out, out
    assert "code NA_BAD_THREADS differs" in out and "library: -7" in out, out


def test_every_code_has_its_own_message_and_error() -> None:
    from attn_dispatch.backends.native.backend import _E_FIELDS
    from attn_dispatch.backends.native.backend import FIELD_MESSAGES
    from attn_dispatch.backends.native.backend import STATUS_MESSAGES
    from attn_dispatch.backends.native.backend import status_error

    failures = set(NaStatus) - {NaStatus.OK}
    assert set(STATUS_MESSAGES) == failures
    assert len(set(STATUS_MESSAGES.values())) == len(failures)
    messages = {str(status_error(int(code), "na_run")) for code in failures}
    assert len(messages) == len(failures), messages
    expected = {
        NaStatus.BAD_ARGS: InvalidBatchError,
        NaStatus.NO_MEMORY: MemoryError,
        NaStatus.UNKNOWN_PLAN: InvalidBatchError,
        NaStatus.FOREIGN_PLAN: InvalidBatchError,
        NaStatus.UNKNOWN_RUNNER: BackendUnavailableError,
        NaStatus.BAD_CONFIG: InvalidSpecError,
        NaStatus.BAD_THREADS: InvalidSpecError,
        NaStatus.SHORT_BUFFER: RuntimeError,
    }
    assert set(expected) == failures
    for code, kind in expected.items():
        assert type(status_error(int(code), "na_run")) is kind, code
    unknown = status_error(-42, "na_run")
    assert type(unknown) is RuntimeError and "-42" in str(unknown)
    # Every error field is either a batch field's own problem or has its own message.
    assert set(_E_FIELDS) | set(FIELD_MESSAGES) == set(NaField)
    assert not set(_E_FIELDS) & set(FIELD_MESSAGES)


def test_a_freed_runner_is_not_reported_as_a_config_refusal() -> None:
    from attn_dispatch.backends.native.backend import NativeBackend

    assert not isinstance(LIB, str)
    be = NativeBackend(_config(), num_threads=1)
    batch = _batch()
    plan = be.plan(batch)
    LIB.cdll.na_runner_free(be._runner)
    with pytest.raises(BackendUnavailableError, match="runner is no longer in the native library"):
        be.plan(batch)
    q, k = torch.randn(2, 4, 16), torch.randn(4, 4, 2, 16)
    with pytest.raises(BackendUnavailableError, match="na_run: this backend object's runner"):
        be.handler(Phase.DECODE)(q, k, k, plan, 0.25)


# -- thread counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2**31, 2**32 + 2, True])
def test_thread_counts_beyond_int32_are_refused(count: Any) -> None:
    from attn_dispatch.backends.native.backend import NativeBackend

    with pytest.raises(InvalidSpecError, match="num_threads") as err:
        NativeBackend(_config(), num_threads=count)
    assert err.value.value is count


def test_the_library_refuses_a_thread_count_below_one() -> None:
    from attn_dispatch.backends.native.backend import NativeBackend

    be = NativeBackend(_config(), num_threads=1)
    plan = be.plan(_batch())
    q, k = torch.randn(2, 4, 16), torch.randn(4, 4, 2, 16)
    out = torch.empty(2, 4, 16)
    for threads, expect in ((0, NaStatus.BAD_THREADS), (-3, NaStatus.BAD_THREADS), (1, 0)):
        args = run_args(q, k, k, out, sm_scale=0.25, num_threads=threads)
        rc = be._run(be._runner, be._issued[id(plan)].plan_id, ctypes.byref(args))
        assert rc == expect, (threads, rc)


# -- concurrency --------------------------------------------------------------------------------

_TWO_CALLERS = """
    import threading
    def tasks():
        return len(os.listdir("/proc/self/task"))

    big = AttnBatch.build(Phase.DECODE, q_lens=[1] * 16, kv_lens=[4800] * 16,
                          page_tables=[[p % 1200 for p in range(1200 * i, 1200 * i + 1200)]
                                       for i in range(16)], page_size=4, num_pages=1200)
    bes = [NativeBackend(CFG, num_threads=2) for _ in range(2)]
    plans = [be.plan(big) for be in bes]
    run = [be.handler(Phase.DECODE) for be in bes]
    run[0](Q, K, V, plans[0], 0.2)  # one caller alone: one pool with one worker
    alone = tasks()
    barrier = threading.Barrier(2)

    def serve(i):
        barrier.wait()
        for _ in range(30):
            run[i](Q, K, V, plans[i], 0.2)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import time
    for _ in range(50):  # a joined thread may still be listed for a moment
        if tasks() - alone <= 1:
            break
        time.sleep(0.1)
    print("GROWN", tasks() - alone)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc/self/task")
def test_two_callers_on_two_runners_do_not_wait_for_each_other() -> None:
    # On the library's own pool, two concurrent callers each get a pool of their own (one more
    # parked worker), instead of queueing for one process-wide pool (no new worker).
    out = _child_env(_TWO_CALLERS, own_pool=True)
    grown = int(out.split("GROWN", 1)[1])
    assert grown == 1, out


def _child_env(body: str, *, own_pool: bool) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if own_pool:
        env["NATIVE_ATTN_OWN_POOL"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SETUP + textwrap.dedent(body)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# -- helpers ------------------------------------------------------------------------------------


def _config() -> AttnConfig:
    return AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=4, device="cpu")


def _batch() -> AttnBatch:
    return AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[7, 5], page_tables=[[0, 1], [2, 3]], page_size=4
    )


def _plan_on(runner: int) -> int:
    """na_plan_create's code for a one-request batch on ``runner``."""
    from attn_dispatch.backends.native._lib import NaError
    from attn_dispatch.backends.native._lib import NaPlanArgs
    from attn_dispatch.backends.native._lib import NaPlanInfo

    assert not isinstance(LIB, str)
    qo = (ctypes.c_int32 * 2)(0, 1)
    kvp = (ctypes.c_int32 * 2)(0, 1)
    idx = (ctypes.c_int32 * 1)(0)
    lens = (ctypes.c_int32 * 1)(1)
    args = NaPlanArgs(
        num_requests=1, decode=1, split_target=1,
        qo_indptr=ctypes.addressof(qo), kv_indptr=ctypes.addressof(kvp),
        kv_indices=ctypes.addressof(idx), num_indices=1, kv_lens=ctypes.addressof(lens),
    )  # fmt: skip
    plan, info, err = ctypes.c_uint64(0), NaPlanInfo(), NaError()
    return int(
        LIB.cdll.na_plan_create(
            runner, ctypes.byref(args), ctypes.byref(plan), ctypes.byref(info), ctypes.byref(err)
        )
    )
