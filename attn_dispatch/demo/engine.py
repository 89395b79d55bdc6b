"""Speculative decoding with two runners: each round is propose, verify, accept, free pages.

    >>> from attn_dispatch.demo.factory import build, prompts_for, sizes
    >>> opts = DemoOptions(max_new_tokens=8)
    >>> target, draft = build(opts, device="cpu", dtype="float32", target_spec=None,
    ...                       draft_spec=None)
    >>> prompts = prompts_for(opts, sizes()[opts.size].target.vocab)
    >>> target_out = target_greedy(target, prompts, 8)            # the reference
    >>> out, stats = speculative(target, draft, prompts, opts)
    >>> assert out == target_out

The draft proposes a token tree per request (top-``branch`` first tokens, a greedy chain of
``depth`` tokens after each) in DECODE forwards; the target checks every request's tree in ONE
VERIFY forward with a tree mask; the longest path the target agrees with is committed (its
cache rows moved next to the prefix) plus the target's own next token, and the pages of the
rest go back to the free lists.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch import AttnDispatchError
from attn_dispatch import Phase
from attn_dispatch.demo.values import DemoOptions
from attn_dispatch.demo.values import Request
from attn_dispatch.demo.values import Stats

if TYPE_CHECKING:
    from attn_dispatch.demo.runner import Runner
    from attn_dispatch.demo.runner import SeqKV


@dataclasses.dataclass(slots=True)
class Tree:
    """One request's proposal: ``chains[b]`` is branch ``b``'s tokens (depth long) and
    ``pages[b]`` the draft pages they were cached in (page_size 1: one per token)."""

    chains: list[list[int]]
    pages: list[list[int]]

    def flatten(self, root: int) -> tuple[list[int], list[int], list[int]]:
        """Nodes (root first, then each chain in turn), their parents and depths."""
        nodes, parents, depths = [root], [-1], [0]
        for chain in self.chains:
            for d, tok in enumerate(chain):
                parents.append(0 if d == 0 else len(nodes) - 1)
                depths.append(d + 1)
                nodes.append(tok)
        return nodes, parents, depths


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What the target made of one request's tree: accepted node ids (in order) and its own
    next token after them."""

    accepted: list[int]
    bonus: int


def step(runner: Runner, phase: Phase, reqs: Sequence[Request]) -> tuple[Any, list[int]]:
    """One forward of ``runner`` over ``reqs``: logits ``[T, V]`` and each request's first row."""
    from attn_dispatch import AttnBatch

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


def prefill(
    runner: Runner,
    seqs: list[SeqKV],
    prompts: Sequence[Sequence[int]],
    shared: int = 0,
    private: bool = False,
) -> tuple[Any, SeqKV]:
    """Cache the prompts: logits of each prompt's last token, and the pages of the shared
    prefix (release them after the requests).

    ``shared``: the prompts' first ``shared`` tokens are one system prompt. Its whole pages
    are computed once, in a PREFILL of their own, and every request's page table starts with
    those page ids (``private``: the rows are copied into pages of each request's own, the
    same numbers without sharing); the rest of each prompt is a PREFILL after that prefix."""
    from attn_dispatch.demo.runner import SeqKV

    head = SeqKV()
    done = shared // runner.page_size * runner.page_size  # the whole pages
    if done:
        runner.reserve(head, done)
        prefix = list(prompts[0][:done])
        step(runner, Phase.PREFILL, [Request(head.pages, 0, prefix, range(done))])
        rows = runner.rows(head.pages, range(done))
        for seq in seqs:
            if not private:
                seq.pages, seq.shared = list(head.pages), len(head.pages)
            elif seq is seqs[0]:
                seq.pages = list(head.pages)  # the first request owns the pages written
            else:
                runner.reserve(seq, done)
                runner.copy_rows(rows, runner.rows(seq.pages, range(done)))
        if private:
            head.pages = []
    reqs = []
    for seq, p in zip(seqs, prompts, strict=True):
        runner.reserve(seq, len(p))
        reqs.append(Request(list(seq.pages), done, p[done:], range(done, len(p))))
        seq.length = len(p)
    logits, firsts = step(runner, Phase.PREFILL, reqs)
    lasts = [f + len(p) - done - 1 for f, p in zip(firsts, prompts, strict=True)]
    return logits[lasts], head


