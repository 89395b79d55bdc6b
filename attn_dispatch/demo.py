"""``python -m attn_dispatch demo``: speculative decoding with two runners in one process.

A DeepSeek-style MLA target and a GQA MHA draft, each with its own ``AttnConfig``,
``BackendSpec``, binding and paged KV cache. Each round the draft proposes a token tree
(top-``branch`` at the first level, chains after) in DECODE steps; the target checks the whole
tree in ONE VERIFY forward with a tree mask; accepted tokens are committed (their cache rows
moved into place) and the pages of rejected ones go back to the free list. The output is
checked against the target's own greedy decoding.

``--legacy-global`` runs the same with the old pattern: a process-wide setting written by
each runner at start-up and read by every layer at forward time (SGLang issue 28528).

    $ python -m attn_dispatch demo
    $ python -m attn_dispatch demo --target-spec torch --draft-spec native
    $ python -m attn_dispatch demo --legacy-global
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import TextIO

from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._phase import Phase
from attn_dispatch._record import record_dispatch
from attn_dispatch._registry import list_backends
from attn_dispatch._spec import BackendSpec
from attn_dispatch._table import format_table

# Preference order of default backends (the first that binds wins; the draft prefers one the
# target does not use, so the demo shows two runners on two backends).
CPU_TARGET = ("native", "torch")
CPU_DRAFT = ("torch", "native")
CUDA_TARGET = ("flashinfer", "triton", "torch")
CUDA_DRAFT = ("triton", "flashinfer", "torch")


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request of a forward: its page table, where its new tokens go, what they are."""

    pages: Sequence[int]
    start: int  # cache position of the first new token (= tokens already cached)
    tokens: Sequence[int]
    positions: Sequence[int]  # rope positions (a tree node's depth, not its cache slot)
    mask: Any = None  # bool [len(tokens), start + len(tokens)] for tree verify


@dataclasses.dataclass(slots=True)
class Stats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    max_accept: int = 0
    request_rounds: int = 0
    # Rounds whose accepted path went through branch k of the tree (only k > 0 needs a tree).
    branch_hits: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    max_new_tokens: int = 32
    batch: int = 2
    depth: int = 3
    branch: int = 2
    page_size: int = 4
    num_pages: int | None = None  # None: enough for every request at its longest
    seed: int = 0
    steps: int | None = None
    progress: bool = False
    size: str = "tiny"


def step(runner: Any, phase: Phase, reqs: Sequence[Request]) -> tuple[Any, list[int]]:
    """One forward of ``runner`` over ``reqs``: logits ``[T, V]`` and each request's first row."""
    from attn_dispatch._batch import AttnBatch

    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    firsts: list[int] = []
    for r in reqs:
        firsts.append(len(tokens))
        tokens.extend(r.tokens)
        positions.extend(r.positions)
        rows.extend(runner.rows(r.pages, range(r.start, r.start + len(r.tokens))))
    masks = [r.mask for r in reqs] if phase is Phase.VERIFY and reqs[0].mask is not None else None
    batch = AttnBatch.build(
        phase,
        q_lens=[len(r.tokens) for r in reqs],
        kv_lens=[r.start + len(r.tokens) for r in reqs],
        page_tables=[list(r.pages) for r in reqs],
        page_size=runner.page_size,
        num_pages=runner.num_pages,
        masks=masks,
        device=runner.device,
    )
    return runner.forward(batch, tokens, positions, rows), firsts


