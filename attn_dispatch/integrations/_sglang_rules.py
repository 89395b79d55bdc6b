"""SGLang's rules, the one place they are written: its forward-mode names -> ``Phase``
(``phase_of``) and its server arguments -> each runner's ``BackendSpec``
(``server_args_spec``). Imports no SGLang. Public through ``attn_dispatch.integrations.sglang``
(``phase_of``, ``spec_from_server_args``); the core knows nothing of SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import UnknownPhaseError
from attn_dispatch._phase import Phase
from attn_dispatch._vocab import VERIFY_MODES as _VERIFY_MODES

if TYPE_CHECKING:
    from attn_dispatch._spec import BackendSpec


# -- SGLang forward modes -> Phase -----------------------------------------------------------
# SGLang's ForwardMode names (checked against SGLang 0.5.23; DRAFT_EXTEND against 0.5.10-0.5.13).
# Verify-like modes are their own phase: whether they run on the prefill or the decode backend
# is the spec's `verify_mode`, never a property of the name.
# - DRAFT_EXTEND_V2 runs only on an EAGLE-family draft runner, whose backend for it is
#   DraftBackendFactory's draft-extend backend (the decode one under speculative_attention_mode
#   "decode"); `spec_from_server_args(..., is_draft=True)` names that backend for VERIFY.
#   HybridAttnBackend would send it to prefill, but EAGLE v2 replaces the draft runner's hybrid
#   backend with the draft-extend one, so no runner routes it through the hybrid.
# - DRAFT_EXTEND (SGLang <= 0.5.13, removed in 0.5.14): HybridAttnBackend routed it like
#   TARGET_VERIFY, by speculative_attention_mode.
_MODE_TO_PHASE: dict[str, Phase] = {
    "EXTEND": Phase.PREFILL,
    "MIXED": Phase.PREFILL,
    "SPLIT_PREFILL": Phase.PREFILL,
    "PREBUILT": Phase.PREFILL,
    "DLLM_EXTEND": Phase.PREFILL,
    "DECODE": Phase.DECODE,
    "IDLE": Phase.DECODE,
    "TARGET_VERIFY": Phase.VERIFY,
    "DRAFT_EXTEND_V2": Phase.VERIFY,
    "DRAFT_EXTEND": Phase.VERIFY,
    # Our own names, so phase_of(Phase.X.name) works too.
    "PREFILL": Phase.PREFILL,
    "VERIFY": Phase.VERIFY,
}


def phase_of(mode: object) -> Phase:
    """Map a framework forward-mode (SGLang ``ForwardMode`` or its name) to a ``Phase``.

    >>> phase_of("TARGET_VERIFY")
    <Phase.VERIFY: 2>

    Enum members are read by their ``name``; an unknown name raises ``UnknownPhaseError``.
    """
    if isinstance(mode, Phase):
        return mode
    name = getattr(mode, "name", mode)
    if not isinstance(name, str):
        raise UnknownPhaseError(repr(mode), tuple(sorted(_MODE_TO_PHASE)))
    phase = _MODE_TO_PHASE.get(name.strip().upper())
    if phase is None:
        raise UnknownPhaseError(name, tuple(sorted(_MODE_TO_PHASE)))
    return phase


# -- SGLang server args -> BackendSpec -------------------------------------------------------
# Checked against SGLang 0.5.23 (tests/data/sglang_grid_0.5.23.json, tools/sglang_grid.py).

# serving_hook._handle_deprecated_args: deprecated backend names.
_SGLANG_ALIASES = {"tokenspeed_mla": "cutedsl_mla", "compressed": "dsv4"}
_SGLANG_BACKEND_FIELDS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "speculative_draft_attention_backend",
)
# Drafts built by DraftBackendFactory (NEXTN is SGLang's alias of EAGLE).
_EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
# Drafts built by build_draft_tp_worker: one backend for every draft forward.
_SINGLE_BACKEND_DRAFTS = frozenset({"DFLASH", "DSPARK"})
_ALGORITHMS = (*sorted(_EAGLE_FAMILY), *sorted(_SINGLE_BACKEND_DRAFTS), "NGRAM")
# arg_groups/choices.py DRAFT_ATTENTION_BACKEND_CHOICES: what a DFLASH/DSPARK draft runs.
_SGLANG_DRAFT_CHOICES = frozenset(
    {"flashinfer", "fa3", "fa4", "triton", "ascend", "trtllm_mha", "intel_xpu"}
)
# DraftBackendFactory stamps: the name of the backend it builds for a configured name.
_DRAFT_EXTEND_BUILDS = {"cutedsl_mla": "trtllm_mla", "nsa": "dsa"}
_DRAFT_DECODE_BUILDS = {"nsa": "dsa"}


def _server_arg_reader(args: object) -> Any:
    resolved = getattr(args, "resolved_dict", None)
    if callable(resolved):
        values = resolved()
        if isinstance(values, Mapping):
            return values.get
    if isinstance(args, Mapping):
        return args.get
    return lambda name: getattr(args, name, None)


def _algorithm_name(value: object) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", value)  # SGLang's SpeculativeAlgorithm enum or its name
    if not isinstance(name, str) or name.strip().upper() not in (*_ALGORITHMS, "NONE"):
        raise InvalidSpecError(
            "speculative_algorithm",
            value,
            f"choose one of {', '.join(map(repr, _ALGORITHMS))} or None",
        )
    upper = name.strip().upper()
    return None if upper == "NONE" else upper


def server_args_spec(
    cls: type[BackendSpec], args: object, *, is_draft: bool, algorithm: str | None
) -> BackendSpec:
    get = _server_arg_reader(args)
    algo = _algorithm_name(algorithm if algorithm is not None else get("speculative_algorithm"))
    names: dict[str, Any] = {field: get(field) for field in _SGLANG_BACKEND_FIELDS}
    notes: list[str] = []
    mode: Any = get("speculative_attention_mode") or "prefill"

    # The renames SGLang's resolution applies to raw input (resolved values pass unchanged).
    raw_tokenspeed = "tokenspeed_mla" in (
        names["attention_backend"],
        names["decode_attention_backend"],
    )
    for field, value in names.items():
        if value in _SGLANG_ALIASES:
            names[field] = _SGLANG_ALIASES[value]
            notes.append(f"{field} {value!r} -> {names[field]!r} (SGLang alias)")
    if names["prefill_attention_backend"] == "cutedsl_mla":
        names["prefill_attention_backend"] = "trtllm_mla"
        notes.append("prefill 'cutedsl_mla' -> 'trtllm_mla' (cutedsl_mla is decode-only)")
    if raw_tokenspeed and algo is not None and mode == "prefill":
        mode = "decode"
        notes.append("speculative_attention_mode 'prefill' -> 'decode' (tokenspeed_mla)")
    base = names["attention_backend"]
    if names["prefill_attention_backend"] is None and "cutedsl_mla" in (
        base,
        names["decode_attention_backend"],
    ):
        names["prefill_attention_backend"] = "trtllm_mla"
        notes.append("prefill -> 'trtllm_mla' (cutedsl_mla is decode-only)")

    if mode not in _VERIFY_MODES:
        raise InvalidSpecError("verify_mode", mode, "choose 'prefill' (default) or 'decode'")
    prefill = names["prefill_attention_backend"] or base
    decode = names["decode_attention_backend"] or base
    override = names["speculative_draft_attention_backend"] if is_draft else None

    def make(p: str, d: str, v: str | None = None) -> BackendSpec:
        return cls(p, d, verify=v, verify_mode=mode, note="; ".join(notes) or None)

    if is_draft and algo == "NGRAM":
        raise InvalidSpecError(
            "speculative_algorithm", algo, "NGRAM has no draft model, so no draft runner"
        )
    if is_draft and algo in _SINGLE_BACKEND_DRAFTS:
        name = override or prefill
        if name and name not in _SGLANG_DRAFT_CHOICES:
            notes.append(f"draft {name!r} -> 'flashinfer' ({algo} fallback on CUDA)")
            name = "flashinfer"
        if name:
            return make(name, name)
    elif override:
        return make(override, override)
    if not prefill or not decode:
        raise InvalidSpecError(
            "attention_backend",
            base,
            "server args name no backend for "
            f"{'prefill' if not prefill else 'decode'}; set attention_backend or "
            "prefill_attention_backend/decode_attention_backend explicitly",
        )
    if not is_draft:
        return make(prefill, decode)
    # EAGLE family (and a draft of unnamed algorithm): DraftBackendFactory builds the
    # draft-extend backend from the decode name under mode "decode", and EAGLE v2 makes it the
    # draft runner's backend for every forward but the multi-step decode.
    configured = decode if mode == "decode" else prefill
    extend = _DRAFT_EXTEND_BUILDS.get(configured, configured)
    step = _DRAFT_DECODE_BUILDS.get(decode, decode)
    for kind, before, after in (
        ("draft-extend", configured, extend),
        ("draft decode", decode, step),
    ):
        if before != after:
            notes.append(f"{kind} {before!r} -> {after!r} (SGLang draft factory)")
    # DRAFT_EXTEND_V2 is Phase.VERIFY: name its backend unless verify_mode already gives it.
    verify = extend if mode == "decode" and step != extend else None
    return make(extend, step, verify)
