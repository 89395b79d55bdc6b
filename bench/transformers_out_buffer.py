"""The transformers paged path with and without the output buffer (``attention(..., out=)``),
side by side in one process, on bench/transformers_cpu.py's model (Qwen3-style, 8 layers,
hidden 512, GQA 8/2 x 64, fp32, batch 4, ``use(model, spec)``, page 16).

    python bench/transformers_out_buffer.py [--prompt 256] [--new 48] [--padded]
                                            [--spec native] [--rounds 4] [--threads 1]
                                            [--blocks 60] [--per 100] [--quick]

"without" is the same code with the step's ``takes_out`` forced False (the backend then
allocates its result and the layer returns it, or scatters it into fresh zeros when some
new tokens are padding). Two measurements, each alternating the two modes:

- one layer call replayed in place: inside the first decode (and prefill) forward, the
  layer's ``_paged_attention`` is called ``--blocks`` x ``--per`` times per mode, in
  alternating blocks, timed with the thread's CPU clock (the calls only read the pages;
  ``--blocks 0`` skips this);
- whole ``generate`` runs (``--rounds`` per mode, alternating, after one untimed generate
  per mode), the process's CPU time, with every layer call's thread CPU time collected by
  phase; and whether the tokens match.

Name the CPU/ISA and the load (``uptime``) with every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

MODES = {"out=": True, "no out": False}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--spec", default="native")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--per", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="smoke run: a short prompt")
    a = parser.parse_args()
    if a.quick:
        a.prompt, a.new, a.rounds, a.blocks, a.per = 32, 3, 1, 2, 4
    # Imported here: importing this script needs neither transformers nor the bench model.
    import transformers_cpu as tc

    import attn_dispatch.integrations.transformers._attention as paged
    import attn_dispatch.integrations.transformers._use as use_module
    from attn_dispatch.integrations.transformers import use

    torch.set_num_threads(a.threads)
    model = tc.make_model(torch.float32)
    ids, mask = tc.prompts(4, a.prompt, a.padded)
    real_takes = use_module._takes_out
    real_paged: Any = paged._paged_attention
    mode = ["out="]
    replay: dict[str, dict[bool, list[float]]] = {}
    calls: dict[str, dict[str, list[int]]] = {m: {"prefill": [], "decode": []} for m in MODES}

    def timed(*args: Any) -> Any:
        query, view = args[1], args[5]
        phase = "decode" if query.shape[2] == 1 else "prefill"
        if phase not in replay:
            replay[phase] = {True: [], False: []}
            step, per = view.step, a.per if phase == "decode" else max(1, a.per // 20)
            saved = dict(step.takes_out)
            for i in range(a.blocks):
                for flag in (True, False) if i % 2 == 0 else (False, True):
                    step.takes_out = {g: flag for g in saved}
                    t = time.thread_time_ns()
                    for _ in range(per):
                        real_paged(*args[:7], dict(args[7]))
                    replay[phase][flag].append((time.thread_time_ns() - t) / per / 1e3)
            step.takes_out = saved
        t = time.thread_time_ns()
        result = real_paged(*args)
        calls[mode[0]][phase].append(time.thread_time_ns() - t)
        return result

    def never(*args: Any) -> dict[str, bool]:
        return dict.fromkeys(args[2], False)

    paged._paged_attention = timed  # type: ignore[assignment]
    bound = use(model, a.spec)
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, torch.Tensor] = {}
    # One generate per mode first: the replays run inside the first one, and both warm up.
    for m in MODES:
        use_module._takes_out = real_takes if MODES[m] else never  # type: ignore[assignment]
        tc.generate(model, ids, mask, a.new)
    calls = {m: {"prefill": [], "decode": []} for m in MODES}
    for r in range(a.rounds):
        for m in MODES if r % 2 == 0 else reversed(MODES):
            mode[0] = m
            use_module._takes_out = real_takes if MODES[m] else never  # type: ignore[assignment]
            t0 = time.process_time()
            tokens[m] = tc.generate(model, ids, mask, a.new)
            cpu[m].append(time.process_time() - t0)
    use_module._takes_out = real_takes
    paged._paged_attention = real_paged
    bound.remove()
    print(
        f"{a.spec}, prompt {a.prompt}{' padded' if a.padded else ''} + {a.new} new, batch 4, "
        f"fp32, {torch.get_num_threads()} thread(s); same tokens: "
        f"{torch.equal(tokens['out='], tokens['no out'])}"
    )
    for phase, by in replay.items() if a.blocks else ():
        o, n = statistics.median(by[True]), statistics.median(by[False])
        print(
            f"one {phase} layer call, replayed: out= {o:.1f} us, no out {n:.1f} us, "
            f"ratio {o / n:.3f} (medians of {len(by[True])} blocks, thread CPU time)"
        )
    for phase in ("prefill", "decode"):
        o = statistics.median(calls["out="][phase]) / 1e3
        n = statistics.median(calls["no out"][phase]) / 1e3
        print(
            f"{phase} layer calls in generate: out= {o:.1f} us, no out {n:.1f} us, "
            f"ratio {o / n:.3f} (medians of {len(calls['out='][phase])})"
        )
    o, n = statistics.median(cpu["out="]), statistics.median(cpu["no out"])
    print(f"generate CPU s: out= {o:.3f}, no out {n:.3f}, ratio {o / n:.3f} (medians)")


if __name__ == "__main__":
    main()
