"""The demo's command line: options, the run, the report."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import TextIO

from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch import record_dispatch
from attn_dispatch.demo import engine
from attn_dispatch.demo import factory as _build

if TYPE_CHECKING:
    from attn_dispatch.demo.legacy import LegacyGlobals
    from attn_dispatch.demo.runner import Runner

Say = Callable[..., None]

EPILOG = """\
examples:
  python -m attn_dispatch demo                                   # the default run
  python -m attn_dispatch demo --size tiny                       # seconds: tiny models
  python -m attn_dispatch demo --target-spec torch --draft-spec native
  TRITON_INTERPRET=1 python -m attn_dispatch demo --size tiny --target-spec triton
  python -m attn_dispatch demo --legacy-global                   # the old pattern's failure

exit status: 0 when the speculative output equals the target's own greedy decoding and each
runner dispatched only to its own backends, 1 if not, 2 for a usage or setup error.
"""


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns under a dashed rule (the library's own tables look the same)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def import_torch() -> Any:
    """``import torch`` without its warning about a missing numpy.

    torch warns at import when numpy is absent; the demo never converts to or from numpy, so a
    fresh environment with torch alone runs it cleanly. Any other warning still shows."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy")
        import torch
    return torch


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return value


def parser() -> argparse.ArgumentParser:
    sizes = _build.sizes()
    p = argparse.ArgumentParser(
        prog="python -m attn_dispatch demo",
        description=(
            "Speculative decoding in one process: a DeepSeek-style MLA target and a GQA draft, "
            "each runner with its own attention backends. Prints each runner's binding, which "
            "backend every call went to, the acceptance rate, the time per target and per "
            "draft forward and tokens/s with and without speculation, and checks the output "
            "token for token against the target's own greedy decoding."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size",
        choices=tuple(sizes),
        default="base",
        help="model sizes: "
        + "; ".join(f"{k}: {v.help}" for k, v in sizes.items())
        + " (default: base)",
    )
    p.add_argument(
        "--target-spec",
        help="BackendSpec of the target, e.g. 'native', 'torch', "
        "'prefill=torch,decode=native,verify=native' (default: the first that binds of "
        "native, torch on CPU; flashinfer, triton, torch on CUDA). 'triton' on CPU needs "
        "TRITON_INTERPRET=1 (slow: use --size tiny)",
    )
    p.add_argument(
        "--draft-spec",
        help="BackendSpec of the draft (default: a backend the target does not use, of "
        "torch, native on CPU; triton, flashinfer, torch on CUDA)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=None,
        help="tokens per request (default: per size, 128 for base)",
    )
    p.add_argument("--batch", type=_positive, default=2, help="requests (prompt lengths differ)")
    p.add_argument(
        "--depth", type=_positive, default=None, help="draft tokens per branch (default: 4)"
    )
    p.add_argument(
        "--branch",
        type=_positive,
        default=None,
        help="branches at the draft tree's first level (default: 2)",
    )
    p.add_argument("--page-size", type=_positive, default=4, help="target cache page size")
    p.add_argument(
        "--num-pages", type=_positive, default=None, help="target cache pages (default: enough)"
    )
    p.add_argument("--steps", type=_positive, default=None, help="stop after this many rounds")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and matmuls (default auto: the faster of float32 and bfloat16 matmuls, "
        "measured at start-up; float32 for --size tiny). With bfloat16 or float16 the "
        "target's attention and latent cache stay float32 so that its verify and decode "
        "forwards round alike and the tokens match exactly",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"),
        help="KV cache format (default auto: each runner's attention dtype). An FP8 format "
        "stores both runners' caches in FP8 with a scale per layer (a bound on the layer's "
        "|K| and |V| mapped onto the format's largest value) passed as attention(..., "
        "k_scale=, v_scale=); the default target backend is then the first that serves FP8 "
        "(native on a CPU); a --target-spec that cannot serve it is an error, never "
        "replaced. bfloat16/float32: the target's attention and latent cache "
        "dtype",
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="torch CPU threads (default 1: on a busy machine more threads wait on each other)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    p.add_argument(
        "--progress",
        choices=("auto", "bar", "rounds", "off"),
        default="auto",
        help="bar: a progress bar on stderr; rounds: a line per round on stdout; auto: the "
        "bar when stderr is a terminal and the run takes more than a second or two",
    )
    p.add_argument(
        "--legacy-global",
        action="store_true",
        help="use the OLD pattern (one global backend setting) and show what it does",
    )
    return p


class Bar:
    """A one-line progress bar on a stream, shown only after ``delay`` seconds."""

    def __init__(self, stream: TextIO, *, enabled: bool, delay: float = 1.5) -> None:
        self.stream = stream
        self.enabled = enabled
        self.delay = delay
        self.t0 = time.perf_counter()
        self.label = ""
        self.shown = False

    def start(self, label: str) -> None:
        self.label = label

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.t0
        if not self.enabled or elapsed < self.delay:
            return
        width = 30
        fill = width * done // max(total, 1)
        line = (
            f"\r{self.label:<12} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tokens "
            f"{elapsed:5.1f} s"
        )
        self.stream.write(line)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()
            self.shown = False


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the demo; 0 when the output equals the target's greedy decoding, else 1.

    >>> main(["--size", "tiny"])
    0
    """
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stdout if out is None else out
    torch = import_torch()
    threads = torch.get_num_threads()
    # Restored on exit, since tests call main() in-process.
    torch.set_num_threads(args.threads)
    try:
        return _run(args, out)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=out)
        return 2
    finally:
        torch.set_num_threads(threads)


def _options(args: argparse.Namespace) -> engine.DemoOptions:
    size = _build.sizes()[args.size]
    return engine.DemoOptions(
        max_new_tokens=args.max_new_tokens or size.max_new_tokens,
        batch=args.batch,
        depth=args.depth or size.depth,
        branch=args.branch or size.branch,
        page_size=args.page_size,
        num_pages=args.num_pages,
        seed=args.seed,
        steps=args.steps,
        size=args.size,
    )


def _run(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    def say(*parts: object) -> None:
        print(*parts, file=out, flush=True)

    opts = _options(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tspec = BackendSpec.parse(args.target_spec) if args.target_spec else None
    dspec = BackendSpec.parse(args.draft_spec) if args.draft_spec else None
    shape = _build.sizes()[opts.size].target
    if args.dtype == "auto":
        dtype, why = _build.choose_dtype(
            opts.size, device, shape.hidden, shape.mlp, rows=opts.batch
        )
    else:
        dtype, why = args.dtype, "--dtype"
    # Reduced-precision attention differs between the verify and decode kernels by a rounding
    # step, enough to flip a near-tie in the target's greedy choice: keep it fp32.
    attn_dtype = "float32" if dtype in ("bfloat16", "float16") and device == "cpu" else None
    kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    legacy = None
    if args.legacy_global:
        from attn_dispatch.demo.legacy import LegacyGlobals

        legacy = LegacyGlobals()
    bar = Bar(
        sys.stderr,
        enabled=args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty()),
    )
    t_start = time.perf_counter()
    with torch.inference_mode():
        target, draft = _build.build(
            opts,
            device=device,
            dtype=dtype,
            attn_dtype=attn_dtype,
            kv_dtype=kv_dtype,
            target_spec=tspec,
            draft_spec=dspec,
            legacy=legacy,
        )
        startup = time.perf_counter() - t_start
        mode = "LEGACY global setting" if legacy else "attn_scope per runner"
        say(
            f"attn_dispatch demo: speculative decoding, MLA target + MHA draft in one process "
            f"(dispatch: {mode})"
        )
        isa = torch.backends.cpu.get_cpu_capability() if device == "cpu" else device
        tcfg, dcfg = target.attn_binding.config, draft.attn_binding.config
        say(
            f"device {device} ({isa}), {torch.get_num_threads()} thread(s); dtype {dtype} ({why})"
            + f"; target attention {tcfg.dtype}, kv dtype target {tcfg.kv_dtype}, draft "
            + f"{dcfg.kv_dtype} ({'--kv-dtype' if kv_dtype else 'auto'})"
            + f"; start-up {startup:.1f} s"
        )
        say("\nrunners")
        for line in _build.describe(target, draft):
            say(line)
        say("\nbinding (phase -> backend)")
        rows = [(r.label, *(name for _, name in r.attn_binding.table())) for r in (target, draft)]
        say(format_table(("runner", "prefill", "decode", "verify"), rows))
        prompts = _build.prompts_for(opts, shape.vocab)
        if legacy is not None:
            return _run_legacy(say, legacy, target, draft, prompts, opts)
        return _run_scoped(say, args, target, draft, prompts, opts, bar)


def _run_scoped(
    say: Say,
    args: argparse.Namespace,
    target: Runner,
    draft: Runner,
    prompts: list[list[int]],
    opts: engine.DemoOptions,
    bar: Bar,
) -> int:
    import torch

    from attn_dispatch.demo.runner import Runner

    # The reference decoding runs on the same model and binding with a cache of its own, so
    # it can take turns with the speculative one (engine.race).
    alone = Runner("target", target.model, target.attn_binding, num_pages=target.num_pages)
    on_round = _round_lines(say, opts) if args.progress == "rounds" else None
    stats = engine.Stats()
    bar.start("decoding")
    with torch.inference_mode(), record_dispatch() as rec:
        reference, outputs, greedy_s, spec_s = engine.race(
            engine.greedy_steps(alone, prompts, opts.max_new_tokens),
            engine.speculative_steps(target, draft, prompts, opts, stats, on_round),
            len(prompts) * opts.max_new_tokens,
            bar,
        )
    bar.clear()
    say("\ndispatch (record_dispatch: runner x phase x backend -> calls; the target's decode")
    say("calls are the greedy reference's)")
    say(rec.summary())
    runners = {"target": target, "draft": draft}
    leaks = [
        (label, phase, name)
        for (label, phase, name) in rec.counts()
        if name != runners[str(label)].attn_binding.backend_name(Phase.parse(phase))
    ]
    say(
        "each runner dispatched only to its own backends: "
        + ("yes" if not leaks else f"NO: {leaks!r}")
    )
    _report(say, target, alone, draft, prompts, outputs, stats, opts, greedy_s, spec_s)
    complete = opts.steps is not None or all(len(o) == opts.max_new_tokens for o in outputs)
    same = complete and _prefix_equal(outputs, reference)
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    if not same:
        for i, (o, r) in enumerate(zip(outputs, reference, strict=True)):
            if o != r[: len(o)]:
                say(f"  request {i}: speculative {o}\n  request {i}: greedy      {r}")
    return 0 if same and not leaks else 1


def _round_lines(say: Say, opts: engine.DemoOptions) -> Callable[[int, list[int]], None]:
    def line(rounds: int, accepted: list[int]) -> None:
        say(f"round {rounds:4d}: accepted {accepted} of {opts.depth} per request")

    return line


def _prefix_equal(outputs: list[list[int]], reference: list[list[int]]) -> bool:
    return all(o == r[: len(o)] for o, r in zip(outputs, reference, strict=True))


def _tokens(seq: list[int], limit: int = 16) -> str:
    head = ", ".join(str(t) for t in seq[:limit])
    return f"[{head}, ...] ({len(seq)} tokens)" if len(seq) > limit else f"[{head}]"


def _report(
    say: Say,
    target: Runner,
    alone: Runner,
    draft: Runner,
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    stats: engine.Stats,
    opts: engine.DemoOptions,
    greedy_s: float,
    spec_s: float,
) -> None:
    total = sum(len(o) for o in outputs)
    say(
        f"\nrequests {len(prompts)} (prompt lengths {[len(p) for p in prompts]}), "
        f"generated {total} tokens"
    )
    for i, o in enumerate(outputs):
        say(f"  request {i}: {_tokens(o)}")
    say(
        f"rounds {stats.rounds}: tree of {opts.branch} x {opts.depth} draft tokens per request, "
        "one target VERIFY forward each"
    )
    per_forward = 1 + stats.accepted / max(1, stats.request_rounds)
    say(
        f"acceptance rate: {stats.acceptance:.0%} ({stats.accepted} of {stats.drafted} drafted "
        f"tokens on the best path; {per_forward:.2f} tokens per request per target forward)"
    )
    hits = ", ".join(f"#{b + 1}: {n}" for b, n in sorted(stats.branch_hits.items()))
    say(f"accepted paths by first-level branch: {hits or 'none'}")
    # Plain greedy needs one target forward per token (the prefill gives the first).
    greedy_forwards = max((len(o) for o in outputs), default=0)
    say(
        f"target forwards: {stats.target_forwards} speculative vs {greedy_forwards} greedy "
        f"for the same tokens; draft forwards: {stats.draft_forwards}"
    )
    say("\ntime per forward")
    rows = []
    for name, r in (("target", target), ("target, greedy", alone), ("draft", draft)):
        for phase in Phase:
            ms = r.mean_ms(phase)
            if ms is not None:
                n = str(r.timing[(phase, "forwards")])
                rows.append((name, phase.name.lower(), n, f"{ms:.2f}"))
    say(format_table(("runner", "phase", "forwards", "ms each"), rows))
    t_dec, d_dec = alone.mean_ms(Phase.DECODE), draft.mean_ms(Phase.DECODE)
    t_ver = target.mean_ms(Phase.VERIFY)
    if t_dec and d_dec and t_ver:
        say(
            f"a draft decode costs 1/{t_dec / d_dec:.0f} of a target decode; a target verify "
            f"of {opts.branch * opts.depth + 1} tokens per request costs {t_ver / t_dec:.2f} "
            "target decodes"
        )
    greedy_tokens = len(prompts) * opts.max_new_tokens
    spec_tps, greedy_tps = total / spec_s, greedy_tokens / greedy_s
    say(
        f"tokens/s: {spec_tps:.1f} speculative, {greedy_tps:.1f} target-only greedy (run side "
        f"by side, taking turns): speedup {spec_tps / greedy_tps:.2f}x"
    )


def _run_legacy(
    say: Say,
    legacy: LegacyGlobals,
    target: Runner,
    draft: Runner,
    prompts: list[list[int]],
    opts: engine.DemoOptions,
) -> int:
    say("\nlegacy pattern: one process-wide setting, written at start-up, read at forward time")
    for line in legacy.history:
        say(f"  {line}")
    failure = None
    outputs: list[list[int]] = []
    try:
        outputs, _ = engine.speculative(target, draft, prompts, opts)
    except Exception as exc:
        failure = exc
    say("\nwhat the layers actually ran (runner x phase x backend -> calls)")
    rows: list[tuple[str, ...]] = [(*k, str(v)) for k, v in sorted(legacy.log.items())]
    say(format_table(("runner", "phase", "backend", "result", "calls"), rows))
    tname = target.attn_binding.backend_name(Phase.PREFILL)
    dname = draft.attn_binding.backend_name(Phase.DECODE)
    wrong = sum(v for k, v in legacy.log.items() if k[0] == "target" and k[2] != tname)
    dc = draft.attn_binding.config
    built_for = (
        f"built for the draft's {dc.kind.upper()} config: {dc.num_q_heads} q / "
        f"{dc.num_kv_heads} kv heads, head_dim {dc.head_dim}, page_size {dc.page_size}"
    )
    if failure is not None:
        say(
            f"\nthe target's MLA layers read the global at forward time and got backend "
            f"{legacy.attention_backend!r} as the draft set it up ({built_for}); the target had "
            f"chosen {tname!r} for MLA (head_dim {target.attn_binding.config.head_dim}). "
            "Its first forward failed in the draft's backend:\n"
            f"  {type(failure).__name__}: {failure}"
        )
    elif wrong:
        say(
            f"\nthe target's MLA layers ran the draft's backend {dname!r} in {wrong} calls "
            f"(it chose {tname!r})"
        )
    # The reference (the target alone) is computed only when the legacy run got anywhere.
    same = False
    if failure is None and outputs:
        from attn_dispatch.demo.runner import Runner

        scoped = Runner("target", target.model, target.attn_binding, num_pages=target.num_pages)
        same = _prefix_equal(outputs, engine.target_greedy(scoped, prompts, opts.max_new_tokens))
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    say(
        "This is SGLang issue 28528 (draft start-up overwrote the global backend; the target's "
        "DeepSeek MLA layers then hit a head-dim assertion in the wrong kernel). Without "
        "--legacy-global each runner dispatches through its own binding in attn_scope."
    )
    return 0 if same else 1