def greedy_steps(
    target: Runner,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    shared: int = 0,
    private: bool = False,
) -> Iterator[list[list[int]]]:
    """The target alone, one forward per step: a PREFILL, then one DECODE per token. Yields
    the tokens so far after each forward (the lists grow in place). ``shared``, ``private``:
    the prompts' common prefix, as ``prefill`` lays it out."""
    from attn_dispatch.demo.layers import greedy
    from attn_dispatch.demo.runner import SeqKV

    target.reset()
    seqs = [SeqKV() for _ in prompts]
    logits, head = prefill(target, seqs, prompts, shared, private)
    outs = [[t] for t in greedy(logits)]
    yield outs
    for _ in range(max_new - 1):
        reqs = []
        for seq, out in zip(seqs, outs, strict=True):
            target.reserve(seq, seq.length + 1)
            reqs.append(Request(list(seq.pages), seq.length, [out[-1]], [seq.length]))
            seq.length += 1
        logits, _ = step(target, Phase.DECODE, reqs)
        for out, t in zip(outs, greedy(logits), strict=True):
            out.append(t)
        yield outs
    for seq in [*seqs, head]:
        target.release(seq)


def target_greedy(
    target: Runner, prompts: Sequence[Sequence[int]], max_new: int, shared: int = 0
) -> list[list[int]]:
    """The target's own greedy decoding: the reference the speculative output must equal
    (``shared``: the prompts' common prefix, its pages shared)."""
    *_, outs = greedy_steps(target, prompts, max_new, shared)
    return outs


def propose(
    draft: Runner, seqs: list[SeqKV], contexts: list[list[int]], depth: int, branch: int
) -> list[Tree]:
    """Draft one tree per request: ``branch`` first tokens, then a chain of ``depth`` each."""
    from attn_dispatch.demo.layers import greedy
    from attn_dispatch.demo.layers import top_k

    # Feed what the draft has not cached yet: the last committed token (two after a fully
    # accepted chain, then it is a short PREFILL), and take the top-`branch` next tokens.
    reqs = []
    for seq, ctx in zip(seqs, contexts, strict=True):
        new = ctx[seq.length :]
        draft.reserve(seq, seq.length + len(new))
        reqs.append(Request(list(seq.pages), seq.length, new, list(range(seq.length, len(ctx)))))
        seq.length += len(new)
    phase = Phase.DECODE if all(len(r.tokens) == 1 for r in reqs) else Phase.PREFILL
    logits, firsts = step(draft, phase, reqs)
    lasts = [f + len(r.tokens) - 1 for f, r in zip(firsts, reqs, strict=True)]
    trees = [
        Tree([[h] for h in heads], [[] for _ in heads]) for heads in top_k(logits[lasts], branch)
    ]
    # Extend every branch as a chain: all branches of all requests in one DECODE per level,
    # each branch on its own pages after the shared prefix.
    for s in range(1, depth):
        reqs = []
        for seq, tree in zip(seqs, trees, strict=True):
            pos = seq.length + s - 1
            for chain, pages in zip(tree.chains, tree.pages, strict=True):
                pages.extend(draft.allocator.alloc(1))
                reqs.append(Request(seq.pages + pages, pos, [chain[-1]], [pos]))
        logits, _ = step(draft, Phase.DECODE, reqs)
        nxt = iter(greedy(logits))
        for tree in trees:
            for chain in tree.chains:
                chain.append(next(nxt))
    return trees


def verify(target: Runner, seqs: list[SeqKV], roots: list[int], trees: list[Tree]) -> list[Verdict]:
    """Check every request's tree in ONE target VERIFY forward (tree mask), then walk it."""
    from attn_dispatch import tree_mask
    from attn_dispatch.demo.layers import greedy

    reqs, flat = [], []
    for seq, root, tree in zip(seqs, roots, trees, strict=True):
        nodes, parents, depths = tree.flatten(root)
        flat.append((nodes, parents))
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
    return [
        accept(nodes, parents, choice[first : first + len(nodes)])
        for (nodes, parents), first in zip(flat, firsts, strict=True)
    ]


def accept(nodes: Sequence[int], parents: Sequence[int], choice: Sequence[int]) -> Verdict:
    """The longest path from the root whose every token is the target's choice after its
    parent; the target's choice after the path's last node is the bonus token."""
    path = [0]
    while True:
        want = choice[path[-1]]
        hit = [j for j in range(1, len(nodes)) if parents[j] == path[-1] and nodes[j] == want]
        if not hit:
            return Verdict(path[1:], want)
        path.append(hit[0])


