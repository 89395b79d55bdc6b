"""SGLang's chunked-KV prefill (``MHA_CHUNKED_KV``) through the attn_dispatch backend, without
an engine. Started by test_chunked_kv.py in a child process (the shims on PYTHONPATH,
``TRITON_INTERPRET=1``, ``ATTN_DISPATCH_SGLANG`` set); prints one JSON line.

The backend is the real ``AttnDispatchSGLangBackend`` over SGLang's real ``MLATokenToKVPool``
(a stand-in model runner carries the widths). The calls are made the way SGLang's
``forward_normal_chunked_kv_core`` / ``_chunked_prefix_attn_mha`` make them: its chunk
lengths (``get_prefix_chunk_seq_lens``), its ``set_*`` methods, its ``merge_state``; DeepSeek's
form registry asks our handler first. The result is checked against full attention over
prefix + new tokens in float64.
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.layers.attention.merge_state import merge_state
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_executor.forward_batch_deepseek_mha_mixin import (
    ForwardBatchDeepSeekMHAMixin as Mixin,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

from attn_dispatch import InvalidBatchError
from attn_dispatch.integrations.sglang_engine import register
from attn_dispatch.integrations.sglang_engine.backend import AttnDispatchSGLangBackend

H, LATENT, ROPE, NOPE, DV = 4, 16, 8, 16, 16
DK = NOPE + ROPE


class _Asks(torch.nn.Module):
    """A module that asks the backend for its form (what DeepSeek's layers do)."""

    def dispatch_attn_forward_method(self) -> None:  # pragma: no cover - never called
        pass


def make_backend() -> AttnDispatchSGLangBackend:
    pool = MLATokenToKVPool(
        size=256,
        page_size=1,
        dtype=torch.float32,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    hf = SimpleNamespace(qk_nope_head_dim=NOPE, v_head_dim=DV)
    runner = SimpleNamespace(
        is_draft_worker=False,
        use_mla_backend=True,
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.arange(4 * 64).view(4, 64)),
        device="cpu",
        dtype=torch.float32,
        server_args=SimpleNamespace(speculative_eagle_topk=None),
        model_config=SimpleNamespace(num_attention_heads=H, hf_config=hf, hf_text_config=hf),
        tp_size=1,
        model=torch.nn.Sequential(_Asks()),
    )
    return AttnDispatchSGLangBackend(runner)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: list[int], new: list[int], s: float
) -> torch.Tensor:
    """Per request: new rows over prefix + new keys, causal bottom-right, float64."""
    outs, qa, ka = [], 0, 0
    for p, n in zip(prefix, new, strict=True):
        qi = q[qa : qa + n].double()
        ki, vi = k[ka : ka + p + n].double(), v[ka : ka + p + n].double()
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * s
        allowed = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        scores = scores.masked_fill(~allowed, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))
        qa, ka = qa + n, ka + p + n
    return torch.cat(outs)


def run_case(
    backend: AttnDispatchSGLangBackend, prefix: list[int], new: list[int], capacity: int
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(sum(prefix) * 31 + sum(new))
    bs, total_new = len(prefix), sum(new)
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    # Every token's decompressed K/V, request after request (prefix then new tokens).
    k_all = torch.randn(sum(seq), H, DK, generator=g)
    v_all = torch.randn(sum(seq), H, DV, generator=g)
    q = torch.randn(total_new, H, DK, generator=g)
    layer = SimpleNamespace(
        tp_q_head_num=H, tp_k_head_num=H, qk_head_dim=DK, v_head_dim=DV, layer_id=0
    )
    layer.scaling = DK**-0.5
    fb: Any = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        extend_seq_lens_cpu=new,
        extend_prefix_lens_cpu=prefix,
        batch_size=bs,
        attn_attend_prefix_cache=None,
        mha_return_lse=None,
        prefix_chunk_idx=None,
    )
    backend.init_forward_metadata(fb)
    # DeepSeek's registry asks our handler (the runner's own binding) for the form.
    attn = SimpleNamespace(disable_chunked_prefix_cache=False)
    with forward_context(ForwardContext(attn_backend=backend)):
        method = handlers.AttentionBackendRegistry.get_handler("attn_dispatch")(attn, fb)
        attn.disable_chunked_prefix_cache = True
        off = handlers.AttentionBackendRegistry.get_handler("attn_dispatch")(attn, fb)
    # SGLang's chunking: chunk_capacity // batch_size tokens per request and chunk.
    chunk_len = capacity // bs
    n_chunks = (max(prefix) + chunk_len - 1) // chunk_len
    starts, lens = Mixin.get_prefix_chunk_seq_lens(fb, torch.tensor(prefix), n_chunks, chunk_len)
    fb.num_prefix_chunks = n_chunks
    fb.prefix_chunk_seq_lens_cpu = lens
    backend.init_mha_chunk_metadata(fb)
    # The new tokens over themselves (forward_normal_chunked_kv_core).
    new_rows = torch.cat(
        [torch.arange(sum(seq[:i]) + prefix[i], sum(seq[: i + 1])) for i in range(bs)]
    )
    fb.mha_return_lse = True
    Mixin.set_attn_attend_prefix_cache(fb, False)
    acc_o, acc_lse = backend.forward(q, k_all[new_rows], v_all[new_rows], layer, fb, False)
    shapes = [list(acc_o.shape), list(acc_lse.shape)]
    # Then each prefix chunk, non-causal, merged by SGLang's merge_state (_chunked_prefix_attn_mha).
    Mixin.set_attn_attend_prefix_cache(fb, True)
    for i in range(n_chunks):
        Mixin.set_prefix_chunk_idx(fb, i)
        # The chunk's rows, request after request (what SGLang gathers and decompresses).
        rows = torch.cat(
            [sum(seq[:b]) + int(starts[i, b]) + torch.arange(int(lens[i, b])) for b in range(bs)]
        )
        o, lse = backend.forward(q, k_all[rows], v_all[rows], layer, fb, False)
        acc_o, acc_lse = merge_state(o, lse, acc_o, acc_lse, None, None)
    want = reference(q, k_all, v_all, prefix, new, layer.scaling)
    err = float((acc_o.double() - want).abs().max())
    # A chunk call without SGLang's chunk metadata (init_mha_chunk_metadata saw no chunks).
    fb.num_prefix_chunks = 0
    backend.init_mha_chunk_metadata(fb)
    try:
        backend.forward(q, k_all[rows], v_all[rows], layer, fb, False)
        missing = ["none", ""]
    except InvalidBatchError as exc:
        missing = [type(exc).__name__, str(exc)]
    return {
        "method": method.name,
        "method_disabled": off.name,
        "chunks": n_chunks,
        "chunk_lens": lens.tolist(),
        "shapes": shapes,
        "max_err": err,
        "missing_metadata": missing,
    }


def main() -> None:
    """argv[1]: a JSON list of ``{"env": ATTN_DISPATCH_SGLANG, "prefix": [...], "new": [...],
    "capacity": tokens per chunk batch}``; each case on a backend built from its env."""
    register()
    out = []
    for case in json.loads(sys.argv[1]):
        os.environ["ATTN_DISPATCH_SGLANG"] = json.dumps(case["env"])
        backend = make_backend()
        out.append(run_case(backend, case["prefix"], case["new"], case["capacity"]))
    print("CHUNKED " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
