"""`import attn_dispatch` stays light: no heavy framework is imported, and it is quick.

The import time is measured and printed (run with -s to see it), never asserted: timing
depends on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "flashinfer", "transformers", "numpy")

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import attn_dispatch
t1 = time.perf_counter()
attn_dispatch.list_backends()  # loads built-ins' light modules and plugins
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "registry_ms": (t2 - t1) * 1e3,
                  "modules": sorted(sys.modules)}))
"""


def _probe() -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_import_pulls_no_heavy_module() -> None:
    data = _probe()
    modules = set(data["modules"])  # type: ignore[arg-type]
    assert "attn_dispatch" in modules and "attn_dispatch._scope" in modules
    leaked = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert leaked == [], f"import attn_dispatch (and list_backends) imported {leaked}"
    # No backend's heavy implementation module is imported before bind.
    assert not [
        m for m in modules if m.startswith("attn_dispatch.backends.") and m.endswith(".backend")
    ]


def test_import_time_is_reported() -> None:
    runs = [_probe() for _ in range(3)]
    imp = sorted(float(r["import_ms"]) for r in runs)  # type: ignore[arg-type]
    reg = sorted(float(r["registry_ms"]) for r in runs)  # type: ignore[arg-type]
    print(
        f"\nimport attn_dispatch: median {imp[1]:.1f} ms (min {imp[0]:.1f}); "
        f"first list_backends(): median {reg[1]:.1f} ms"
    )
    assert all(t > 0 for t in imp)
