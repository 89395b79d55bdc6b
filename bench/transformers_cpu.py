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
  ``x sdpa`` its ratio to sdpa's in the same run;
- ``prefill s``: one ``generate(max_new_tokens=1)`` (the prompt's forward), timed in the same
  rounds; ``decode tok/s``: the other ``batch * (new - 1)`` tokens / (generate - prefill);
- ``peak MiB``: resident memory added during one generate, in a fresh process per contender:
  the RSS (``/proc/self/statm``) sampled every millisecond by a thread, peak minus the RSS just
  before ``generate``. tracemalloc cannot be used: it sees Python's allocator only, not torch's
  C++ CPU allocations (tensors, caches). RSS counts what the process holds, freed-but-retained
  malloc arenas included, which is why each contender gets its own process;
- ``same tokens``: whether the contender's tokens equal sdpa's (else the first step where a
  row differs).

The native ISA path in use is printed (``NATIVE_ATTN_ISA`` pins one). Threads: torch's
default (``--threads`` sets it); native uses the same count.
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
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
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
    times: dict[str, list[float]] = {i: [] for i in args.impls}
    pre: dict[str, list[float]] = {i: [] for i in args.impls}
    tokens: dict[str, torch.Tensor] = {}
    small_ids, small_mask = prompts(args.batch, 16, False)
    for impl in args.impls:  # warm-up: imports, library loading, first plans
        with Contender(model, impl):
            generate(model, small_ids, small_mask, 2)
    for _ in range(args.rounds):
        for impl in args.impls:
            with Contender(model, impl):
                t0 = time.perf_counter()
                generate(model, ids, mask, 1)
                t1 = time.perf_counter()
                tokens[impl] = generate(model, ids, mask, args.new)
                t2 = time.perf_counter()
            pre[impl].append(t1 - t0)
            times[impl].append(t2 - t1)
    rows = []
    ref = statistics.median(times["sdpa"]) if "sdpa" in times else None
    for impl in args.impls:
        total = statistics.median(times[impl])
        prefill = statistics.median(pre[impl])
        n = args.batch * args.new
        peak = None if args.no_memory else measure_memory(impl, dtype, length, args)
        rows.append(
            {
                "dtype": dtype,
                "prompt": length,
                "impl": impl,
                "gen_tok_s": n / total,
                "x_sdpa": (ref / total) if ref else None,
                "prefill_s": prefill,
                "decode_tok_s": args.batch * (args.new - 1) / max(total - prefill, 1e-9),
                "peak_mib": None if peak is None else peak / 2**20,
                "same": first_difference(tokens[impl], tokens["sdpa"]) if "sdpa" in tokens else "-",
                "runs": times[impl],
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
        "prefill s",
        "decode tok/s",
        "peak MiB",
        "same tokens",
    )
    table = [
        (
            r["dtype"],
            str(r["prompt"]),
            r["impl"],
            f"{r['gen_tok_s']:.1f}",
            "-" if r["x_sdpa"] is None else f"{r['x_sdpa']:.2f}",
            f"{r['prefill_s']:.2f}",
            f"{r['decode_tok_s']:.1f}",
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
