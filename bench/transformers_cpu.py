"""transformers generate on the CPU: use(model, spec) vs transformers' own sdpa, per spec.

    python bench/transformers_cpu.py [--cases 256:48 2048:256] [--long]
                                     [--dtypes float32 bfloat16] [--batch 4] [--rounds 3]
                                     [--threads 2]
                                     [--impls sdpa native prefill=sdpa,decode=native]
                                     [--prompts 256 --new 48] [--padded] [--no-memory]
                                     [--json PATH] [--quick]

Issue 36's targets (fp32, batch 4, 2 threads, same tokens): ``prefill=sdpa,decode=native``
>= 1.05x transformers' sdpa at 256-token prompts with 48 new tokens and >= 1.3x at 2048 with
256; ``native`` alone never slower than sdpa. The last table prints those ratios (wall and
CPU time) with the target and the load average; ``--cases PROMPT:NEW`` sets the shapes
(``--prompts`` with one ``--new`` does too); ``--long`` adds the 4096-token row (``4096:256``).

The model is Qwen3-style and random-initialised (seed 0): 8 layers, hidden 512, GQA 8/2 x 64,
MLP 1536, vocabulary 32000. One model object serves every contender (same weights): sdpa is
transformers' default ``attn_implementation="sdpa"`` with its DynamicCache; ``native`` and
``torch`` are ``attn_dispatch.integrations.transformers.use(model, name)`` (its PagedCache,
page 16). Each round runs every contender once, alternating, on the same prompts (batch
``--batch``, greedy, exactly ``--new`` new tokens); the table gives medians over rounds:

- ``gen tok/s``: new tokens / wall time of the whole ``generate`` (prefill included), and
  ``x sdpa`` its ratio to sdpa's in the same run; ``gen tok/cpu-s`` and ``x sdpa (cpu)``: the
  same over the process's CPU time (``time.process_time``), which on a shared machine leaves
  out the time other processes held the cores (with one thread, CPU time is the work done);
- ``prefill cpu-s``: one ``generate(max_new_tokens=1)`` (the prompt's forward), timed in the
  same rounds; ``decode tok/cpu-s``: the other ``batch * (new - 1)`` tokens / (generate -
  prefill), CPU time;
- ``peak MiB``: resident memory added during one generate, in a fresh process per contender:
  the RSS (``/proc/self/statm``) sampled every millisecond by a thread, peak minus the RSS just
  before ``generate``. tracemalloc cannot be used: it sees Python's allocator only, not torch's
  C++ CPU allocations (tensors, caches). RSS counts what the process holds, freed-but-retained
  malloc memory included: each contender gets its own process, run with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc mmaps every block of 64 KiB or more and
  returns it at free, making RSS follow the live tensors (without it the figures swing by
  100 MiB from one run to the next with the allocation order);
- ``same tokens``: whether the contender's tokens equal sdpa's (else the first step where a
  row differs).

A second table times one layer's attention alone at the same shapes (native on the pages vs
SDPA on contiguous tensors, causal prefill and one-token decode, CPU time): with prefill most
of a generate's work at long prompts, it shows what bounds the ratios.

The native ISA path in use is printed (``NATIVE_ATTN_ISA`` pins one). Threads: torch's
default (``--threads`` sets it; one thread makes CPU time the work done); native uses the same
count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attn_dispatch._table import format_table

PAGE = os.sysconf("SC_PAGE_SIZE")


def make_model(dtype: torch.dtype) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,  # the --long row's 4096 + 256 (RoPE's default type)
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval().to(dtype)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch: int, length: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(1, 32000, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:  # row i loses i/8 of its prompt to left padding
        for i in range(batch):
            cut = length * i // 8
            ids[i, :cut] = 0
            mask[i, :cut] = 0
    return ids, mask


class Contender:
    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name, self.bound = model, name, None

    def __enter__(self) -> Contender:
        if self.name == "sdpa":
            self.model.set_attn_implementation("sdpa")
        else:
            from attn_dispatch.integrations.transformers import use

            self.bound = use(self.model, self.name, label=self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bound is not None:
            self.bound.remove()
            self.bound = None


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    return out[:, ids.shape[1] :]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_during(fn: Any) -> tuple[int, Any]:
    """(peak RSS added while fn runs, fn's result), sampled every millisecond."""
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], rss())
    return peak[0] - base, result


def memory_child(impl: str, dtype: str, length: int, args: argparse.Namespace) -> None:
    model = make_model(getattr(torch, dtype))
    ids, mask = prompts(args.batch, length, args.padded)
    small_ids, small_mask = prompts(args.batch, 16, False)
    with Contender(model, impl):
        generate(model, small_ids, small_mask, 2)  # imports, first-call set-up
        added, _ = peak_during(lambda: generate(model, ids, mask, args.new))
    print(json.dumps({"peak": added}))


