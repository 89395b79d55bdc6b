"""One rank of tests/distributed/test_agreement.py: binds per case, runs check_agreement.

Both ranks walk the same case list (check_agreement is a collective); rank 1 differs from
rank 0 in the field the case names. Prints one ``CASE <name> ok|<error text>`` line per case.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys

import torch.distributed as dist

import attn_dispatch
from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import bind
from attn_dispatch.backends.native import _lib
from attn_dispatch.distributed import RankMismatchError
from attn_dispatch.distributed import check_agreement

BASE = AttnConfig(
    kind="mha", num_q_heads=8, num_kv_heads=4, head_dim=16, dtype="float32", page_size=16
)


def bindings(rank: int, case: str) -> dict[str, object]:
    target_spec = BackendSpec.parse("prefill=torch,decode=native")
    draft_spec = BackendSpec.uniform("torch")
    target_cfg, draft_cfg = BASE, dataclasses.replace(BASE, num_q_heads=4, num_kv_heads=2)
    if case == "head_split":  # rank 1 holds a different slice of the heads: allowed
        target_cfg = dataclasses.replace(BASE, num_q_heads=4, num_kv_heads=2)
    if rank == 1:
        if case == "spec":
            target_spec = BackendSpec.uniform("torch")
        elif case == "page_size":
            target_cfg = dataclasses.replace(BASE, page_size=32)
        elif case == "kv_dtype":
            target_cfg = dataclasses.replace(BASE, dtype="bfloat16", kv_dtype="float8_e4m3fn")
        elif case == "verify_mode":
            target_spec = BackendSpec(prefill="torch", decode="native", verify_mode="decode")
    out = {"target": bind(target_spec, target_cfg, label="target")}
    if not (rank == 1 and case == "missing_runner"):
        out["draft"] = bind(draft_spec, draft_cfg, label="draft")
    return out


CASES = [
    "agree",
    "head_split",
    "spec",
    "page_size",
    "kv_dtype",
    "verify_mode",
    "missing_runner",
    "library_version",
    "native_abi",
]


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    version, abi = attn_dispatch.__version__, _lib.ABI_VERSION
    for case in CASES:
        attn_dispatch.__version__ = (
            "0.0.0-other" if rank == 1 and case == "library_version" else version
        )
        _lib.ABI_VERSION = abi + 1 if rank == 1 and case == "native_abi" else abi
        try:
            check_agreement(bindings(rank, case))
            result = "ok"
        except RankMismatchError as e:
            result = json.dumps({"message": str(e), "fields": sorted(e.differences)})
        print(f"CASE {case} {result}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
