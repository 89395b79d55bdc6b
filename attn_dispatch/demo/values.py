"""The demo's values: a run's options, one request of a forward, what a speculative run did
(no torch here: the command line builds ``DemoOptions`` before importing it)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from attn_dispatch import InvalidSpecError


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request of a forward: its page table, where its new tokens go, what they are."""

    pages: Sequence[int]
    start: int  # cache position of the first new token (= tokens already cached)
    tokens: Sequence[int]
    positions: Sequence[int]  # rope positions (a tree node's depth, not its cache slot)
    mask: Any = None  # bool [len(tokens), start + len(tokens)] for tree verify


@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    """One run's settings (the command line's options; ``sizes()[size]`` gives the models)."""

    max_new_tokens: int = 32  # per request
    batch: int = 2  # requests, each prompt 4 tokens longer than the one before
    depth: int = 3  # draft tokens per branch of the tree
    branch: int = 2  # branches at the tree's first level (the draft's top-k first tokens)
    page_size: int = 4  # the target's (the draft's is 1: it forks branches per token)
    num_pages: int | None = None  # None: enough for every request at its longest
    seed: int = 0
    steps: int | None = None  # stop after this many rounds
    size: str = "tiny"
    shared_prefix: int = 0  # tokens of one system prompt every request starts with

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch", "depth", "branch", "page_size", "shared_prefix"):
            value, low = getattr(self, name), 0 if name == "shared_prefix" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidSpecError(name, value, f"DemoOptions needs an int >= {low}")


@dataclasses.dataclass(slots=True)
class Stats:
    """What a speculative run did: the accepted draft tokens of each request in each round
    (``accepts``), and what follows from them."""

    accepts: list[int] = dataclasses.field(default_factory=list)
    depth: int = 0  # draft tokens per request per round (each round drafts this many)
    rounds: int = 0
    # Rounds whose accepted path went through branch k of the tree (only k > 0 needs a tree).
    branch_hits: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0

    @property
    def request_rounds(self) -> int:
        return len(self.accepts)

    @property
    def accepted(self) -> int:
        return sum(self.accepts)

    @property
    def drafted(self) -> int:
        return self.depth * len(self.accepts)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
