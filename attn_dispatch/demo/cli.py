"""The demo's command line: options, start-up, the run (the report is in ``report``)."""

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
from attn_dispatch import InvalidSpecError
from attn_dispatch import record_dispatch
from attn_dispatch._table import format_table
from attn_dispatch.demo.compare import Layout
from attn_dispatch.demo.compare import layouts
from attn_dispatch.demo.compare import prefix_report
from attn_dispatch.demo.compare import race
from attn_dispatch.demo.engine import greedy_steps
from attn_dispatch.demo.engine import speculative_steps
from attn_dispatch.demo.factory import build
from attn_dispatch.demo.factory import choose_dtype
from attn_dispatch.demo.factory import describe
from attn_dispatch.demo.factory import prompts_for
from attn_dispatch.demo.factory import sizes
from attn_dispatch.demo.report import Bar
from attn_dispatch.demo.report import Say
from attn_dispatch.demo.report import isolation_line
from attn_dispatch.demo.report import leaks
from attn_dispatch.demo.report import prefix_equal
from attn_dispatch.demo.report import report
from attn_dispatch.demo.report import round_lines
from attn_dispatch.demo.values import DemoOptions
from attn_dispatch.demo.values import Stats

if TYPE_CHECKING:
    from attn_dispatch.demo.runner import Runner

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


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high)`` (no upper bound when ``high`` is None);
    anything else is a usage error naming the range."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value >= high):
            bounds = f">= {low}" if high is None else f"in [{low}, {_power(high)})"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value!r}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid ... value" message
    return parse


def _power(n: int) -> str:
    """``n`` as a power of two when it is a large one (``2**62`` reads better than 19 digits)."""
    return f"2**{n.bit_length() - 1}" if n > 2**20 and n & (n - 1) == 0 else str(n)


_OPTS = DemoOptions()
# The whole-number options: flag, lowest value, default, help (defaults None: per --size).
_COUNTS = (
    ("--max-new-tokens", 1, None, "tokens per request (default: per size, 128 for base)"),
    ("--batch", 1, _OPTS.batch, "requests (prompt lengths differ)"),
    ("--depth", 1, None, "draft tokens per branch (default: 4)"),
    ("--branch", 1, None, "branches at the draft tree's first level (default: 2)"),
    ("--page-size", 1, _OPTS.page_size, "target cache page size"),
    ("--num-pages", 1, None, "target cache pages (default: enough)"),
    ("--steps", 1, None, "stop after this many rounds"),
    ("--shared-prefix", 0, 0, "tokens of a system prompt all requests share (default 0: none)"),
)


