"""Decodings measured side by side, and what a shared system prompt saves.

``race`` runs several decodings taking turns, each step timed on its own. With
``--shared-prefix N`` every request starts with the same N-token system prompt and the target's
greedy reference runs in up to three layouts of the same prompts: the prompt's whole pages
shared by every page table (the cascade decode the native backend plans, as bound), shared
with ``cascade=False``, and private copies of those pages in each request's table.
``prefix_report`` prints the pages and bytes sharing saved, the decode times side by side and
whether every layout made the same tokens.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import TYPE_CHECKING

from attn_dispatch import Binding
from attn_dispatch import Phase
from attn_dispatch import bind
from attn_dispatch._table import format_table

if TYPE_CHECKING:
    from attn_dispatch.demo.report import Say
    from attn_dispatch.demo.runner import Runner
    from attn_dispatch.demo.values import DemoOptions

# A progress callback: tokens done, tokens in all.
Progress = Callable[[int, int], None]
Steps = Iterator[list[list[int]]]


def race(
    runs: Mapping[str, Steps], total: int, progress: Progress | None = None
) -> tuple[dict[str, list[list[int]]], dict[str, float]]:
    """Run decodings side by side, each step timed on its own: the one behind in tokens takes
    the next step (ties: the first named), so a burst of other load on the machine lands on
    all alike. ``total``: the tokens each makes. Returns each one's output and seconds.

    >>> from attn_dispatch.demo.engine import greedy_steps, speculative_steps
    >>> from attn_dispatch.demo.factory import build, prompts_for, sizes
    >>> from attn_dispatch.demo.values import DemoOptions, Stats
    >>> opts = DemoOptions(max_new_tokens=8)
    >>> target, draft = build(opts, device="cpu", dtype="float32", target_spec=None,
    ...                       draft_spec=None)
    >>> prompts = prompts_for(opts, sizes()[opts.size].target.vocab)
    >>> outs, seconds = race({"spec": speculative_steps(target, draft, prompts, opts, Stats()),
    ...                       "greedy": greedy_steps(target, prompts, 8)}, 8)
    >>> outs["spec"] == outs["greedy"]
    True
    """
    its = dict(runs)
    outs: dict[str, list[list[int]]] = {name: [] for name in runs}
    seconds = dict.fromkeys(runs, 0.0)
    done = dict.fromkeys(runs, 0)
    while its:
        who = min(its, key=lambda k: done[k])
        t0 = time.perf_counter()
        try:
            outs[who] = next(its[who])
        except StopIteration:
            del its[who]
        seconds[who] += time.perf_counter() - t0
        done[who] = sum(len(o) for o in outs[who])
        if progress is not None:
            progress(sum(done.values()), len(runs) * total)
    return outs, seconds


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """One greedy reference of the shared-prefix comparison."""

    name: str  # the race's name for it
    runner: Runner
    private: bool  # the prefix copied into each request's own pages (nothing shared)
    cascade: str  # "as bound" (the backend's default), "off", or "-" (nothing shared)


def layouts(target: Runner, alone: Runner) -> tuple[list[Layout], str]:
    """The layouts to compare (``alone``, the greedy reference, is the shared one as bound)
    and, when cascade off cannot be among them, why."""
    from attn_dispatch.demo.runner import Runner

    off, why = cascade_off(target)
    found = [Layout("greedy", alone, False, "as bound")]
    if off is not None:
        runner = Runner("target", target.model, off, num_pages=target.num_pages, spec=target.spec)
        found.append(Layout("greedy, cascade=False", runner, False, "off"))
    runner = Runner(
        "target", target.model, target.attn_binding, num_pages=target.num_pages, spec=target.spec
    )
    found.append(Layout("greedy, private prefix", runner, True, "-"))
    return found, why


def cascade_off(target: Runner) -> tuple[Binding | None, str]:
    """The target's binding with the native backend's cascade decode turned off, or None and
    the reason there is none."""
    name = target.spec.backend_for(Phase.DECODE)
    if name != "native":
        return None, f"the target decodes on {name!r}; cascade decode is the native backend's"
    from attn_dispatch.backends.native.backend import NativeBackend

    if "cascade" not in inspect.signature(NativeBackend).parameters:
        return None, "this native backend has no cascade option yet (NativeBackend(cascade=))"
    config = target.attn_binding.config
    options = {"native": {"cascade": False}}
    return bind(target.spec, config, label="target", options=options), ""


def isa_of(runner: Runner) -> str:
    """The instruction-set path the runner's decode kernels take."""
    import torch

    name = runner.spec.backend_for(Phase.DECODE)
    if runner.device != "cpu":
        return f"{name} on {runner.device}"
    if name == "native":
        from attn_dispatch.backends.native._lib import load

        lib = load()
        if not isinstance(lib, str):
            return f"native {lib.isa}"
    return f"{name} on {torch.backends.cpu.get_cpu_capability()}"


