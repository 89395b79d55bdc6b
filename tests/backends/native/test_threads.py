"""The native kernels' thread count follows torch's setting, read at every call.

``NativeBackend(num_threads=None)`` (the default) runs each call on
``torch.get_num_threads()`` threads: the calling thread plus workers of the library's own
pool (not OpenMP), which grows to the largest count asked for and keeps idle workers parked.
Checked in a child process by counting the process's threads (/proc/self/task) around calls
made under ``torch.set_num_threads(n)``.
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
def test_native_threads_follow_torch_get_num_threads() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
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
    # Back to 2: no new thread (idle workers stay parked).
    assert grown[2] == 0, counts
