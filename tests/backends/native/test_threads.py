"""The native kernels' thread count follows torch's setting, read at every call.

``NativeBackend(num_threads=None)`` (the default) runs each call on
``torch.get_num_threads()`` threads: the calling thread plus workers of torch's own OpenMP
team (when torch's runtime is loaded) or of the library's own pool (``NATIVE_ATTN_OWN_POOL=1``,
and in a forked child); either grows to the largest count asked for and keeps idle workers
parked. Checked in a child process by counting the process's threads (/proc/self/task) around
calls made under ``torch.set_num_threads(n)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from attn_dispatch.backends.native._lib import load

LIB = load()
ROOT = Path(__file__).resolve().parents[3]

_CHILD = textwrap.dedent(
    """
    import os
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, Phase
    from attn_dispatch.backends.native.backend import NativeBackend

    def tasks():
        return len(os.listdir("/proc/self/task"))

    cfg = AttnConfig("mha", 8, 2, 32, 32, dtype="float32", page_size=4, device="cpu")
    be = NativeBackend(cfg)
    batch = AttnBatch.build(Phase.DECODE, q_lens=[1] * 16, kv_lens=[64] * 16,
                            page_tables=[list(range(16 * i, 16 * i + 16)) for i in range(16)],
                            page_size=4, num_pages=256)
    q = torch.randn(16, 8, 32)
    k = torch.randn(256, 4, 2, 32)
    v = torch.randn(256, 4, 2, 32)
    run = be.handler(Phase.DECODE)
    counts = []
    for n in (1, 3, 5, 2):
        torch.set_num_threads(n)
        assert be.threads() == n
        plan = be.plan(batch)
        before = tasks()
        out = run(q, k, v, plan, 0.2)
        counts.append((n, before, tasks()))
    print("COUNTS", counts)
    """
)


@pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc/self/task")
@pytest.mark.parametrize("runtime", ["torch-openmp", "own-pool"])
def test_native_threads_follow_torch_get_num_threads(runtime: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("NATIVE_ATTN_OWN_POOL", None)
    if runtime == "own-pool":
        env["NATIVE_ATTN_OWN_POOL"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = eval(done.stdout.split("COUNTS", 1)[1])  # a list of int tuples we printed
    grown = {n: after - before for n, before, after in counts}
    # 1 thread: the calling thread alone, no worker started.
    assert grown[1] == 0, counts
    # 3 then 5 threads: the pool grows to n - 1 workers (2, then 2 more).
    assert grown[3] == 2 and grown[5] == 2, counts
    # Back to 2: no new thread. The own pool keeps its idle workers parked; torch's OpenMP
    # runtime lets the team's surplus threads end.
    if runtime == "own-pool":
        assert grown[2] == 0, counts
    else:
        assert grown[2] <= 0, counts


_FORK_CHILD = textwrap.dedent(
    """
    import os
    import torch
    from attn_dispatch import AttnBatch, AttnConfig, Phase
    from attn_dispatch.backends.native.backend import NativeBackend

    torch.set_num_threads(2)
    cfg = AttnConfig("mha", 8, 2, 32, 32, dtype="float32", page_size=4, device="cpu")
    be = NativeBackend(cfg)
    batch = AttnBatch.build(Phase.DECODE, q_lens=[1] * 16, kv_lens=[64] * 16,
                            page_tables=[list(range(16 * i, 16 * i + 16)) for i in range(16)],
                            page_size=4, num_pages=256)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 8, 32, generator=g)
    k = torch.randn(256, 4, 2, 32, generator=g)
    v = torch.randn(256, 4, 2, 32, generator=g)
    run = be.handler(Phase.DECODE)
    parent = run(q, k, v, be.plan(batch), 0.2)  # the parent's team is now started
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))
    pid = os.fork()
    if pid == 0:
        # The child has none of the parent's threads: the library must not wait on a team
        # that no longer exists (it uses its own pool there) and must give the same answer.
        torch.set_num_threads(2)
        child = run(q, k, v, be.plan(batch), 0.2)
        os._exit(0 if torch.equal(child, parent) else 3)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_native_runs_in_a_forked_child_after_the_parent_used_threads() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NATIVE_ATTN_OWN_POOL", None)
    done = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CHILD 0" in done.stdout, (done.stdout, done.stderr[-3000:])