def page_bytes(runner: Runner) -> int:
    """Bytes one page holds across all the runner's layers (K and V caches)."""
    caches = [c for pair in runner.caches for c in pair if c is not None]
    return sum(c.nbytes for c in caches) // runner.num_pages


def prefix_report(
    say: Say,
    opts: DemoOptions,
    found: list[Layout],
    why: str,
    outs: Mapping[str, list[list[int]]],
    draft: Runner,
) -> bool:
    """Print what sharing saved and the decode times side by side; whether every layout made
    the same tokens."""
    n, b = opts.shared_prefix, opts.batch
    shared, private = found[0].runner, found[-1].runner
    ps = shared.page_size
    saved = private.allocator.peak - shared.allocator.peak
    say(f"\nshared prefix: every request starts with the same {n}-token system prompt")
    say(
        f"  target: its {n // ps} whole pages of {ps} tokens are the same page ids in all {b} "
        f"page tables, written once: {saved} pages ({_size(saved * page_bytes(shared))}) "
        f"saved (peak {shared.allocator.peak} pages in use, {private.allocator.peak} with "
        "private copies)"
    )
    dsaved = (b - 1) * (n // draft.page_size)
    say(
        f"  draft: {n // draft.page_size} pages of {draft.page_size} token shared the same way: "
        f"{dsaved} pages ({_size(dsaved * page_bytes(draft))}) saved"
    )
    rows = []
    for lay in found:
        r = lay.runner
        ms, attn = r.median_ms(Phase.DECODE), r.median_ms(Phase.DECODE, attention=True)
        layout = "private copies" if lay.private else "shared pages"
        count = str(len(r.samples[Phase.DECODE]))
        rows.append((layout, lay.cascade, count, _ms(ms), _ms(attn)))
    isa = isa_of(shared)
    say(f"\ntarget decode, same prompts, run side by side taking turns ({isa}; ms: medians)")
    say(format_table(("layout", "cascade", "forwards", "ms each", "attention ms each"), rows))
    if n < ps:
        say(f"no ratio: the system prompt fills no whole page of {ps} tokens (nothing shared)")
    else:
        if why:
            say(f"cascade on/off not measured: {why}")
        for other in found[1:]:
            say(_ratio(found[0], other))
    same = all(outs[lay.name] == outs[found[0].name] for lay in found)
    say(f"tokens identical with and without sharing: {'yes' if same else 'no'}")
    return same


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(base: Layout, other: Layout) -> str:
    """How much faster the shared layout as bound decoded than ``other`` (time ratio)."""
    parts = []
    for what, attention in (("attention", True), ("whole forward", False)):
        a = base.runner.median_ms(Phase.DECODE, attention=attention)
        o = other.runner.median_ms(Phase.DECODE, attention=attention)
        if a and o:
            parts.append(f"{what} {o / a:.2f}x")
    versus = "private copies" if other.private else "shared pages with cascade=False"
    return f"shared pages as bound vs {versus}: " + (", ".join(parts) or "not measured")
