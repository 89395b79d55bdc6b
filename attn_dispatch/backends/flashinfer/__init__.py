"""FlashInfer backend: what FlashInfer's kernels can serve, as reasons (light module).

This module is imported with the registry, so it must stay cheap: it imports neither
torch nor flashinfer at module level. Every rule below restates a limit that FlashInfer
itself enforces (inside ``plan``, a JIT template or a CUDA kernel), so that a choice it
cannot serve is refused at ``bind`` with a reason, before FlashInfer is imported or
called. The source of each rule is named next to it (paths are inside the installed
``flashinfer`` package, version 0.7.4).

Example::

    >>> from attn_dispatch import AttnConfig, Phase
    >>> from attn_dispatch.backends.flashinfer import CAPABILITIES
    >>> cfg = AttnConfig(kind="mla", num_q_heads=16, num_kv_heads=1, head_dim=352,
    ...                  v_head_dim=320, dtype="bfloat16", page_size=1, device="cuda")
    >>> any("multiple of 64" in r for r in CAPABILITIES.reasons(cfg, Phase.DECODE))
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backend import Phase

__all__ = [
    "CAPABILITIES",
    "DISTRIBUTIONS",
    "SUPPORTED_VERSIONS",
    "installed_version",
    "version_supported",
]

#: The FlashInfer releases this adapter is written and checked against (keyword names,
#: MLA ``plan(metadata=MLAPlanMetadata.csr(...))``, the limits below).
SUPPORTED_VERSIONS = ">=0.7,<0.8"
_VERSION_LOW = (0, 7)
_VERSION_HIGH = (0, 8)  # exclusive

#: Distribution names FlashInfer is published under on PyPI (newest first).
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")

_ALTERNATIVES = "choices: 'triton' or 'torch'"

Check = Callable[[AttnConfig, Phase], Iterable[str]]

# MHA head dims: the widths FlashInfer dispatches and ships kernels for, 64/128/256/512
# (DISPATCH_HEAD_DIM in data/include/flashinfer/utils.cuh), q/k and v equal; the one
# unequal pair its prefill kernels are built for is (192, 128) (utils.py:
# is_fa3_prefill_head_dim_supported; fa2 serves it too). Its JIT may compile other
# widths, but nothing guarantees them (the decode kernel static_asserts on the vector
# layout, attention/decode.cuh), so they are not claimed: under-claiming costs a reason
# at bind, over-claiming costs a crash inside a kernel.
MHA_HEAD_DIMS = (64, 128, 256, 512)
MHA_UNEQUAL_HEAD_DIMS = ((192, 128),)

# MLA, fa2 and fa3 backends of BatchMLAPagedAttentionWrapper
# (mla/_batch_mla/_backends/_fa_common.py: _validate_generated_fa_plan):
# head_dim_ckv % 128 == 0 and head_dim_kpe % 64 == 0.
MLA_CKV_MULTIPLE = 128
MLA_KPE_MULTIPLE = 64
# Causal multi-token MLA (prefill, chain verify): the FA scheduler splits the packed
# (query x head) rows into tiles of 64 rows, or 128 once a request averages more than 64
# rows; when the head count does not divide the tile, plan refuses batches whose keys
# land on a KV tile boundary (_fa_common.py: _validate_fa_causal_tile_bound). A head
# count dividing 128 never hits it (<= 64 heads dividing 128 divide 64 too; above 64
# heads the tile is always 128).
MLA_CAUSAL_ROW_TILE = 128
# fa2 MLA needs this much shared memory per SM (_fa_common.py: _generated_fa_shared_bytes).
FA2_MLA_MIN_SMEM_PER_SM = 92672

# ---------------------------------------------------------------------------------
# Version
# ---------------------------------------------------------------------------------


def installed_version() -> str | None:
    """The installed FlashInfer version string, read from package metadata (no import).

    >>> v = installed_version()
    >>> v is None or isinstance(v, str)
    True
    """
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_supported(version: str) -> bool:
    """True when ``version`` lies in :data:`SUPPORTED_VERSIONS` (pre/dev tags count as
    the release they lead to).

    >>> version_supported("0.7.4"), version_supported("0.8.0"), version_supported("0.6.9")
    (True, False, False)
    """
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if match is None:
        return False
    major_minor = (int(match.group(1)), int(match.group(2)))
    return _VERSION_LOW <= major_minor < _VERSION_HIGH


# ---------------------------------------------------------------------------------
# Availability: what this machine has (no config needed)
# ---------------------------------------------------------------------------------


def _check_device_type(config: AttnConfig, phase: Phase) -> Iterable[str]:
    # The core reports the device mismatch tersely; this says why and what runs instead.
    # (A CUDA config on a machine without CUDA, and the sm80+ minimum, are reported by the
    # core from ``devices`` and ``min_compute_capability``.)
    if config.device_type != "cuda":
        yield (
            f"needs CUDA: FlashInfer kernels run only on NVIDIA GPUs (sm80+), and "
            f"device={config.device!r}; on CPU choose 'torch', 'native' or 'triton' "
            "(with TRITON_INTERPRET=1)"
        )


def _available_installed() -> Iterable[str]:
    # find_spec on a top-level name locates the package without importing it.
    if importlib.util.find_spec("flashinfer") is None:
        yield (
            "not installed: the 'flashinfer' module cannot be found; install "
            f"flashinfer-python{SUPPORTED_VERSIONS} (pip install 'attn_dispatch[flashinfer]')"
        )
        return
    version = installed_version()
    if version is None:
        yield (
            "unsupported FlashInfer: the 'flashinfer' module is present but no "
            f"{' or '.join(repr(d) for d in DISTRIBUTIONS)} distribution metadata was "
            f"found, so its version cannot be checked against {SUPPORTED_VERSIONS!r}"
        )
    elif not version_supported(version):
        yield (
            f"unsupported FlashInfer version {version!r}: this adapter is written for "
            f"flashinfer-python{SUPPORTED_VERSIONS}; install a matching release or choose "
            f"another backend ({_ALTERNATIVES})"
        )


# ---------------------------------------------------------------------------------
# Per-config checks
# ---------------------------------------------------------------------------------


def _v_head_dim(config: AttnConfig) -> int:
    # AttnConfig fills v_head_dim in __post_init__ (MHA: = head_dim; MLA: required).
    assert config.v_head_dim is not None
    return config.v_head_dim


_FP8 = tuple(sorted(FP8_DTYPES))
# FP8 MLA (mla/_batch_mla/_backends/_fa_common.py: _validate_generated_fa_plan): e4m3fn
# only, q bfloat16, latent 512 with rope 0 or 64, an SM90 device, per-tensor scales.
MLA_FP8_KV_DTYPES = ("float8_e4m3fn",)
MLA_FP8_CKV = 512
MLA_FP8_KPE = (0, 64)
MLA_FP8_MAJOR = 9


def _check_kv_dtype(config: AttnConfig, phase: Phase) -> Iterable[str]:
    # fa2/fa3 take a non-fp8 KV cache only in the query's dtype
    # (_fa_common.py: "non-FP8 KV dtype must match query dtype"; the MHA templates are
    # instantiated per (q, kv) dtype pair from the same set). An FP8 cache with a 16-bit
    # query runs on fa2 (utils.py: is_fa3_backend_supported refuses fp8 kv with a 16-bit q,
    # so 'auto' picks fa2) and on the decode kernels; k_scale / v_scale go to run().
    if config.kv_dtype == config.dtype:
        return
    if config.kv_dtype not in _FP8:
        yield (
            f"FlashInfer needs kv_dtype equal to dtype for a 16-bit cache; got "
            f"dtype={config.dtype!r}, kv_dtype={config.kv_dtype!r}"
        )
        return
    if config.kind != "mla":
        return
    ckv = _v_head_dim(config)
    kpe = config.head_dim - ckv
    if (
        config.kv_dtype not in MLA_FP8_KV_DTYPES
        or config.dtype != "bfloat16"
        or ckv != MLA_FP8_CKV
        or kpe not in MLA_FP8_KPE
    ):
        yield (
            f"FlashInfer {installed_version() or '0.7'} MLA serves an FP8 latent cache only "
            f"as float8_e4m3fn with dtype 'bfloat16', latent width {MLA_FP8_CKV} and rope "
            f"width in {MLA_FP8_KPE} (fa2/fa3 plan rule); got kv_dtype={config.kv_dtype!r}, "
            f"dtype={config.dtype!r}, head_dim={config.head_dim}, v_head_dim={ckv} "
            f"({_ALTERNATIVES})"
        )
    major = _cuda_major(config)
    if major is not None and major != MLA_FP8_MAJOR:
        yield (
            f"FlashInfer MLA with an FP8 cache needs an SM90 (Hopper) GPU; {config.device!r} "
            f"is SM{major}x ({_ALTERNATIVES})"
        )


def _device_props(config: AttnConfig) -> Any:
    """The CUDA device properties of the config's device, or None when they cannot be read
    here (no CUDA: the "needs CUDA" reasons already say it; an unknown device index is
    reported by the core's CUDA check)."""
    if config.device_type != "cuda" or importlib.util.find_spec("torch") is None:
        return None
    import torch  # lazy on purpose: the light module stays torch-free at import

    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.get_device_properties(torch.device(config.device))
    except Exception:
        return None


def _cuda_major(config: AttnConfig) -> int | None:
    """The compute-capability major of the config's CUDA device, or None (see
    ``_device_props``)."""
    props = _device_props(config)
    return None if props is None else int(props.major)


def _check_variants(config: AttnConfig, phase: Phase) -> Iterable[str]:
    # Why these are not declared (the core's reason only names the variant).
    if config.attention_chunk_size is not None:
        yield (
            "FlashInfer 0.7's paged prefill/decode and MLA plans have no chunked local "
            "attention (no chunk size; window_left is a sliding window, not a chunk, and a "
            "per-forward custom mask would cost the causal kernels), so "
            f"attention_chunk_size={config.attention_chunk_size!r} is not served "
            f"({_ALTERNATIVES})"
        )
    if config.sinks:
        yield (
            "FlashInfer 0.7 applies attention sinks only in its trtllm-gen (sm100), cuDNN and "
            "XQA kernels; the fa2/fa3 kernels its 'auto' choice runs on sm80/sm90 have no sink "
            "term (their sink variant is a separate JIT module this adapter does not build), "
            f"so sinks=True is not served ({_ALTERNATIVES})"
        )
    if config.kind == "mla":
        used = [
            name
            for name, on in (
                ("window_left", config.window_left is not None),
                ("logit_cap", bool(config.logit_cap)),
            )
            if on
        ]
        if used:
            yield (
                f"FlashInfer MLA (BatchMLAPagedAttentionWrapper.plan) takes neither "
                f"window_left nor logits_soft_cap, so {' and '.join(used)} cannot be served "
                f"for MLA ({_ALTERNATIVES})"
            )


def _only(kind: str) -> Callable[[Check], Check]:
    """A check that applies to configs of one kind only (the others get no reasons)."""

    def wrap(check: Check) -> Check:
        @functools.wraps(check)
        def checked(config: AttnConfig, phase: Phase) -> Iterable[str]:
            return check(config, phase) if config.kind == kind else ()

        return checked

    return wrap


@_only("mha")
def _check_mha_dims(config: AttnConfig, phase: Phase) -> Iterable[str]:
    dims = (config.head_dim, config.v_head_dim)
    if config.head_dim == config.v_head_dim and config.head_dim in MHA_HEAD_DIMS:
        return
    if dims in MHA_UNEQUAL_HEAD_DIMS:
        return
    yield (
        f"FlashInfer MHA kernels are built for head_dim == v_head_dim in "
        f"{MHA_HEAD_DIMS} or (head_dim, v_head_dim) in {MHA_UNEQUAL_HEAD_DIMS}; got "
        f"head_dim={config.head_dim}, v_head_dim={config.v_head_dim} ({_ALTERNATIVES})"
    )


@_only("mla")
def _check_mla_dims(config: AttnConfig, phase: Phase) -> Iterable[str]:
    ckv = _v_head_dim(config)
    kpe = config.head_dim - ckv
    if ckv % MLA_CKV_MULTIPLE or kpe % MLA_KPE_MULTIPLE:
        yield (
            "FlashInfer MLA (BatchMLAPagedAttentionWrapper, fa2/fa3) needs v_head_dim "
            f"(latent width) a multiple of {MLA_CKV_MULTIPLE} and head_dim - v_head_dim "
            f"(rope width) a multiple of {MLA_KPE_MULTIPLE}; got head_dim={config.head_dim}, "
            f"v_head_dim={ckv} (rope width {kpe}) ({_ALTERNATIVES})"
        )


@_only("mla")
def _check_mla_phase(config: AttnConfig, phase: Phase) -> Iterable[str]:
    if phase is Phase.VERIFY and config.tree_verify:
        # BatchMLAPagedAttentionWrapper.plan has no custom-mask argument at all.
        yield (
            "FlashInfer MLA has no custom mask, so tree verify (tree_verify=True) cannot "
            "run on it; use verify='triton' or verify='torch', or verify a causal chain"
        )
    if phase in (Phase.PREFILL, Phase.VERIFY) and MLA_CAUSAL_ROW_TILE % config.num_q_heads:
        yield (
            f"FlashInfer MLA causal {phase.name.lower()} needs num_q_heads dividing "
            f"{MLA_CAUSAL_ROW_TILE} (its query row tile; other head counts make plan refuse "
            f"batches whose keys fall on a KV tile boundary); got "
            f"num_q_heads={config.num_q_heads} ({_ALTERNATIVES})"
        )


@_only("mla")
def _check_mla_shared_memory(config: AttnConfig, phase: Phase) -> Iterable[str]:
    """fa2 MLA keeps a 64-row query tile and a KV tile of the full latent+rope width in
    shared memory; check it fits this GPU. Only for an MLA config on CUDA with CUDA present
    (otherwise the "needs CUDA" reasons already say it all)."""
    props = _device_props(config)
    if props is None or props.major < 8:
        return  # below sm80: the core's compute-capability reason covers it
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    per_block = getattr(props, "shared_memory_per_block_optin", None)
    if per_sm is None or per_block is None:
        return
    need = _fa2_mla_shared_bytes(config, int(per_sm))
    if need is None or need > int(per_block):
        amount = f"{need} bytes" if need is not None else f"more than the {per_sm} bytes per SM"
        yield (
            f"FlashInfer MLA (fa2) needs {amount} of shared memory per block for "
            f"head_dim={config.head_dim}, v_head_dim={config.v_head_dim}; {config.device!r} "
            f"allows {per_block} per block ({_ALTERNATIVES})"
        )


def _fa2_mla_shared_bytes(config: AttnConfig, smem_per_sm: int) -> int | None:
    """Shared memory one fa2 MLA block uses for these dims (16-bit cache), following
    _fa_common.py: _generated_fa_shared_bytes; None when the SM is too small."""
    ckv = _v_head_dim(config)
    kpe = config.head_dim - ckv
    if smem_per_sm >= 221696:
        stages, tile_kv = 2, 64
    elif smem_per_sm >= 147968:
        stages, tile_kv = 2, 32
    elif smem_per_sm >= FA2_MLA_MIN_SMEM_PER_SM:
        stages, tile_kv = 1, 16
    else:
        return None
    q_bytes = 64 * (ckv + kpe) * 2
    kv_bytes = stages * tile_kv * (ckv + max(kpe, 64)) * 2
    return max(q_bytes + kv_bytes + 32 + 2 * 64 * 4, 64 * ckv * 2)


# return_lse: every wrapper's run() returns its lse (see backend.py for the units). Declared
# once the core's vocabulary knows the variant (a vocabulary without it refuses the name).

#: The form policy of MLA configs (registered with the backend; a ``form_policy`` option
#: given to ``bind`` overrides it).
DEFAULT_FORM_POLICY = FormPolicy.decompressed_without_prefix()

CAPABILITIES = Capabilities(
    kinds=frozenset({"mha", "mla"}),
    phases=frozenset(Phase),
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"float16", "bfloat16"}),
    kv_dtypes=frozenset({"float16", "bfloat16", *_FP8}),
    # window_left / logits_soft_cap of the paged prefill and decode plans (MHA; MLA refused
    # in _check_variants). Sinks are not declared: see _check_variants.
    # causal=False: the prefill plans' causal=False (decode is unchanged). Chunked local
    # attention is not declared: see _check_variants.
    variants=frozenset({"window", "logit_cap", "non_causal", "lse"}),
    head_dims=None,  # dims are checked in pairs below (MHA) or as latent/rope (MLA)
    v_head_dims=None,
    page_sizes=None,  # fa2/fa3 paged kernels take any positive page size at run time
    custom_mask=True,  # MHA verify trees via the prefill wrapper; MLA refused in a check
    # Its wrappers take sm_scale in plan(), once per forward: bind needs AttnConfig.sm_scale.
    plans_scale=True,
    # The paged and MLA wrappers' run(out=...) write a caller's buffer; the cascade wrapper
    # takes none, so its result is copied there.
    out_buffer=True,
    requires=(),  # installation and version: _available_installed (pip name differs)
    min_compute_capability=(8, 0),
    checks=(
        _check_device_type,
        _check_kv_dtype,
        _check_variants,
        _check_mha_dims,
        _check_mla_dims,
        _check_mla_phase,
        _check_mla_shared_memory,
    ),
    availability=(_available_installed,),
    # Absorbed everywhere; prefill (and verify) may run decompressed through the prefill wrapper.
    forms={Phase.PREFILL: {"mla", "mha"}, Phase.DECODE: {"mla"}, Phase.VERIFY: {"mla", "mha"}},
    description=(
        f"FlashInfer {SUPPORTED_VERSIONS} paged prefill/decode and MLA wrappers (CUDA sm80+)"
    ),
)
