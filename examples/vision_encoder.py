"""A vision encoder and a decoder in one process, each on its own binding.

The encoder attends bidirectionally over each image's patches (``AttnConfig(causal=False)``,
prefill only: an encoder has no decode phase); the decoder is causal. Both dispatch through
``attention()`` inside their own ``attn_scope``, so neither can change the other's kernels or
masking. The script checks both against PyTorch's SDPA on contiguous tensors and prints the
dispatch table.

    python examples/vision_encoder.py                      # native (CPU)
    python examples/vision_encoder.py --spec torch
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 32, 16


def paged(k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, ...]:
    """Lay ragged ``[tokens, Hkv, D]`` K/V out in pages of ``PAGE`` tokens, request by request."""
    pages = [-(-n // PAGE) for n in lens]
    k_cache = torch.zeros(sum(pages), PAGE, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    tables, first, start = [], 0, 0
    for n, p in zip(lens, pages, strict=True):
        flat_k = k_cache[first : first + p].view(p * PAGE, KV_HEADS, DIM)
        flat_v = v_cache[first : first + p].view(p * PAGE, KV_HEADS, DIM)
        flat_k[:n], flat_v[:n] = k[start : start + n], v[start : start + n]
        tables.append(list(range(first, first + p)))
        first, start = first + p, start + n
    return k_cache, v_cache, tables  # type: ignore[return-value]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], causal: bool):
    """What a user would write instead: SDPA per request on contiguous K/V."""
    outs, start = [], 0
    for n in lens:
        qi, ki, vi = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ki = ki.repeat_interleave(HEADS // KV_HEADS, dim=0)
        vi = vi.repeat_interleave(HEADS // KV_HEADS, dim=0)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(outs)


def run(spec: str, lens: list[int], causal: bool, label: str) -> float:
    """One prefill forward of a runner bound with ``spec``; returns max |ours - SDPA|."""
    cfg = AttnConfig("mha", HEADS, KV_HEADS, DIM, DIM, dtype="float32", page_size=PAGE,
                     causal=causal)  # fmt: skip
    binding = bind(spec, cfg, label=label)
    gen = torch.Generator().manual_seed(len(label))
    t = sum(lens)
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen)
    k_cache, v_cache, tables = paged(k, v, lens)
    batch = AttnBatch.build(Phase.PREFILL, q_lens=lens, kv_lens=lens, page_tables=tables,
                            page_size=PAGE, num_pages=k_cache.shape[0])  # fmt: skip
    with attn_scope(binding, batch):
        out = attention(q, k_cache, v_cache, sm_scale=DIM**-0.5)
    return float((out - sdpa(q, k, v, lens, causal)).abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="native", help="backend spec of both runners")
    args = parser.parse_args(argv)
    with record_dispatch() as rec:
        # Three images of 49, 64 and 81 patches; a decoder batch of two prompts.
        enc = run(args.spec, [49, 64, 81], causal=False, label="vision_encoder")
        dec = run(args.spec, [37, 12], causal=True, label="decoder")
    print("runner          phase    backend  calls")
    for (label, phase, backend), calls in sorted(rec.counts().items()):
        print(f"{label:<15} {phase:<8} {backend:<8} {calls}")
    print(f"vision encoder (non-causal) vs SDPA is_causal=False: max |diff| {enc:.2e}")
    print(f"decoder (causal) vs SDPA is_causal=True:             max |diff| {dec:.2e}")
    ok = enc < 1e-4 and dec < 1e-4
    print("matches SDPA:", "yes" if ok else "no")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