def target_greedy(target: Any, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """The target alone: one PREFILL, then one DECODE per token (the reference output)."""
    from attn_dispatch._demo_models import SeqKV
    from attn_dispatch._demo_models import greedy

    target.reset()
    seqs = [SeqKV() for _ in prompts]
    logits, firsts = _prefill(target, seqs, prompts)
    lasts = [f + len(p) - 1 for f, p in zip(firsts, prompts, strict=True)]
    outs = [[t] for t in greedy(logits[lasts])]
    for _ in range(max_new - 1):
        reqs = []
        for seq, out in zip(seqs, outs, strict=True):
            target.reserve(seq, seq.length + 1)
            reqs.append(Request(list(seq.pages), seq.length, [out[-1]], [seq.length]))
            seq.length += 1
        logits, _ = step(target, Phase.DECODE, reqs)
        for out, t in zip(outs, greedy(logits), strict=True):
            out.append(t)
    for seq in seqs:
        target.release(seq)
    return outs


def _prefill(
    runner: Any, seqs: list[Any], prompts: Sequence[Sequence[int]]
) -> tuple[Any, list[int]]:
    reqs = []
    for seq, p in zip(seqs, prompts, strict=True):
        runner.reserve(seq, len(p))
        reqs.append(Request(list(seq.pages), 0, list(p), list(range(len(p)))))
        seq.length = len(p)
    return step(runner, Phase.PREFILL, reqs)


def speculative(
    target: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    opts: DemoOptions,
    out: TextIO,
) -> tuple[list[list[int]], Stats]:
    """Draft a token tree per request, verify it in one target forward, commit, repeat."""
    from attn_dispatch._batch import tree_mask
    from attn_dispatch._demo_models import SeqKV
    from attn_dispatch._demo_models import greedy
    from attn_dispatch._demo_models import top_k

    if draft.page_size != 1:
        raise AttnDispatchError("the demo's draft forks branches per token: its page_size is 1")
    stats = Stats()
    t0 = time.perf_counter()
    target.reset()
    draft.reset()
    tf0, df0 = target.forwards, draft.forwards
    n = len(prompts)
    tseqs = [SeqKV() for _ in range(n)]
    dseqs = [SeqKV() for _ in range(n)]
    # Prefill both runners on the prompts; the target's last logits give the first token.
    logits, firsts = _prefill(target, tseqs, prompts)
    lasts = [f + len(p) - 1 for f, p in zip(firsts, prompts, strict=True)]
    gen = [[t] for t in greedy(logits[lasts])]
    _prefill(draft, dseqs, prompts)
    depth, branch = opts.depth, opts.branch
    active = [i for i in range(n) if len(gen[i]) < opts.max_new_tokens]
    while active and (opts.steps is None or stats.rounds < opts.steps):
        stats.rounds += 1
        full = {i: list(prompts[i]) + gen[i] for i in active}
        # 1. Draft: feed what it has not cached yet (the last committed token; two tokens after
        #    a fully accepted chain, as a short extend), take the top-`branch` next tokens.
        reqs = []
        for i in active:
            seq = dseqs[i]
            new = full[i][seq.length :]
            draft.reserve(seq, seq.length + len(new))
            reqs.append(
                Request(list(seq.pages), seq.length, new, list(range(seq.length, len(full[i]))))
            )
            seq.length += len(new)
        phase = Phase.DECODE if all(len(r.tokens) == 1 for r in reqs) else Phase.PREFILL
        logits, firsts = step(draft, phase, reqs)
        lasts = [f + len(r.tokens) - 1 for f, r in zip(firsts, reqs, strict=True)]
        heads = top_k(logits[lasts], branch)
        chains = {i: [[h] for h in hs] for i, hs in zip(active, heads, strict=True)}
        # Each branch gets its own pages (page_size 1: one per token) after the shared prefix.
        bpages: dict[int, list[list[int]]] = {i: [[] for _ in range(branch)] for i in active}
        # 2. Draft: extend every branch as a chain, all branches of all requests in one DECODE.
        for s in range(1, depth):
            reqs = []
            for i in active:
                seq = dseqs[i]
                for b in range(branch):
                    bpages[i][b].extend(draft.allocator.alloc(1))
                    pos = seq.length + s - 1
                    reqs.append(Request(seq.pages + bpages[i][b], pos, [chains[i][b][-1]], [pos]))
            logits, _ = step(draft, Phase.DECODE, reqs)
            nxt = iter(greedy(logits))
            for i in active:
                for b in range(branch):
                    chains[i][b].append(next(nxt))
        # 3. Target: verify root + tree in ONE forward with a tree mask.
        reqs = []
        trees = {}
        for i in active:
            seq = tseqs[i]
            nodes, parents, depths = [full[i][-1]], [-1], [0]
            for b in range(branch):
                for d, tok in enumerate(chains[i][b]):
                    parents.append(0 if d == 0 else len(nodes) - 1)
                    depths.append(d + 1)
                    nodes.append(tok)
            trees[i] = (nodes, parents)
            target.reserve(seq, seq.length + len(nodes))
            reqs.append(
                Request(
                    list(seq.pages),
                    seq.length,
                    nodes,
                    [seq.length + d for d in depths],
                    tree_mask(parents, prefix_len=seq.length),
                )
            )
        logits, firsts = step(target, Phase.VERIFY, reqs)
        choice = greedy(logits)
        # 4. Accept the longest path the target agrees with, plus its own next token.
        round_acc = []
        for i, first in zip(active, firsts, strict=True):
            nodes, parents = trees[i]
            path = [0]
            while True:
                want = choice[first + path[-1]]
                kids = [j for j in range(len(nodes)) if parents[j] == path[-1] and j > 0]
                hit = [j for j in kids if nodes[j] == want]
                if not hit:
                    bonus = want
                    break
                path.append(hit[0])
            accepted = path[1:]
            stats.drafted += depth
            stats.request_rounds += 1
            stats.accepted += len(accepted)
            stats.max_accept = max(stats.max_accept, len(accepted))
            round_acc.append(len(accepted))
            # Target cache: move the accepted nodes next to the root, free what is past them.
            tseq = tseqs[i]
            start = tseq.length
            src = [start + j for j in accepted]
            dst = [start + 1 + k for k in range(len(accepted))]
            moved = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
            if moved:
                target.copy_rows(
                    target.rows(tseq.pages, [s for s, _ in moved]),
                    target.rows(tseq.pages, [d for _, d in moved]),
                )
            target.truncate(tseq, start + 1 + len(accepted))
            # Draft cache: keep the accepted branch's fed tokens, free every other branch slot.
            b_acc = (accepted[0] - 1) // depth if accepted else -1
            if accepted:
                stats.branch_hits[b_acc] += 1
            for b in range(branch):
                keep = min(len(accepted), depth - 1) if b == b_acc else 0
                dseqs[i].pages.extend(bpages[i][b][:keep])
                draft.allocator.free(bpages[i][b][keep:])
            dseqs[i].length = len(dseqs[i].pages)
            gen[i].extend([nodes[j] for j in accepted] + [bonus])
            del gen[i][opts.max_new_tokens :]
        if opts.progress:
            done = sum(len(g) for g in gen)
            print(
                f"round {stats.rounds:4d}: accepted {round_acc} of {depth} per request, "
                f"{done}/{n * opts.max_new_tokens} tokens",
                file=out,
                flush=True,
            )
        for i in list(active):
            if len(gen[i]) >= opts.max_new_tokens:
                target.release(tseqs[i])
                draft.release(dseqs[i])
                active.remove(i)
    for i in active:
        target.release(tseqs[i])
        draft.release(dseqs[i])
    stats.seconds = time.perf_counter() - t0
    stats.target_forwards = target.forwards - tf0
    stats.draft_forwards = draft.forwards - df0
    return gen, stats


# ---------------------------------------------------------------------------------------------
# The legacy pattern, kept only to show what it does.


@dataclasses.dataclass(slots=True)
class LegacyGlobals:
    """The old way: ONE process-wide setting. Each runner writes its backend name (and
    registers the backend object it built) at start-up; every layer reads the name at forward
    time. Whoever started last wins for everybody."""

    attention_backend: str | None = None
    backends: dict[str, Any] = dataclasses.field(default_factory=dict)
    forward: tuple[str, Any] | None = None  # (runner label, batch) of the running forward
    log: collections.Counter[tuple[str, str, str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    history: list[str] = dataclasses.field(default_factory=list)

    def start_runner(self, label: str, binding: Binding) -> None:
        name = binding.backend_name(Phase.DECODE)
        self.history.append(
            f"{label} start-up: global attention_backend = {name!r}"
            + (f" (overwrites {self.attention_backend!r})" if self.attention_backend else "")
        )
        self.attention_backend = name
        self.backends[name] = binding.backend(Phase.DECODE)

    @contextlib.contextmanager
    def scope(self, runner: Any, batch: Any) -> Iterator[None]:
        self.forward = (runner.label, batch)
        try:
            yield
        finally:
            self.forward = None

    def attend(self, q: Any, k_cache: Any, v_cache: Any = None, *, sm_scale: float) -> Any:
        assert self.forward is not None and self.attention_backend is not None
        label, batch = self.forward
        name = self.attention_backend  # read at forward time: the last writer's choice
        key = (label, batch.phase.name.lower(), name)
        backend = self.backends[name]
        try:
            out = backend.handler(batch.phase)(q, k_cache, v_cache, backend.plan(batch), sm_scale)
        except Exception:
            self.log[(*key, "failed")] += 1
            raise
        self.log[(*key, "ran")] += 1
        return out


# ---------------------------------------------------------------------------------------------
# Building the runners


def _binds(name: str, config: AttnConfig) -> bool:
    """Whether ``name`` can serve every phase of ``config`` here (a real ``bind``: it also
    checks the MLA form policy, which capabilities alone do not)."""
    if name not in list_backends():
        return False
    try:
        bind(BackendSpec.uniform(name), config)
    except AttnDispatchError:
        return False
    return True


def default_specs(
    target_cfg: AttnConfig,
    draft_cfg: AttnConfig,
    target_spec: BackendSpec | None,
    draft_spec: BackendSpec | None,
) -> tuple[BackendSpec, BackendSpec]:
    """Fill in what the user did not give from what can run here (never override a choice)."""
    cuda = target_cfg.device_type == "cuda"
    if target_spec is None:
        order = CUDA_TARGET if cuda else CPU_TARGET
        name = next((n for n in order if _binds(n, target_cfg)), "torch")
        target_spec = BackendSpec.uniform(name)
    if draft_spec is None:
        order = CUDA_DRAFT if cuda else CPU_DRAFT
        used = set(target_spec.names)
        usable = [n for n in order if _binds(n, draft_cfg)]
        fresh = [n for n in usable if n not in used]
        draft_spec = BackendSpec.uniform((fresh or usable or ["torch"])[0])
    return target_spec, draft_spec


def build(
    opts: DemoOptions,
    *,
    device: str,
    dtype: str,
    target_spec: BackendSpec | None,
    draft_spec: BackendSpec | None,
    legacy: LegacyGlobals | None = None,
    target_shape: Any = None,
    draft_shape: Any = None,
) -> tuple[Any, Any]:
    """Seeded models and their runners (each with its own binding and cache)."""
    import torch

    from attn_dispatch._demo_models import DraftModel
    from attn_dispatch._demo_models import Runner
    from attn_dispatch._demo_models import Shared
    from attn_dispatch._demo_models import TargetModel

    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(opts.seed)
    if target_shape is None or draft_shape is None:
        tdefault, ddefault = _sizes()[opts.size]
        target_shape = tdefault if target_shape is None else target_shape
        draft_shape = ddefault if draft_shape is None else draft_shape
    tshape, dshape = target_shape, draft_shape
    shared = Shared(tshape.vocab, tshape.hidden, gen, tdtype)
    tmodel = TargetModel(tshape, shared, gen, tdtype)
    dmodel = DraftModel(dshape, shared, gen, tdtype)
    for m in (tmodel, dmodel, shared):
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                setattr(m, name, value.to(device))
        for layer in getattr(m, "layers", []):
            for k, v in layer.items():
                layer[k] = v.to(device)
    tcfg = tmodel.attn_config(page_size=opts.page_size, device=device)
    dcfg = dmodel.attn_config(page_size=1, device=device)
    tspec, dspec = default_specs(tcfg, dcfg, target_spec, draft_spec)
    pages = opts.num_pages or _pages_needed(opts)
    tbind = bind(tspec, tcfg, label="target")
    target = Runner("target", tmodel, tbind, num_pages=pages)
    dbind = bind(dspec, dcfg, label="draft")
    draft = Runner("draft", dmodel, dbind, num_pages=pages * opts.page_size)
    if legacy is not None:
        # Start-up order as in a server: the target first, then its draft.
        for runner in (target, draft):
            legacy.start_runner(runner.label, runner.attn_binding)
            runner.attend = legacy.attend
            runner.scope = legacy.scope
    return target, draft


def _pages_needed(opts: DemoOptions) -> int:
    """Target pages for every request at its longest: prompt, output and one draft tree."""
    longest = max(_prompt_lengths(opts)) + opts.max_new_tokens + 1 + opts.branch * opts.depth
    return opts.batch * -(-longest // opts.page_size) + 1


def _prompt_lengths(opts: DemoOptions) -> list[int]:
    return [5 + 4 * i for i in range(opts.batch)]  # different lengths: ragged page tables


def _sizes() -> dict[str, tuple[Any, Any]]:
    from attn_dispatch._demo_models import DraftShape
    from attn_dispatch._demo_models import TargetShape

    return {
        # Seconds on two CPU cores.
        "tiny": (TargetShape(), DraftShape()),
        # DeepSeek-V3's attention widths (q/k 576 = latent 512 + rope 64, v 512; draft head
        # 128): the sizes GPU kernels such as FlashInfer's MLA path are built for.
        "wide": (
            TargetShape(
                vocab=256,
                hidden=256,
                heads=8,
                qk_nope=128,
                qk_rope=64,
                kv_lora_rank=512,
                v_head=128,
                mlp=512,
            ),
            DraftShape(hidden=256, heads=4, kv_heads=2, head_dim=128, mlp=512),
        ),
    }


def prompts_for(opts: DemoOptions, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(opts.seed + 1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in _prompt_lengths(opts)]


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attn_dispatch demo",
        description=(
            "Speculative decoding in one process: a DeepSeek-style MLA target and a GQA draft, "
            "each runner with its own attention backends."
        ),
    )
    p.add_argument("--target-spec", help="BackendSpec of the target, e.g. 'torch'")
    p.add_argument("--draft-spec", help="BackendSpec of the draft, e.g. 'native'")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--steps", type=int, default=None, help="stop after this many rounds")
    p.add_argument("--batch", type=int, default=2, help="requests (prompt lengths differ)")
    p.add_argument("--depth", type=int, default=3, help="draft tokens per branch")
    p.add_argument("--branch", type=int, default=2, help="branches at the tree's first level")
    p.add_argument("--page-size", type=int, default=4, help="target cache page size")
    p.add_argument(
        "--num-pages", type=int, default=None, help="target cache pages (default: enough)"
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--size",
        choices=("tiny", "wide"),
        default="tiny",
        help="model widths: tiny (default) or wide (DeepSeek-V3 attention widths 576/512)",
    )
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a line per round (auto: on for more than 64 tokens)",
    )
    p.add_argument(
        "--legacy-global",
        action="store_true",
        help="use the OLD pattern (one global backend setting) and show what it does",
    )
    return p


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the demo; 0 when the output equals the target's greedy decoding, else 1."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stdout if out is None else out
    try:
        return _run(args, out)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=out)
        return 2


def _say(out: TextIO) -> Callable[..., None]:
    def say(*parts: object) -> None:
        print(*parts, file=out, flush=True)

    return say


def _run(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    say = _say(out)
    for flag in ("max_new_tokens", "batch", "depth", "branch", "page_size", "num_pages"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            say(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)!r}")
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    progress = {"on": True, "off": False}.get(args.progress, args.max_new_tokens > 64)
    opts = DemoOptions(
        max_new_tokens=args.max_new_tokens,
        batch=args.batch,
        depth=args.depth,
        branch=args.branch,
        page_size=args.page_size,
        num_pages=args.num_pages,
        seed=args.seed,
        steps=args.steps,
        progress=progress,
        size=args.size,
    )
    tspec = BackendSpec.parse(args.target_spec) if args.target_spec else None
    dspec = BackendSpec.parse(args.draft_spec) if args.draft_spec else None
    legacy = LegacyGlobals() if args.legacy_global else None
    # Tiny matrices: one thread is fastest (thread hand-offs cost more than the math, badly so
    # on a busy machine). Restored on exit, since tests call main() in-process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_models(args, out, opts, device, tspec, dspec, legacy)
    finally:
        torch.set_num_threads(threads)


def _run_models(
    args: argparse.Namespace,
    out: TextIO,
    opts: DemoOptions,
    device: str,
    tspec: BackendSpec | None,
    dspec: BackendSpec | None,
    legacy: LegacyGlobals | None,
) -> int:
    import torch

    say = _say(out)
    with torch.inference_mode():
        target, draft = build(
            opts, device=device, dtype=args.dtype, target_spec=tspec, draft_spec=dspec
        )
        if legacy is not None:
            legacy_target, legacy_draft = build(
                opts,
                device=device,
                dtype=args.dtype,
                target_spec=target.attn_binding.spec,
                draft_spec=draft.attn_binding.spec,
                legacy=legacy,
            )
        mode = "LEGACY global setting" if legacy else "attn_scope per runner"
        say(
            f"attn_dispatch demo: speculative decoding, MLA target + MHA draft in one process "
            f"({device}, {args.dtype}; dispatch: {mode})"
        )
        _describe(say, target, draft)
        prompts = prompts_for(opts, target.model.shape.vocab)
        t0 = time.perf_counter()
        reference = target_greedy(target, prompts, opts.max_new_tokens)
        greedy_s = time.perf_counter() - t0
        if legacy is not None:
            return _run_legacy(
                say, legacy, legacy_target, legacy_draft, prompts, opts, out, ref=reference
            )
        with record_dispatch() as rec:
            outputs, stats = speculative(target, draft, prompts, opts, out)
    say("\ndispatch (record_dispatch: runner x phase x backend -> calls)")
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
    _report(say, prompts, outputs, stats, greedy_s, opts)
    complete = opts.steps is not None or all(len(o) == opts.max_new_tokens for o in outputs)
    same = complete and _prefix_equal(outputs, reference)
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    if not same:
        for i, (o, r) in enumerate(zip(outputs, reference, strict=True)):
            if o != r[: len(o)]:
                say(f"  request {i}: speculative {o}\n  request {i}: greedy      {r}")
    return 0 if same and not leaks else 1


def _prefix_equal(outputs: list[list[int]], reference: list[list[int]]) -> bool:
    return all(o == r[: len(o)] for o, r in zip(outputs, reference, strict=True))


def _describe(say: Callable[..., None], target: Any, draft: Any) -> None:
    ts, ds = target.model.shape, draft.model.shape
    tc, dc = target.attn_binding.config, draft.attn_binding.config
    say("\nrunners")
    say(
        f"  target  DeepSeek-style MLA: {ts.layers} layers, {ts.heads} heads, "
        f"q/k {tc.head_dim} = latent {ts.kv_lora_rank} + rope {ts.qk_rope}, v {tc.v_head_dim}, "
        f"paged latent cache [pages, {tc.page_size}, {tc.head_dim}]; decompressed form "
        f"{tc.mha_head_dim}/{tc.mha_v_head_dim} when the backend's form policy picks it"
    )
    say(
        f"  draft   GQA MHA: {ds.layers} layer{'s' if ds.layers > 1 else ''}, "
        f"{ds.heads} q / {ds.kv_heads} kv heads, "
        f"head {dc.head_dim}, paged K/V [pages, {dc.page_size}, {ds.kv_heads}, {ds.head_dim}]"
    )
    say("\nbinding (phase -> backend)")
    rows = []
    for r in (target, draft):
        rows.append((r.label, *(name for _, name in r.attn_binding.table())))
    say(format_table(("runner", "prefill", "decode", "verify"), rows))


def _report(
    say: Callable[..., None],
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    stats: Stats,
    greedy_s: float,
    opts: DemoOptions,
) -> None:
    total = sum(len(o) for o in outputs)
    say(
        f"\nrequests {len(prompts)} (prompt lengths {[len(p) for p in prompts]}), "
        f"generated {total} tokens"
    )
    for i, o in enumerate(outputs):
        say(f"  request {i}: {o}")
    rate = stats.accepted / stats.drafted if stats.drafted else 0.0
    say(
        f"rounds {stats.rounds}: tree of {opts.branch} x {opts.depth} draft tokens per request, "
        f"one target VERIFY forward each"
    )
    say(
        f"acceptance rate: {rate:.0%} ({stats.accepted} of {stats.drafted} drafted tokens on "
        f"the best path; {1 + stats.accepted / max(1, stats.request_rounds):.2f} "
        f"tokens per request per target forward)"
    )
    hits = ", ".join(f"#{b + 1}: {n}" for b, n in sorted(stats.branch_hits.items()))
    say(f"accepted paths by first-level branch: {hits or 'none'}")
    # Plain greedy needs one target forward per token (the prefill gives the first).
    greedy_forwards = max((len(o) for o in outputs), default=0)
    say(
        f"target forwards: {stats.target_forwards} speculative vs {greedy_forwards} greedy "
        f"for the same tokens; draft forwards: {stats.draft_forwards}"
    )
    greedy_tokens = len(prompts) * opts.max_new_tokens
    say(
        f"tokens/s: {total / stats.seconds:.0f} speculative, {greedy_tokens / greedy_s:.0f} "
        "target-only greedy (small models: per-forward overhead dominates, the saving is in "
        "target forwards)"
    )


def _run_legacy(
    say: Callable[..., None],
    legacy: LegacyGlobals,
    target: Any,
    draft: Any,
    prompts: list[list[int]],
    opts: DemoOptions,
    out: TextIO,
    *,
    ref: list[list[int]],
) -> int:
    say("\nlegacy pattern: one process-wide setting, written at start-up, read at forward time")
    for line in legacy.history:
        say(f"  {line}")
    failure = None
    outputs: list[list[int]] = []
    try:
        outputs, _ = speculative(target, draft, prompts, opts, out)
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
    same = failure is None and _prefix_equal(outputs, ref) and bool(outputs)
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    say(
        "This is SGLang issue 28528 (draft start-up overwrote the global backend; the target's "
        "DeepSeek MLA layers then hit a head-dim assertion in the wrong kernel). Without "
        "--legacy-global each runner dispatches through its own binding in attn_scope."
    )
    return 0 if same else 1
