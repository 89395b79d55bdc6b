"""Dispatch overhead, measured side by side in one process (not a test; no assertions).

    python bench/dispatch.py [--repeats 31] [--target-ms 5] [--json PATH] [--quick]

Every case is a tiny function timed with timeit-style loops; repeats of all cases are
interleaved (case A, B, C, A, B, C, ...) so a burst of load on a shared machine hits every case
alike, and the reported figure is the median over repeats of ns per call. Ratios are what
matter; the absolute numbers depend on the machine.

Cases:
  floor             a function doing ContextVar.get() plus a tuple index with an int (the
                    ideal hot path; an int, as the Phase of older releases was one)
  resolve           attn_dispatch.resolve(phase) inside a scope
  attention         attn_dispatch.attention(..., sm_scale=1.0) with a no-op handler
  attention_cfg_scale  the same without sm_scale: the bound AttnConfig carries it
  attention_before  the attention() of the release before layer variants and groups (its body
                    copied here), on the same binding: the baseline of the 1.3x target
  attention_group   attention(..., group="sliding") on a runner bound with two groups
  scope_groups      `with attn_scope(grouped, batch): pass` (plans both groups)
  sglang_global     SGLang's old pattern: read the global server args, look the name up
  hf_interface      transformers' ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
  scope             `with attn_scope(binding): pass` (construct, enter, exit)
  scope_construct   `attn_scope(binding)` alone (where the time of `scope` goes: this part)
  scope_reuse       `with s: pass` on one instance built once (and this part)
  scope_batch       the same with a batch (one no-op plan)
  cv_set_reset      ContextVar.set + ContextVar.reset (the floor of a scope)
  sdpa_kernel       `with torch.nn.attention.sdpa_kernel(MATH): pass`
  resolve_runners_1 / _10000, resolve_backends_1 / _1000, resolve_depth_1 / _100: resolve
                    with that many runners bound, backends registered, scopes nested
  attention_rec_tally  attention() while record_dispatch(tally=True) is open in its context:
                    what attn_dispatch.testing's isolation checks record (a count per runner,
                    phase, form and group); the ratio row shows the ns it adds per call
  attention_rec_events attention() while a plain record_dispatch() is open (one event per call)
  attention_after_rec  attention() after a recorder was opened and closed (nothing left)
  attention_table   attention() on a runner bound from a dispatch table (spec_from_table on
                    a saved table): the same cost as a written spec, the table is read at bind
  attention_buckets attention() on a runner whose decode picks its backend by shape buckets
                    (context<=512:...|...): the bucket is chosen at scope entry, so a layer's
                    call costs what it costs without buckets
  scope_batch_buckets  `with attn_scope(bucketed, batch): pass`: where the choice is paid (once
                    per forward)

The recording cases switch the process-wide call hook on only while they are timed (it is
what record_dispatch installs), so the other cases run without it.

Results go to bench/results/dispatch.json (gitignored) and to --json PATH when given.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attn_dispatch import Phase  # noqa: E402
from attn_dispatch import _record  # noqa: E402
from attn_dispatch import _scope  # noqa: E402
from attn_dispatch import attention  # noqa: E402
from attn_dispatch import attn_scope  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch import resolve  # noqa: E402
from attn_dispatch._config import AttnConfig  # noqa: E402
from attn_dispatch.backend import BackendBase  # noqa: E402
from attn_dispatch.backend import Capabilities  # noqa: E402
from attn_dispatch.backend import register_backend  # noqa: E402

CAPS = Capabilities(kinds={"mha"}, devices={"cpu"}, variants={"window", "logit_cap"})
CONFIG = AttnConfig("mha", 8, 8, 64, dtype="float32")
SCALED_CONFIG = CONFIG.replace(sm_scale=0.125)
# A Gemma-2-style runner: sliding and full layers, both capped.
GROUPS = {
    "sliding": CONFIG.replace(window_left=4095, logit_cap=50.0),
    "full": CONFIG.replace(logit_cap=50.0),
}


def attention_before(
    q: Any, k_cache: Any, v_cache: Any = None, *, sm_scale: float | None = None, prefix: Any = None
) -> Any:
    """attention() as it was before variants and groups (the slow paths are not reached)."""
    frame = _scope._CURRENT.get()
    if frame is None:
        raise RuntimeError("no scope")
    run = frame.run
    if run is None:
        raise RuntimeError("no batch")
    scale = frame.sm_scale
    if scale is None:
        if sm_scale is None:
            raise RuntimeError("no scale")
        scale = sm_scale
    elif sm_scale is not None and sm_scale != scale:
        raise RuntimeError("scale differs")
    if _scope._call_hook is None and prefix is None:
        return run(q, k_cache, v_cache, frame.plan, scale)
    raise RuntimeError("slow path")


def _noop(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> None:
    return None


class NoopBackend(BackendBase):
    def __init__(self, config: AttnConfig, **options: Any) -> None:
        self.name = "bench_noop"

    def plan(self, batch: Any) -> None:
        return None

    def handler(self, phase: Phase) -> Any:
        return _noop


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    phase: Phase
    max_q_len: int = 1
    max_kv_len: int = 1000


@dataclasses.dataclass
class Case:
    name: str
    stmt: str
    env: dict[str, Any]
    setup: Callable[[], Any] | None = None  # enters this case's scopes (in its own Context)
    ctx: contextvars.Context = dataclasses.field(default_factory=contextvars.Context)
    recording: bool = False  # time it with the record_dispatch call hook installed
    number: int = 0
    samples: list[float] = dataclasses.field(default_factory=list)

    def timer(self) -> timeit.Timer:
        return timeit.Timer(self.stmt, globals=self.env)


def _table_binding() -> Any:
    """The bench runner bound from a dispatch table saved to disk and replayed (the way a
    server starts): the table is read once here, at bind, never per call."""
    import tempfile

    from attn_dispatch.dispatch_table import FORMAT
    from attn_dispatch.dispatch_table import VERSION
    from attn_dispatch.dispatch_table import DispatchTable
    from attn_dispatch.dispatch_table import current_environment
    from attn_dispatch.dispatch_table import spec_from_table

    choice = {"winner": "bench_noop", "winner_ms": 0.001, "runner_up": None,
              "runner_up_ms": None, "shape": {"batch": 1, "q_len": 1, "context": 1},
              "buckets": None, "measured": [], "choice": "bench_noop"}  # fmt: skip
    data = {
        "format": FORMAT,
        "version": VERSION,
        "environment": current_environment("cpu", ["bench_noop"]),
        "sizes": {"repeats": 1},
        "runners": {"bench": {"": {"config": CONFIG.to_dict(), "phases": {
            ph: choice for ph in ("prefill", "decode", "verify")}}}},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "table.json"
        DispatchTable.from_json(json.dumps(data)).save(path)
        spec = spec_from_table(path, label="bench")
    return bind(spec, CONFIG, label="bench")


def build_cases() -> list[Case]:
    register_backend("bench_noop", capabilities=CAPS, factory=NoopBackend, replace=True)
    binding = bind("bench_noop", CONFIG, label="bench")
    cases: list[Case] = []

    # The floor: one ContextVar.get and one tuple index, called like resolve is.
    floor_cv: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar("floor")
    frame = (_noop, _noop, _noop)

    def floor(phase: int) -> Any:
        return floor_cv.get()[phase]  # type: ignore[index]

    one = int(Phase.DECODE)  # a plain int: the floor indexes as cheaply as Python can

    def set_floor() -> None:
        floor_cv.set(frame)

    def noop_call(phase: int) -> Any:
        return phase

    p = Phase.DECODE
    cases.append(Case("noop_call", "f(p)", {"f": noop_call, "p": p}))
    cases.append(Case("floor", "f(p)", {"f": floor, "p": one}, set_floor))

    def enter(b: Any, batch: Any = None) -> Callable[[], None]:
        def go() -> None:
            attn_scope(b, batch).__enter__()

        return go

    cases.append(Case("resolve", "f(p)", {"f": resolve, "p": p}, enter(binding)))
    call_text = "f(None, None, None, sm_scale=1.0)"
    cases.append(
        Case(
            "attention",
            "f(None, None, None, sm_scale=1.0)",
            {"f": attention},
            enter(binding, Batch(Phase.DECODE)),
        )
    )
    cases.append(
        Case(
            "attention_before",
            "f(None, None, None, sm_scale=1.0)",
            {"f": attention_before},
            enter(binding, Batch(Phase.DECODE)),
        )
    )

    # A runner bound from a dispatch table (tune --save), read back through spec_from_table.
    cases.append(
        Case("attention_table", call_text, {"f": attention},
             enter(_table_binding(), Batch(Phase.DECODE)))
    )  # fmt: skip

    # Shape buckets: decode picks between two backends by context, once per forward.
    register_backend("bench_noop2", capabilities=CAPS, factory=NoopBackend, replace=True)
    bucketed = bind("prefill=bench_noop,decode=context<=512:bench_noop2|bench_noop", CONFIG)
    cases.append(
        Case("attention_buckets", call_text, {"f": attention},
             enter(bucketed, Batch(Phase.DECODE)))
    )  # fmt: skip
    cases.append(
        Case("scope_batch_buckets", "with S(b, x): pass",
             {"S": attn_scope, "b": bucketed, "x": Batch(Phase.DECODE)})
    )  # fmt: skip

    # Recording (attn_dispatch.testing records with tally=True): the recorder is open in the
    # case's own context; the hook goes on only while the case is timed (see run()).
    def recording(**kw: Any) -> Callable[[], None]:
        def setup() -> None:
            _record.record_dispatch(**kw).__enter__()
            attn_scope(binding, Batch(Phase.DECODE)).__enter__()

        return setup

    call = "f(None, None, None, sm_scale=1.0)"
    cases.append(Case("attention_rec_tally", call, {"f": attention}, recording(tally=True)))
    cases[-1].recording = True
    cases.append(Case("attention_rec_events", call, {"f": attention}, recording()))
    cases[-1].recording = True

    def opened_and_closed() -> None:
        with _record.record_dispatch(tally=True):
            pass
        attn_scope(binding, Batch(Phase.DECODE)).__enter__()

    cases.append(Case("attention_after_rec", call, {"f": attention}, opened_and_closed))
    grouped = bind("bench_noop", GROUPS, label="bench")
    cases.append(
        Case(
            "attention_group",
            "f(None, None, None, sm_scale=1.0, group='sliding')",
            {"f": attention},
            enter(grouped, Batch(Phase.DECODE)),
        )
    )
    group_batch = Batch(Phase.DECODE)
    cases.append(
        Case(
            "scope_groups",
            "with S(b, x): pass",
            {"S": attn_scope, "b": grouped, "x": group_batch},
        )
    )
    scaled = bind("bench_noop", SCALED_CONFIG, label="bench")
    cases.append(
        Case(
            "attention_cfg_scale",
            "f(None, None, None)",
            {"f": attention},
            enter(scaled, Batch(Phase.DECODE)),
        )
    )

    # SGLang before PR 28559: the forward reads the process-global server args.
    class ServerArgs:
        decode_attention_backend = "flashinfer"

    global_args = ServerArgs()

    def get_global_server_args() -> ServerArgs:
        return global_args

    backends = {"flashinfer": _noop, "triton": _noop, "fa3": _noop}

    def sglang_global() -> Any:
        return backends[get_global_server_args().decode_attention_backend]

    cases.append(Case("sglang_global", "f()", {"f": sglang_global}))

    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        class HFConfig:
            _attn_implementation = "sdpa"

        hf_config = HFConfig()

        def hf_interface() -> Any:
            return ALL_ATTENTION_FUNCTIONS[hf_config._attn_implementation]

        hf_interface()
        cases.append(Case("hf_interface", "f()", {"f": hf_interface}))
    except Exception as exc:  # not installed or API moved: skip, say so
        print(f"(skipping hf_interface: {type(exc).__name__}: {exc})")

    cases.append(Case("scope", "with s(b): pass", {"s": attn_scope, "b": binding}))
    cases.append(Case("scope_construct", "s(b)", {"s": attn_scope, "b": binding}))
    cases.append(Case("scope_reuse", "with sc: pass", {"sc": attn_scope(binding)}))
    cases.append(
        Case(
            "scope_batch",
            "with s(b, batch): pass",
            {"s": attn_scope, "b": binding, "batch": Batch(Phase.DECODE)},
        )
    )
    cv: contextvars.ContextVar[Any] = contextvars.ContextVar("bench")
    cases.append(Case("cv_set_reset", "cv.reset(cv.set(x))", {"cv": cv, "x": frame}))
    try:
        from torch.nn.attention import SDPBackend
        from torch.nn.attention import sdpa_kernel

        cases.append(
            Case("sdpa_kernel", "with k(m): pass", {"k": sdpa_kernel, "m": SDPBackend.MATH})
        )
    except Exception as exc:
        print(f"(skipping sdpa_kernel: {type(exc).__name__}: {exc})")

    # Growth: resolve must not depend on how many runners, backends or open scopes exist.
    many = [bind("bench_noop", CONFIG, label=f"r{i}") for i in range(10_000)]
    cases.append(Case("resolve_runners_1", "f(p)", {"f": resolve, "p": p}, enter(binding)))
    cases.append(Case("resolve_runners_10000", "f(p)", {"f": resolve, "p": p}, enter(many[-1])))
    for i in range(1000):
        register_backend(f"bench_b{i}", capabilities=CAPS, factory=NoopBackend, replace=True)
    last = bind("bench_b999", CONFIG)
    cases.append(Case("resolve_backends_1", "f(p)", {"f": resolve, "p": p}, enter(binding)))
    cases.append(Case("resolve_backends_1000", "f(p)", {"f": resolve, "p": p}, enter(last)))

    def nest(depth: int) -> Callable[[], None]:
        def go() -> None:
            for k in range(depth):
                attn_scope(many[k]).__enter__()

        return go

    cases.append(Case("resolve_depth_1", "f(p)", {"f": resolve, "p": p}, nest(1)))
    cases.append(Case("resolve_depth_100", "f(p)", {"f": resolve, "p": p}, nest(100)))
    return cases


def _timed(case: Case, timer: timeit.Timer, n: int) -> float:
    if not case.recording:
        return case.ctx.run(timer.timeit, n)
    _scope._set_call_hook(_record._recorded_call)
    try:
        return case.ctx.run(timer.timeit, n)
    finally:
        _scope._set_call_hook(None)


def calibrate(case: Case, target_s: float) -> None:
    timer = case.timer()
    n = 1
    while True:
        # The least of three runs: one burst of load must not shrink the loop count.
        t = min(_timed(case, timer, n) for _ in range(3))
        if t >= target_s / 4:
            case.number = max(1, int(n * target_s / t))
            return
        n *= 4


def run(repeats: int, target_ms: float) -> dict[str, Any]:
    cases = build_cases()
    for c in cases:
        if c.setup is not None:
            c.ctx.run(c.setup)
    # The recorders stay open in their cases' contexts; the hook they installed goes on only
    # while a recording case is timed.
    _scope._set_call_hook(None)
    for c in cases:
        calibrate(c, target_ms / 1e3)
    timers = {c.name: c.timer() for c in cases}
    for _ in range(repeats):
        for c in cases:  # interleaved: load bursts hit every case alike
            t = _timed(c, timers[c.name], c.number)
            c.samples.append(t / c.number * 1e9)
    ns = {c.name: statistics.median(c.samples) for c in cases}
    spread = {c.name: (min(c.samples), max(c.samples)) for c in cases}
    return {"ns": ns, "spread": spread, "numbers": {c.name: c.number for c in cases}}


TARGETS = [
    # (label, numerator, denominator or None (absolute ns), limit, comparison)
    ("resolve / floor", "resolve", "floor", 1.25, "<="),
    ("attention / floor", "attention", "floor", None, ""),
    ("attention_cfg_scale / floor", "attention_cfg_scale", "floor", None, ""),
    ("attention / before variants", "attention", "attention_before", 1.3, "<="),
    ("attention group / before", "attention_group", "attention_before", 1.3, "<="),
    ("attention group / no group", "attention_group", "attention", None, ""),
    ("scope_groups / scope_batch", "scope_groups", "scope_batch", None, ""),
    ("sglang_global / floor", "sglang_global", "floor", None, ""),
    ("hf_interface / floor", "hf_interface", "floor", None, ""),
    ("scope enter+exit (ns)", "scope", None, 600.0, "<="),
    ("scope / cv_set_reset", "scope", "cv_set_reset", 6.0, "<="),
    ("scope_construct / cv_set_reset", "scope_construct", "cv_set_reset", None, ""),
    ("scope_reuse / cv_set_reset", "scope_reuse", "cv_set_reset", None, ""),
    ("scope_batch / scope", "scope_batch", "scope", None, ""),
    ("sdpa_kernel / scope", "sdpa_kernel", "scope", 15.0, ">="),
    ("resolve 10000 / 1 runners", "resolve_runners_10000", "resolve_runners_1", 1.1, "<="),
    ("resolve 1000 / 1 backends", "resolve_backends_1000", "resolve_backends_1", 1.1, "<="),
    ("resolve depth 100 / 1", "resolve_depth_100", "resolve_depth_1", 1.1, "<="),
    ("attention after rec / none", "attention_after_rec", "attention", 1.1, "<="),
    ("attention table / written spec", "attention_table", "attention", 1.1, "<="),
    ("attention buckets / none", "attention_buckets", "attention", 1.1, "<="),
    ("scope_batch buckets / none", "scope_batch_buckets", "scope_batch", None, ""),
    ("rec events / rec tally", "attention_rec_events", "attention_rec_tally", None, ""),
]

# Differences in ns per call (numerator - denominator): what recording adds to a call.
DIFFS = [
    ("rec tally adds (ns/call)", "attention_rec_tally", "attention", 1000.0, "<="),
    ("rec events adds (ns/call)", "attention_rec_events", "attention", None, ""),
]


def _ratio(ns: dict[str, float], num: str, den: str | None) -> float:
    return ns[num] if den is None else ns[num] / ns[den]


def report(result: dict[str, Any]) -> list[dict[str, Any]]:
    ns = result["ns"]
    lows = {k: v[0] for k, v in result["spread"].items()}
    print(f"\n{'case':<24}{'median ns':>10}{'min':>10}{'max':>10}{'loops':>10}")
    for name, v in ns.items():
        lo, hi = result["spread"][name]
        print(f"{name:<24}{v:>10.1f}{lo:>10.1f}{hi:>10.1f}{result['numbers'][name]:>10}")
    rows = []
    # The target is judged on medians (as specified); ratios of minima are printed beside
    # them because on a loaded machine the minimum is the steadier estimate of the cost.
    print(f"\n{'ratio':<28}{'median':>10}{'min':>10}  {'target':<10}{'ok':>5}")
    for label, num, den, limit, cmp in TARGETS:
        if num not in ns or (den is not None and den not in ns):
            print(f"{label:<28}{'n/a':>10}")
            continue
        value = _ratio(ns, num, den)
        low = _ratio(lows, num, den)
        ok = None
        if limit is not None:
            ok = value <= limit if cmp == "<=" else value >= limit
        target = f"{cmp} {limit:g}" if limit is not None else ""
        mark = "" if ok is None else ("yes" if ok else "MISS")
        print(f"{label:<28}{value:>10.2f}{low:>10.2f}  {target:<10}{mark:>5}")
        rows.append({"ratio": label, "median": value, "of_minima": low, "target": target, "ok": ok})
    for label, num, den, limit, cmp in DIFFS:
        if num not in ns or den not in ns:
            continue
        value, low = ns[num] - ns[den], lows[num] - lows[den]
        ok = None if limit is None else value <= limit
        target = f"{cmp} {limit:g}" if limit is not None else ""
        mark = "" if ok is None else ("yes" if ok else "MISS")
        print(f"{label:<28}{value:>10.1f}{low:>10.1f}  {target:<10}{mark:>5}")
        rows.append({"ratio": label, "median": value, "of_minima": low, "target": target, "ok": ok})
    return rows


def machine() -> str:
    """The CPU model and its widest vector ISA (every case is single-threaded Python)."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "unknown CPU", "x86_64"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = next((i for i in ("amx_bf16", "avx512f", "avx2") if i in flags), "baseline")
    return f"{model}; ISA {isa}; 1 thread (pure Python); Python {sys.version.split()[0]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=31, help="interleaved repeats per case")
    ap.add_argument("--target-ms", type=float, default=5.0, help="time per repeat per case")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat, nothing written by default"
    )
    args = ap.parse_args(argv)
    if args.quick:  # checks the script runs; its figures must not replace the recorded ones
        args.repeats, args.target_ms = 1, 0.2
    t0 = time.perf_counter()
    print(machine())
    result = run(args.repeats, args.target_ms)
    rows = report(result)
    out = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": machine(),
        "repeats": args.repeats,
        "ns_per_call_median": result["ns"],
        "ns_per_call_min_max": result["spread"],
        "ratios": rows,
        "seconds": time.perf_counter() - t0,
    }
    default = ROOT / "bench" / "results" / "dispatch.json"
    for path in {*([] if args.quick else [default]), *([args.json] if args.json else [])}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