def commit_target(target: Runner, seq: SeqKV, accepted: Sequence[int]) -> None:
    """Move the accepted nodes' cache rows next to the root; free the pages past them."""
    start = seq.length
    moved = [(start + j, start + 1 + k) for k, j in enumerate(accepted) if j != k + 1]
    if moved:
        target.copy_rows(
            target.rows(seq.pages, [s for s, _ in moved]),
            target.rows(seq.pages, [d for _, d in moved]),
        )
    target.truncate(seq, start + 1 + len(accepted))


def commit_draft(draft: Runner, seq: SeqKV, tree: Tree, accepted: Sequence[int]) -> int:
    """Keep the pages of the accepted branch's fed tokens, free every other branch's.

    Returns the accepted branch (-1: none)."""
    depth = len(tree.chains[0])
    hit = (accepted[0] - 1) // depth if accepted else -1
    for b, pages in enumerate(tree.pages):
        keep = min(len(accepted), depth - 1) if b == hit else 0
        seq.pages.extend(pages[:keep])
        draft.allocator.free(pages[keep:])
    seq.length = len(seq.pages)
    return hit


def speculative_steps(
    target: Runner,
    draft: Runner,
    prompts: Sequence[Sequence[int]],
    opts: DemoOptions,
    stats: Stats,
    on_round: Callable[[int, list[int]], None] | None = None,
) -> Iterator[list[list[int]]]:
    """Speculative decoding one round at a time: prefill both runners, then per round
    propose, verify, commit. Yields the tokens so far after the prefill and each round."""
    from attn_dispatch.demo.layers import greedy
    from attn_dispatch.demo.runner import SeqKV

    if draft.page_size != 1:
        raise AttnDispatchError("the demo's draft forks branches per token: its page_size is 1")
    target.reset()
    draft.reset()
    stats.depth = opts.depth
    tf0, df0 = target.forwards, draft.forwards
    n = len(prompts)
    tseqs = [SeqKV() for _ in range(n)]
    dseqs = [SeqKV() for _ in range(n)]
    logits, thead = prefill(target, tseqs, prompts, opts.shared_prefix)  # the first token
    gen = [[t] for t in greedy(logits)]
    _, dhead = prefill(draft, dseqs, prompts, opts.shared_prefix)
    yield gen
    active = [i for i in range(n) if len(gen[i]) < opts.max_new_tokens]
    while active and (opts.steps is None or stats.rounds < opts.steps):
        stats.rounds += 1
        contexts = [list(prompts[i]) + gen[i] for i in active]
        trees = propose(draft, [dseqs[i] for i in active], contexts, opts.depth, opts.branch)
        roots = [c[-1] for c in contexts]
        verdicts = verify(target, [tseqs[i] for i in active], roots, trees)
        per_request = []
        for i, tree, root, v in zip(active, trees, roots, verdicts, strict=True):
            nodes, _, _ = tree.flatten(root)
            commit_target(target, tseqs[i], v.accepted)
            hit = commit_draft(draft, dseqs[i], tree, v.accepted)
            if hit >= 0:
                stats.branch_hits[hit] += 1
            gen[i].extend([nodes[j] for j in v.accepted] + [v.bonus])
            del gen[i][opts.max_new_tokens :]
            stats.accepts.append(len(v.accepted))
            per_request.append(len(v.accepted))
        for i in list(active):
            if len(gen[i]) >= opts.max_new_tokens:
                target.release(tseqs[i])
                draft.release(dseqs[i])
                active.remove(i)
        stats.target_forwards = target.forwards - tf0
        stats.draft_forwards = draft.forwards - df0
        if on_round is not None:
            on_round(stats.rounds, per_request)
        yield gen
    for i in active:
        target.release(tseqs[i])
        draft.release(dseqs[i])
    target.release(thead)
    draft.release(dhead)


def speculative(
    target: Runner,
    draft: Runner,
    prompts: Sequence[Sequence[int]],
    opts: DemoOptions,
    on_round: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], Stats]:
    """Draft a token tree per request, verify it in one target forward, commit, repeat."""
    stats = Stats()
    t0 = time.perf_counter()
    *_, gen = speculative_steps(target, draft, prompts, opts, stats, on_round)
    stats.seconds = time.perf_counter() - t0
    return gen, stats
