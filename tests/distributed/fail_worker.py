"""One rank of tests/distributed/test_agreement_failure.py: some ranks fail before the check.

Every rank walks the same cases (check_agreement is a collective). In each case the ranks
named in ``FAILING`` pass something that is not a binding, so ``binding_summary`` refuses it
on that rank before the exchange. Prints one ``CASE <name> <json>`` line per case.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist

from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import bind
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch.distributed import check_agreement

CFG = AttnConfig(
    kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", page_size=16
)
# case -> the ranks that fail before the collective.
FAILING = {"one_fails": (1,), "two_fail": (1, 2), "after_failures_agree": ()}


def main() -> int:
    # A short timeout: a rank left waiting for a failed one fails the test in seconds, not in
    # gloo's default 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
    rank = dist.get_rank()
    for case, failing in FAILING.items():
        bindings: object = {"target": bind(BackendSpec.uniform("torch"), CFG, label="target")}
        if rank in failing:
            bindings = ["not", "a", "binding"]
        try:
            check_agreement(bindings)  # type: ignore[arg-type]
            result: dict[str, object] = {"ok": True}
        except AttnDispatchError as e:
            result = {
                "type": type(e).__name__,
                "message": str(e),
                "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()},
                "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None,
            }
        print(f"CASE {case} {json.dumps(result)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
