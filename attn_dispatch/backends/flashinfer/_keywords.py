"""Every keyword the FlashInfer adapter passes to a FlashInfer wrapper, per (wrapper, method).

The adapter builds its calls from these sets (``kw``) and tests/test_flashinfer.py checks each
against the installed signatures, so a renamed keyword fails a CPU test, not a GPU run.
Imports nothing (no torch, no flashinfer).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WRAPPER_KEYWORDS", "kw"]

# Keywords shared by the two paged MHA wrappers (prefill and decode), per method.
_PAGED_INIT = frozenset({"float_workspace_buffer", "kv_layout", "use_cuda_graph", "backend"})
_PAGED_PLAN = frozenset(
    {
        "num_qo_heads",
        "num_kv_heads",
        "page_size",
        "q_data_type",
        "kv_data_type",
        "sm_scale",
        "window_left",
        "logits_soft_cap",
        "non_blocking",
    }
)
_PAGED_RUN = frozenset({"q", "paged_kv_cache", "k_scale", "v_scale", "return_lse", "out"})

WRAPPER_KEYWORDS: dict[tuple[str, str], frozenset[str]] = {
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__"): _PAGED_INIT
    | {
        "qo_indptr_buf",
        "paged_kv_indptr_buf",
        "paged_kv_indices_buf",
        "paged_kv_last_page_len_buf",
        "custom_mask_buf",
        "mask_indptr_buf",
    },
    ("BatchPrefillWithPagedKVCacheWrapper", "plan"): _PAGED_PLAN
    | {
        "qo_indptr",
        "paged_kv_indptr",
        "paged_kv_indices",
        "paged_kv_last_page_len",
        "head_dim_qk",
        "head_dim_vo",
        "custom_mask",
        "causal",
    },
    ("BatchPrefillWithPagedKVCacheWrapper", "run"): _PAGED_RUN | {"lse_base"},
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__"): _PAGED_INIT
    | {
        "use_tensor_cores",
        "paged_kv_indptr_buffer",
        "paged_kv_indices_buffer",
        "paged_kv_last_page_len_buffer",
    },
    ("BatchDecodeWithPagedKVCacheWrapper", "plan"): _PAGED_PLAN
    | {"indptr", "indices", "last_page_len", "head_dim"},
    ("BatchDecodeWithPagedKVCacheWrapper", "run"): _PAGED_RUN,
    ("MultiLevelCascadeAttentionWrapper", "__init__"): frozenset(
        {"num_levels", "float_workspace_buffer", "kv_layout"}
    ),
    ("MultiLevelCascadeAttentionWrapper", "plan"): frozenset(
        {
            "qo_indptr_arr",
            "paged_kv_indptr_arr",
            "paged_kv_indices_arr",
            "paged_kv_last_page_len",
            "num_qo_heads",
            "num_kv_heads",
            "head_dim",
            "page_size",
            "causal",
            "sm_scale",
            "logits_soft_cap",
            "q_data_type",
            "kv_data_type",
        }
    ),
    ("MultiLevelCascadeAttentionWrapper", "run"): frozenset({"q", "paged_kv_cache"}),
    ("BatchMLAPagedAttentionWrapper", "__init__"): frozenset(
        {
            "float_workspace_buffer",
            "use_cuda_graph",
            "qo_indptr",
            "kv_indptr",
            "kv_indices",
            "kv_len_arr",
            "backend",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "plan"): frozenset(
        {
            "metadata",
            "num_heads",
            "head_dim_ckv",
            "head_dim_kpe",
            "page_size",
            "causal",
            "sm_scale",
            "q_data_type",
            "kv_data_type",
            "query_layout",
            "kv_cache_layout",
            "scale_mode",
            "lse_mode",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "run"): frozenset(
        {
            "query",
            "kv_cache",
            "ckv_scale",
            "kpe_scale",
            "return_lse",
            "return_lse_base_on_e",
            "out",
        }
    ),
    ("MLAPlanMetadata", "csr"): frozenset({"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"}),
}


def kw(wrapper: str, method: str, **kwargs: Any) -> dict[str, Any]:
    """The keywords for one call, checked against WRAPPER_KEYWORDS (a typo here would
    otherwise only show on a GPU)."""
    allowed = WRAPPER_KEYWORDS[(wrapper, method)]
    unknown = set(kwargs) - allowed
    if unknown:  # pragma: no cover - programming error in this module
        raise AssertionError(f"{wrapper}.{method}: keywords {sorted(unknown)} not declared")
    return kwargs