def measure_memory(impl: str, dtype: str, length: int, args: argparse.Namespace) -> int | None:
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        impl,
        dtype,
        str(length),
        "--batch",
        str(args.batch),
        "--new",
        str(args.new),
        "--threads",
        str(torch.get_num_threads()),
    ] + (["--padded"] if args.padded else [])
    # glibc keeps freed heap memory (RSS stays up after a free) unless a block was mmapped:
    # with every block of 64 KiB or more mmapped, RSS follows the live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return int(json.loads(line)["peak"])
    print(out.stderr[-2000:], file=sys.stderr)
    return None


def first_difference(got: torch.Tensor, ref: torch.Tensor) -> str:
    if torch.equal(got, ref):
        return "yes"
    steps = (got != ref).any(dim=0).nonzero().flatten()
    return f"no (step {int(steps[0])})"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def run_case(dtype: str, length: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = make_model(getattr(torch, dtype))
    ids, mask = prompts(args.batch, length, args.padded)
    # Wall and CPU seconds (time.process_time: this process's threads) of each run. On a
    # shared machine the wall clock also counts the time other processes held the cores;
    # the CPU time does not, so both are reported.
    wall: dict[str, list[float]] = {i: [] for i in args.impls}
    cpu: dict[str, list[float]] = {i: [] for i in args.impls}
    pre_cpu: dict[str, list[float]] = {i: [] for i in args.impls}
    tokens: dict[str, torch.Tensor] = {}
    small_ids, small_mask = prompts(args.batch, 16, False)
    for impl in args.impls:  # warm-up: imports, library loading, first plans
        with Contender(model, impl):
            generate(model, small_ids, small_mask, 2)
    for _ in range(args.rounds):
        for impl in args.impls:
            with Contender(model, impl):
                c0 = time.process_time()
                generate(model, ids, mask, 1)
                c1, t1 = time.process_time(), time.perf_counter()
                tokens[impl] = generate(model, ids, mask, args.new)
                c2, t2 = time.process_time(), time.perf_counter()
            pre_cpu[impl].append(c1 - c0)
            cpu[impl].append(c2 - c1)
            wall[impl].append(t2 - t1)
    rows = []
    med = statistics.median
    for impl in args.impls:
        n = args.batch * args.new
        prefill = med(pre_cpu[impl])
        peak = None if args.no_memory else measure_memory(impl, dtype, length, args)
        rows.append(
            {
                "dtype": dtype,
                "prompt": length,
                "new": args.new,
                "impl": impl,
                "gen_tok_s": n / med(wall[impl]),
                "x_sdpa": med(wall["sdpa"]) / med(wall[impl]) if "sdpa" in wall else None,
                "gen_tok_cpu_s": n / med(cpu[impl]),
                "x_sdpa_cpu": med(cpu["sdpa"]) / med(cpu[impl]) if "sdpa" in cpu else None,
                "prefill_cpu_s": prefill,
                "decode_tok_cpu_s": args.batch
                * (args.new - 1)
                / max(med(cpu[impl]) - prefill, 1e-9),
                "peak_mib": None if peak is None else peak / 2**20,
                "same": first_difference(tokens[impl], tokens["sdpa"]) if "sdpa" in tokens else "-",
                "wall": wall[impl],
                "cpu": cpu[impl],
                "prefill_cpu": pre_cpu[impl],
            }
        )
    return rows


def attention_alone(dtype: str, length: int, args: argparse.Namespace) -> list[tuple[str, ...]]:
    """One layer's attention at the bench's shapes, CPU seconds per call (median of
    ``--rounds``, alternating): native on pages of 16 as the PagedCache holds them, torch's
    SDPA on the contiguous [B, H, S, D] tensors transformers' sdpa path hands it (causal
    prefill; decode of one token per row; GQA 8/2 without repeating K/V)."""
    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind

    dt = getattr(torch, dtype)
    b, h, hk, d, ps = args.batch, 8, 2, 64, 16
    cfg = AttnConfig(
        kind="mha", num_q_heads=h, num_kv_heads=hk, head_dim=d, dtype=dtype, page_size=ps
    )
    binding = bind("native", cfg)
    per_row = length // ps
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(b)]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(b * per_row, ps, hk, d, generator=gen).to(dt)
    v = torch.randn(b * per_row, ps, hk, d, generator=gen).to(dt)
    kd = k.view(b, length, hk, d).transpose(1, 2).contiguous()
    vd = v.view(b, length, hk, d).transpose(1, 2).contiguous()
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for phase, q_len in ((Phase.PREFILL, length), (Phase.DECODE, 1)):
        batch = AttnBatch.build(
            phase, q_lens=[q_len] * b, kv_lens=[length] * b, page_tables=tables, page_size=ps
        )
        q = torch.randn(b * q_len, h, d, generator=gen).to(dt)
        qd = q.view(b, q_len, h, d).transpose(1, 2)
        reps = 1 if phase is Phase.PREFILL else 20
        times: dict[str, list[float]] = {"native": [], "sdpa": []}
        for _ in range(args.rounds):
            with attn_scope(binding, batch):
                c0 = time.process_time()
                for _ in range(reps):
                    attention(q, k, v, sm_scale=d**-0.5)
                times["native"].append((time.process_time() - c0) / reps)
            c0 = time.process_time()
            for _ in range(reps):
                sdpa(qd, kd, vd, is_causal=q_len > 1, enable_gqa=True)
            times["sdpa"].append((time.process_time() - c0) / reps)
        native, ref = statistics.median(times["native"]), statistics.median(times["sdpa"])
        rows.append(
            (
                dtype,
                str(length),
                phase.name.lower(),
                f"{native * 1e3:.2f}",
                f"{ref * 1e3:.2f}",
                f"{ref / native:.2f}",
            )
        )
    return rows


