"""Eager vs compiled dispatch cost of one ``attention`` call, measured side by side.

The handler is a no-op (it returns a preallocated tensor), so what is timed is dispatch alone:

- ``attention``: today's eager path (one ContextVar.get, one tuple index, one call).
- ``attention + is_compiling``: what routing inside ``attention`` itself would add if it
  checked ``torch.compiler.is_compiling()`` on every call (the alternative to the
  ``substitute_in_graph`` stand-in that ``attn_dispatch.compile`` registers).
- ``attention_op`` eager: the opaque custom op called outside torch.compile.
- compiled layer (Dynamo, ``backend="eager"``): a compiled function whose only work is the op,
  against the same function run eagerly, and a compiled function without the op (the floor
  every compiled call pays: guards and the graph call), so the op's share is the difference.
- the torch reference backend on a tiny decode batch, for scale.

Prints ns per call and the ratio to the plain eager ``attention``. No numbers are asserted.

    python bench/compile_overhead.py [--iters 200000] [--quick]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch

import attn_dispatch.compile as adc
from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._table import format_table
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import register_backend


class NullBackend(BackendBase):
    """Returns a preallocated output: the handler costs (almost) nothing."""

    name = "bench-null"

    def __init__(self, config: AttnConfig) -> None:
        self.out = torch.zeros(4, config.num_q_heads, int(config.v_head_dim or 0))

    def plan(self, batch: AttnBatch) -> None:
        return None

    def handler(self, phase: Phase) -> Callable[..., torch.Tensor]:
        out = self.out
        return lambda q, k, v, plan, scale: out


def per_call_ns(fn: Callable[[], Any], iters: int) -> float:
    fn()
    best = min(timeit.repeat(fn, number=iters, repeat=5))
    return best / iters * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 calls per row")
    args = parser.parse_args()
    if args.quick:  # checks the script runs; the figures are not comparable
        args.iters = 100
    torch.set_num_threads(1)
    cfg = AttnConfig(
        kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4
    )
    register_backend(
        "bench-null", capabilities=Capabilities(kinds={"mha"}), factory=NullBackend, replace=True
    )
    null = bind("bench-null", cfg, label="null")
    ref = bind("torch", cfg, label="torch")
    batch = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * 4,
        kv_lens=[3, 7, 5, 8],
        page_tables=[[0], [1, 2], [3, 4], [5, 6]],
        page_size=4,
    )
    q = torch.randn(4, 4, 8)
    k = torch.randn(8, 4, 2, 8)
    v = torch.randn(8, 4, 2, 8)
    is_compiling = torch.compiler.is_compiling

    def routed() -> Any:
        if is_compiling():
            return adc.attention_op(q, k, v, sm_scale=0.3)
        return attention(q, k, v, sm_scale=0.3)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return attention(q, k, v, sm_scale=0.3)

    def no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q * 1.0

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    compiled_empty = torch.compile(no_attention, fullgraph=True, backend="eager")
    n = args.iters
    rows: list[tuple[str, float]] = []
    with attn_scope(null, batch):
        compiled(q, k, v)  # compile outside the timing
        compiled_empty(q, k, v)
        rows.append(("attention (eager)", per_call_ns(lambda: attention(q, k, v, sm_scale=0.3), n)))
        rows.append(("attention + is_compiling() check", per_call_ns(routed, n)))
        rows.append(
            (
                "attention_op (eager, torch dispatcher)",
                per_call_ns(lambda: adc.attention_op(q, k, v, sm_scale=0.3), n // 4),
            )
        )
        rows.append(("layer() eager", per_call_ns(lambda: layer(q, k, v), n)))
        rows.append(
            ("layer() compiled, fullgraph", per_call_ns(lambda: compiled(q, k, v), n // 10))
        )
        rows.append(
            (
                "compiled q*1 (compiled-call floor, no op)",
                per_call_ns(lambda: compiled_empty(q, k, v), n // 10),
            )
        )
    with attn_scope(ref, batch):
        rows.append(
            (
                "torch reference decode (B=4, for scale)",
                per_call_ns(lambda: attention(q, k, v, sm_scale=0.3), max(n // 100, 100)),
            )
        )
    base = rows[0][1]
    body = [(name, f"{ns:,.0f}", f"{ns / base:.2f}x") for name, ns in rows]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, no-op handler")
    print(format_table(("call", "ns/call", "vs attention"), body))


if __name__ == "__main__":
    main()
