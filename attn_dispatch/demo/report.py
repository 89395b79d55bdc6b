"""The demo's report: progress, the isolation check, acceptance, times and speedup."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import TextIO

from attn_dispatch import Phase
from attn_dispatch._table import format_table

if TYPE_CHECKING:
    from attn_dispatch.demo.runner import Runner
    from attn_dispatch.demo.values import DemoOptions
    from attn_dispatch.demo.values import Stats

Say = Callable[..., None]


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


def round_lines(say: Say, opts: DemoOptions) -> Callable[[int, list[int]], None]:
    def line(rounds: int, accepted: list[int]) -> None:
        say(f"round {rounds:4d}: accepted {accepted} of {opts.depth} per request")

    return line


def prefix_equal(outputs: list[list[int]], reference: list[list[int]]) -> bool:
    return all(o == r[: len(o)] for o, r in zip(outputs, reference, strict=True))


def leaks(runners: Iterable[Runner]) -> list[str]:
    """Every dispatch that went outside its runner's own spec, in words (empty: none).

    Read from the ``record_dispatch`` events each runner recorded during its own forwards
    (``Runner.dispatched``), not from its binding: an event whose backend is not the one the
    runner's spec names for the event's phase, or that carries another runner's label, is a
    leak, whichever binding the layers actually reached."""
    found = []
    for runner in runners:
        counted = collections.Counter(runner.dispatched)
        for event, calls in sorted(counted.items(), key=lambda kv: repr(kv[0])):
            own = runner.spec.backend_for(event.phase)
            if event.backend != own or event.label != runner.label:
                found.append(
                    f"runner {runner.label!r} {event.phase.name.lower()}: {calls} calls to "
                    f"{event.backend!r} as {event.label!r} (its spec names {own!r})"
                )
    return found


def isolation_line(found: Sequence[str]) -> str:
    """The report's line for ``leaks(...)``."""
    head = "each runner dispatched only to its own backends: "
    return head + ("yes" if not found else "no\n" + "\n".join(f"  {f}" for f in found))


def _fraction(x: float) -> str:
    """``x`` as 1/N when it is below one half (a draft 30 times cheaper reads 1/30)."""
    return f"1/{1 / x:.0f}" if x < 0.5 else f"{x:.2f}x"


def tokens_text(seq: list[int], limit: int = 16) -> str:
    head = ", ".join(str(t) for t in seq[:limit])
    return f"[{head}, ...] ({len(seq)} tokens)" if len(seq) > limit else f"[{head}]"


def report(
    say: Say,
    target: Runner,
    alone: Runner,
    draft: Runner,
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    stats: Stats,
    opts: DemoOptions,
    seconds: dict[str, float],
) -> None:
    total = sum(len(o) for o in outputs)
    say(
        f"\nrequests {len(prompts)} (prompt lengths {[len(p) for p in prompts]}), "
        f"generated {total} tokens"
    )
    for i, o in enumerate(outputs):
        say(f"  request {i}: {tokens_text(o)}")
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
            ms = r.median_ms(phase)
            if ms is not None:
                n = str(len(r.samples[phase]))
                rows.append((name, phase.name.lower(), n, f"{ms:.2f}"))
    say(format_table(("runner", "phase", "forwards", "ms each (median)"), rows))
    t_dec, d_dec = alone.median_ms(Phase.DECODE), draft.median_ms(Phase.DECODE)
    t_ver = target.median_ms(Phase.VERIFY)
    if t_dec and d_dec and t_ver:
        say(
            f"a draft decode costs {_fraction(d_dec / t_dec)} of a target decode; a target verify "
            f"of {opts.branch * opts.depth + 1} tokens per request costs {t_ver / t_dec:.2f} "
            "target decodes"
        )
    greedy_tokens = len(prompts) * opts.max_new_tokens
    spec_tps, greedy_tps = total / seconds["spec"], greedy_tokens / seconds["greedy"]
    say(
        f"tokens/s: {spec_tps:.1f} speculative, {greedy_tps:.1f} target-only greedy (run side "
        f"by side, taking turns): speedup {spec_tps / greedy_tps:.2f}x"
    )
