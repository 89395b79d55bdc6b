"""transformers generate on the CPU: use(model, "native") vs transformers' own sdpa (no asserts).

    python bench/transformers_cpu.py [--prompts 256 2048] [--dtypes float32 bfloat16]
                                     [--new 48] [--batch 4] [--rounds 3] [--impls sdpa native]
                                     [--padded] [--no-memory] [--json PATH]

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
        max_position_embeddings=4096,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--impls", nargs="+", default=["sdpa", "native"])
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--memory-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
        f"threads {torch.get_num_threads()}; batch {args.batch}, {args.new} new tokens, "
        f"{'left-padded' if args.padded else 'unpadded'} prompts, {args.rounds} rounds"
    )
    results = []
    for dtype in args.dtypes:
        for length in args.prompts:
            results.extend(run_case(dtype, length, args))
            sys.stdout.flush()
    header = (
        "dtype",
        "prompt",
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
