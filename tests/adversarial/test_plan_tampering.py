"""An issued plan edited in every way a caller can reach: our error or the right answer.

The rule for every backend (docs/concepts/safety.md): a plan is a value the backend can trust
or refuse. The child walks everything reachable from an issued plan through its fields,
slots, tuples, lists and dicts (the backend object in ``owner`` is not the plan's: it is not
walked) and, on a fresh plan per case, makes one edit:

- a field of any object on the way replaced with ``object.__setattr__`` (frozen or not):
  ints by 0, -1 and 10**9, tuples by ``()``, tensors by zeros, a huge-valued or an empty
  tensor, anything else by None -- the snapshot's step summary and a call list included;
- a tensor on the way edited in place: filled with a large index, -1, 0 (ints), NaN/0/-inf
  (floats), True/False (bools), or its first entry moved by one.

The K/V caches are views into larger tensors whose other pages hold NaN, so a read outside
the view (in its storage) cannot pass for the right answer.

Every case must give our ``InvalidBatchError`` or the answer of the batch the plan was made
for (float64 oracle), within seconds; a raw torch error, another answer or a long run fails.
The sdpa and triton backends hand out handles with nothing mutable inside (the records their
handlers read stay with the backend object), which the test checks too; the torch reference
checks its plan against the record it kept at issue; native's plan lives in C, which bounds
every read by the element counts it is given. Each backend runs in
a child process (``python -m tests.adversarial.test_plan_tampering BACKEND``): an edit that
made a kernel read outside its tensors could crash rather than raise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: A case slower than this (seconds) fails: an edited length must not make a call crawl.
SLOW = 60.0
#: Backends whose plans are handles: nothing mutable may be reachable from them.
HANDLES = {"sdpa", "triton"}

# ---------------------------------------------------------------------------------------------
# The child


def _walk(plan: Any) -> list[tuple[str, Any, Any, str | None]]:
    """``(path, object, parent, attribute)`` for everything reachable from ``plan``, in a
    fixed order (so a case names the same object on a fresh plan of the same batch)."""
    import enum

    import torch

    from attn_dispatch._protocol import BackendBase

    out: list[tuple[str, Any, Any, str | None]] = []
    seen: set[int] = set()

    def visit(path: str, obj: Any, parent: Any, name: str | None) -> None:
        out.append((path, obj, parent, name))
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, BackendBase, enum.Enum, type, str, int, float)):
            return
        if obj is None:
            return
        if isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                visit(f"{path}[{i}]", item, None, None)
            return
        if isinstance(obj, dict):
            for key, item in obj.items():
                visit(f"{path}[{key!r}]", item, None, None)
            return
        names: list[str] = []
        for klass in type(obj).__mro__:
            slots = klass.__dict__.get("__slots__", ())
            names += [slots] if isinstance(slots, str) else list(slots)
        names += list(getattr(obj, "__dict__", {}))
        for attr in names:
            if attr.startswith("__") or not hasattr(obj, attr):
                continue
            visit(f"{path}.{attr}", getattr(obj, attr), obj, attr)

    visit("plan", plan, None, None)
    return out


def _edits(item: tuple[str, Any, Any, str | None]) -> Iterator[tuple[str, Callable[[], None]]]:
    """The edits of one reachable object: ``(description, apply)``."""
    import torch

    path, obj, parent, name = item
    if isinstance(obj, torch.Tensor) and obj.numel():
        if obj.dtype == torch.bool:
            fills: list[Any] = [True, False]
        elif obj.dtype.is_floating_point:
            fills = [math.nan, 0.0, -math.inf]
        else:
            fills = [10**6, -1, 0]
        for value in fills:
            yield f"{path} fill {value}", lambda t=obj, v=value: t.fill_(v)  # type: ignore[misc]
        if not obj.dtype.is_floating_point and obj.dtype != torch.bool:
            yield f"{path}[0] += 1", lambda t=obj: t.view(-1)[0].add_(1)  # type: ignore[misc]
    if parent is None or name is None:
        return
    if isinstance(obj, bool):
        subs: list[Any] = [not obj]
    elif isinstance(obj, int):
        subs = [0, -1, 10**9]
    elif isinstance(obj, tuple):
        subs = [(), None]
    elif isinstance(obj, torch.Tensor):
        subs = [torch.zeros_like(obj), torch.full_like(obj, 10**6), obj[:0], None]
    else:
        subs = [None]
    for sub in subs:
        text = f"tensor {tuple(sub.shape)}" if isinstance(sub, torch.Tensor) else repr(sub)
        yield (
            f"{path} := {text}",
            lambda p=parent, n=name, s=sub: object.__setattr__(p, n, s),  # type: ignore[misc]
        )


def _child(backend: str) -> None:
    if backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import InvalidBatchError
    from attn_dispatch import Phase
    from attn_dispatch import bind
    from tests import oracle

    cfg = AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=4, device="cpu",
                     tree_verify=True)  # fmt: skip
    binding = bind(backend, cfg)
    g = torch.Generator().manual_seed(11)
    # The caches are views of larger tensors whose other pages hold NaN: a read outside
    # the view (in its storage) shows in the output.
    k_store = torch.full((14, 4, 2, 16), math.nan)
    v_store = torch.full((14, 4, 2, 16), math.nan)
    k = k_store[2:12]
    v = v_store[2:12]
    k.copy_(torch.randn(10, 4, 2, 16, generator=g))
    v.copy_(torch.randn(10, 4, 2, 16, generator=g))
    tree = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    batches = {
        "decode": AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[9, 6],
                                  page_tables=[[3, 7, 1], [0, 5]], page_size=4, num_pages=10),
        "extend": AttnBatch.build(Phase.PREFILL, q_lens=[3, 2], kv_lens=[7, 5],
                                  page_tables=[[6, 1], [3, 8]], page_size=4, num_pages=10),
        "tree": AttnBatch.build(Phase.VERIFY, q_lens=[2], kv_lens=[6], page_tables=[[2, 9]],
                                page_size=4, num_pages=10, masks=[tree]),
    }  # fmt: skip

    def report(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    for label, batch in batches.items():
        q = torch.randn(batch.num_tokens, 4, 16, generator=g)
        run = binding.handler(batch.phase)
        want = oracle.reference_for_batch(cfg, batch, q, k, v, 0.25).float()
        first = binding.plan(batch)
        mutable = [
            path
            for path, obj, _p, _n in _walk(first)
            if isinstance(obj, (torch.Tensor, list, dict, set, bytearray))
            or ((hasattr(obj, "__dict__") or hasattr(obj, "__slots__")) and not _frozen(obj))
        ]
        report(case=f"{label}: mutable", outcome="listed", detail=mutable)
        names = [path for path, *_ in _walk(first)]
        for index, item in enumerate(_walk(first)):
            for edit_no, _edit in enumerate(_edits(item)):
                plan = binding.plan(batch)
                fresh = _walk(plan)
                assert [p for p, *_ in fresh] == names, "plans of one batch differ in shape"
                desc, apply = list(_edits(fresh[index]))[edit_no]
                case = f"{label}: {desc}"
                start = time.perf_counter()
                try:
                    apply()
                except (AttributeError, TypeError) as exc:
                    report(case=case, outcome="not editable", detail=str(exc)[:200])
                    continue
                try:
                    out = run(q, k, v, plan, 0.25)
                except InvalidBatchError as exc:
                    outcome, detail = "refused", str(exc)[:200]
                except Exception as exc:  # a raw error is a failure of the rule
                    outcome, detail = "raw", f"{type(exc).__name__}: {exc}"[:300]
                else:
                    same = out.shape == want.shape and torch.allclose(
                        out.float(), want, atol=2e-4, rtol=2e-4
                    )
                    outcome, detail = ("right", "") if same else ("wrong", "")
                report(case=case, outcome=outcome, detail=detail,
                       seconds=round(time.perf_counter() - start, 2))  # fmt: skip


def _frozen(obj: Any) -> bool:
    """Objects whose fields can only change through ``object.__setattr__`` (frozen
    dataclasses, enums, plain ``object()`` tokens)."""
    import dataclasses
    import enum

    if type(obj) is object or isinstance(obj, enum.Enum):
        return True
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(dataclasses.is_dataclass(obj) and params is not None and params.frozen)


# ---------------------------------------------------------------------------------------------
# The parent


def _results(backend: str) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.adversarial.test_plan_tampering", backend],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    return [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("backend", ["sdpa", "torch", "triton", "native"])
def test_every_edit_of_an_issued_plan_is_refused_or_answered_right(backend: str) -> None:
    from attn_dispatch.backend import list_backends

    caps = list_backends().get(backend)
    why = ["not registered"] if caps is None else list(caps.availability_reasons())
    if why:
        pytest.skip(f"backend {backend!r} cannot run here: {'; '.join(why)}")
    rows = _results(backend)
    cases = [r for r in rows if r["outcome"] != "listed"]
    assert len(cases) >= 6, rows  # the walk reached the plan's fields
    bad = [r for r in cases if r["outcome"] not in ("refused", "right", "not editable")]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    slow = [r for r in cases if r.get("seconds", 0.0) > SLOW]
    assert not slow, slow
    if backend in HANDLES:
        # Nothing mutable reachable from the handle: no tensor, list, dict or plain object.
        listed = [r for r in rows if r["outcome"] == "listed"]
        assert listed and all(r["detail"] == [] for r in listed), listed


def test_a_snapshots_step_counts_change_only_by_follow() -> None:
    import copy
    import pickle

    from attn_dispatch._snapshot import StepStats

    step = StepStats(3, 2, 9, 4)
    with pytest.raises(AttributeError, match="read-only"):
        step.max_page = 0  # type: ignore[misc]
    step.follow(StepStats(5, 1, 7, 2))
    assert (step.num_tokens, step.max_q_len, step.max_kv_len, step.max_page) == (5, 1, 7, 2)
    for twin in (copy.copy(step), copy.deepcopy(step), pickle.loads(pickle.dumps(step))):
        assert twin is not step and twin.max_page == 2 and twin.num_tokens == 5


if __name__ == "__main__":
    _child(sys.argv[1])