def parser() -> argparse.ArgumentParser:
    all_sizes = sizes()
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
        choices=tuple(all_sizes),
        default="base",
        help="model sizes: "
        + "; ".join(f"{k}: {v.help}" for k, v in all_sizes.items())
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
    for flag, low, default, text in _COUNTS:
        p.add_argument(flag, type=_whole(low), default=default, help=text)
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
        type=_whole(1),
        default=1,
        help="torch CPU threads (default 1: on a busy machine more threads wait on each other)",
    )
    # torch seeds are 64-bit; the prompts use seed + 1.
    p.add_argument("--seed", type=_whole(0, 2**62), default=0, help="weights, prompts (default 0)")
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


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run the demo; 0 when the output equals the target's greedy decoding and each runner
    dispatched only to its own backends, 1 if not, 2 for a usage or setup error (one
    ``error:`` line on ``err``, stderr by default).

    >>> import io
    >>> main(["--size", "tiny"], out=io.StringIO())   # the report goes to ``out``
    0
    """
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    torch = import_torch()
    threads = torch.get_num_threads()
    # Restored on exit, since tests call main() in-process.
    torch.set_num_threads(args.threads)
    try:
        return _run(args, out)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=err)
        return 2
    finally:
        torch.set_num_threads(threads)


def _options(args: argparse.Namespace) -> DemoOptions:
    size = sizes()[args.size]
    return DemoOptions(
        max_new_tokens=args.max_new_tokens or size.max_new_tokens,
        batch=args.batch,
        depth=args.depth or size.depth,
        branch=args.branch or size.branch,
        page_size=args.page_size,
        num_pages=args.num_pages,
        seed=args.seed,
        steps=args.steps,
        size=args.size,
        shared_prefix=args.shared_prefix,
    )


def _device(torch: Any, text: str | None) -> str:
    """The device to run on: ``--device`` checked against this machine (default: cuda when
    available, else cpu). A name torch does not know, or a device this machine lacks, is an
    ``InvalidSpecError`` naming it."""
    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError, TypeError):
        raise InvalidSpecError(
            "--device", text, "not a device name; use 'cpu', 'cuda' or 'cuda:N' (N an index)"
        ) from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise InvalidSpecError("--device", text, "the demo runs on 'cpu' or 'cuda[:N]'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidSpecError(
            "--device", text, "CUDA is not available on this machine; use --device cpu"
        )
    if device.index is not None and device.index >= count:
        raise InvalidSpecError(
            "--device", text, f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}"
        )
    return str(device)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    def say(*parts: object) -> None:
        print(*parts, file=out, flush=True)

    opts = _options(args)
    device = _device(torch, args.device)
    tspec = BackendSpec.parse(args.target_spec) if args.target_spec else None
    dspec = BackendSpec.parse(args.draft_spec) if args.draft_spec else None
    shape = sizes()[opts.size].target
    if args.dtype == "auto":
        dtype, why = choose_dtype(
            opts.size,
            device,
            shape.hidden,
            shape.mlp,
            rows=opts.batch,
            verify_rows=opts.batch * (1 + opts.branch * opts.depth),
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
        target, draft = build(
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
        for line in describe(target, draft):
            say(line)
        say("\nbinding (phase -> backend)")
        rows = [(r.label, *(name for _, name in r.attn_binding.table())) for r in (target, draft)]
        say(format_table(("runner", "prefill", "decode", "verify"), rows))
        prompts = prompts_for(opts, shape.vocab)
        if legacy is not None:
            from attn_dispatch.demo.legacy import run_legacy

            return run_legacy(say, legacy, target, draft, prompts, opts)
        return _run_scoped(say, args, target, draft, prompts, opts, bar)


def _run_scoped(
    say: Say,
    args: argparse.Namespace,
    target: Runner,
    draft: Runner,
    prompts: list[list[int]],
    opts: DemoOptions,
    bar: Bar,
) -> int:
    import torch

    from attn_dispatch.demo.runner import Runner

    # The reference decoding runs on the same model, binding and spec with a cache of its own,
    # so it can take turns with the speculative one (compare.race).
    alone = Runner(
        "target", target.model, target.attn_binding, num_pages=target.num_pages, spec=target.spec
    )
    n = opts.shared_prefix
    found, why = layouts(target, alone) if n else ([Layout("greedy", alone, False, "-")], "")
    on_round = round_lines(say, opts) if args.progress == "rounds" else None
    stats = Stats()
    runs = {"spec": speculative_steps(target, draft, prompts, opts, stats, on_round)}
    for lay in found:
        runs[lay.name] = greedy_steps(lay.runner, prompts, opts.max_new_tokens, n, lay.private)
    bar.start("decoding")
    with torch.inference_mode(), record_dispatch() as rec:
        outs, seconds = race(runs, len(prompts) * opts.max_new_tokens, bar)
    bar.clear()
    outputs, reference = outs["spec"], outs["greedy"]
    say("\ndispatch (record_dispatch: runner x phase x backend -> calls; the target's decode")
    say("calls are the greedy references')")
    say(rec.summary())
    leaked = leaks((target, draft, *(lay.runner for lay in found)))
    say(isolation_line(leaked))
    report(say, target, alone, draft, prompts, outputs, stats, opts, seconds)
    complete = opts.steps is not None or all(len(o) == opts.max_new_tokens for o in outputs)
    same = complete and prefix_equal(outputs, reference)
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    if not same:
        for i, (o, r) in enumerate(zip(outputs, reference, strict=True)):
            if o != r[: len(o)]:
                say(f"  request {i}: speculative {o}\n  request {i}: greedy      {r}")
    if n:
        same = prefix_report(say, opts, found, why, outs, draft) and same
    return 0 if same and not leaked else 1