#: Issue 36's targets: minimum ``x sdpa`` per (spec, prompt); native never slower than sdpa.
TARGETS = {("prefill=sdpa,decode=native", 256): 1.05, ("prefill=sdpa,decode=native", 2048): 1.3}


#: ``--long``: the 4096-token row (prompt:new).
LONG_CASE = "4096:256"


def target_row(r: dict[str, Any]) -> tuple[str, ...]:
    want = TARGETS.get((r["impl"], r["prompt"]), 1.0 if r["impl"] == "native" else None)
    x, xc = r["x_sdpa"], r["x_sdpa_cpu"]
    met = "-" if want is None or x is None else ("yes" if x >= want else "no")
    return (
        r["dtype"], f"{r['prompt']}:{r['new']}", r["impl"],
        "-" if x is None else f"{x:.2f}", "-" if xc is None else f"{xc:.2f}",
        "-" if want is None else f">= {want:.2f}", met,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["256:48", "2048:256"])
    parser.add_argument(
        "--long", action="store_true", help=f"add the long-context case {LONG_CASE} to --cases"
    )
    parser.add_argument("--prompts", type=int, nargs="+", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument(
        "--impls", nargs="+", default=["sdpa", "native", "prefill=sdpa,decode=native"]
    )
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--memory-child", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: one short prompt")
    args = parser.parse_args()
    if args.quick:  # checks the script runs; the figures are not comparable
        args.prompts, args.dtypes, args.new, args.batch, args.rounds = [16], ["float32"], 2, 1, 1
        args.no_memory, args.no_kernels = True, True
    if args.prompts is not None:
        cases = [(p, args.new) for p in args.prompts]
    else:
        cases = [(int(c.split(":")[0]), int(c.split(":")[1])) for c in args.cases]
        if args.long:
            prompt, new = LONG_CASE.split(":")
            cases.append((int(prompt), int(new)))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        impl, dtype, length = args.memory_child
        memory_child(impl, dtype, int(length), args)
        return
    from attn_dispatch.backends.native._lib import load

    lib = load()
    isa = lib if isinstance(lib, str) else lib.isa
    print(
        f"# {platform.processor() or platform.machine()}; native ISA path: {isa}; torch "
        f"{torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"threads {torch.get_num_threads()}; batch {args.batch}, "
        f"{'left-padded' if args.padded else 'unpadded'} prompts, {args.rounds} rounds; "
        f"load {loadavg()}",
        flush=True,
    )
    results = []
    for dtype in args.dtypes:
        for length, new in cases:
            results.extend(
                run_case(dtype, length, argparse.Namespace(**{**vars(args), "new": new}))
            )
            print(f"# done {dtype} {length}:{new}, load {loadavg()}", flush=True)
    header = (
        "dtype",
        "prompt",
        "new",
        "impl",
        "gen tok/s",
        "x sdpa",
        "gen tok/cpu-s",
        "x sdpa (cpu)",
        "prefill cpu-s",
        "decode tok/cpu-s",
        "peak MiB",
        "same tokens",
    )

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    table = [
        (
            r["dtype"],
            str(r["prompt"]),
            str(r["new"]),
            r["impl"],
            f"{r['gen_tok_s']:.1f}",
            ratio(r["x_sdpa"]),
            f"{r['gen_tok_cpu_s']:.1f}",
            ratio(r["x_sdpa_cpu"]),
            f"{r['prefill_cpu_s']:.2f}",
            f"{r['decode_tok_cpu_s']:.1f}",
            "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}",
            r["same"],
        )
        for r in results
    ]
    print(format_table(header, table))
    print(f"\n# targets (x sdpa = sdpa's time / this spec's, same run); load {loadavg()}")
    print(format_table(("dtype", "prompt:new", "impl", "x sdpa", "x sdpa (cpu)", "target", "met"),
                       [target_row(r) for r in results if r["impl"] != "sdpa"]))  # fmt: skip
    kernels = []
    if not args.no_kernels:
        for dtype in args.dtypes:
            for length, _new in cases:
                kernels.extend(attention_alone(dtype, length, args))
        print("\n# one layer's attention alone, CPU ms per call (what bounds the ratios above)")
        print(
            format_table(("dtype", "context", "phase", "native ms", "sdpa ms", "x sdpa"), kernels)
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "results": results, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
