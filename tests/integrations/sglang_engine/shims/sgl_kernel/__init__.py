"""Test-only stand-in for SGLang's CPU kernel package (``sgl_kernel``), never part of the library.

SGLang 0.5.23's engine imports a few CPU ops from ``sgl_kernel`` at module level when it runs
on a CPU; the real CPU build is compiled from SGLang's source and is not on the registry. These
are plain torch index copies with the same arguments; the speculative tree build and greedy
verify run SGLang's own Triton kernels (the tests set ``TRITON_INTERPRET=1``). It defines no
``torch.ops.sgl_kernel`` ops, so SGLang sees no AMX kernels and keeps its portable paths.
"""

from __future__ import annotations

from typing import Any

import torch


def _spans(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(start.tolist(), end.tolist(), strict=True))


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the request's run of out_cache_loc (runs concatenated)."""
    at = 0
    for req, (s, e) in zip(
        req_pool_indices.tolist(), _spans(start_offset, end_offset), strict=True
    ):
        n = e - s
        req_to_token[req, s:e] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The reverse: out_cache_loc's runs = req_to_token[req, start:end]."""
    at = 0
    for req, (s, e) in zip(
        req_pool_indices.tolist(), _spans(start_offset, end_offset), strict=True
    ):
        n = e - s
        out_cache_loc[at : at + n] = req_to_token[req, s:e].to(out_cache_loc.dtype)
        at += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Each request's topk * num_cols slots from seq_lens on, in request order."""
    width = topk * num_cols
    for i, (req, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[req, s : s + width].to(
            out_cache_loc.dtype
        )


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """bonus[i] = the last accepted token of request i."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The cache slots of the accepted tokens, packed in order (-1 = not accepted)."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def build_tree_kernel_efficient_cpu(*args: Any) -> None:
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    sgl_build_tree_kernel_triton(*args)


def verify_tree_greedy_cpu(**kwargs: Any) -> None:
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    renamed = {k.replace("retrive_", "retrieve_"): v for k, v in kwargs.items()}
    verify_tree_greedy_triton(**renamed)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy rows src -> tgt in every KV buffer (each named by its address and row bytes)."""
    import ctypes

    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for t, s in pairs:
            if t != s:
                ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


def _absent(name: str) -> Any:
    def missing(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"test shim sgl_kernel: {name} is not written here")

    missing.__name__ = name
    return missing


rotate_input_ids_cpu = _absent("rotate_input_ids_cpu")
build_draft_decode_metadata_cpu = _absent("build_draft_decode_metadata_cpu")
