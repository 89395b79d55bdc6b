"""BackendSpec: the kernel names one runner uses, per phase."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import Literal

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase

VerifyMode = Literal["prefill", "decode"]
_VERIFY_MODES = ("prefill", "decode")
_KEYS = ("prefill", "decode", "verify", "verify_mode")
_DICT_KEYS = (*_KEYS, "note")


@dataclasses.dataclass(frozen=True, slots=True)
class BackendSpec:
    """The backend name of each phase of one runner. Immutable, hashable, picklable.

    >>> spec = BackendSpec.parse("prefill=triton,decode=flashinfer")
    >>> spec.backend_for(Phase.VERIFY)  # verify=None follows verify_mode ("prefill")
    'triton'
    >>> BackendSpec.parse(str(spec)) == spec
    True
    """

    prefill: str
    decode: str
    verify: str | None = None
    verify_mode: VerifyMode = "prefill"
    # Where the names came from (e.g. a rename SGLang applied); provenance, not identity.
    note: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        for field in ("prefill", "decode", "verify"):
            value = getattr(self, field)
            if value is None and field == "verify":
                continue
            if not isinstance(value, str) or not value.strip():
                raise InvalidSpecError(field, value, "must be a non-empty backend name")
            value = value.strip()
            if any(c in value for c in ",= \t"):
                raise InvalidSpecError(
                    field, value, "a backend name cannot contain ',', '=' or spaces"
                )
            object.__setattr__(self, field, value)
        if self.note is not None and not isinstance(self.note, str):
            raise InvalidSpecError("note", self.note, "must be a string or None")
        if self.verify_mode not in _VERIFY_MODES:
            raise InvalidSpecError(
                "verify_mode", self.verify_mode, "choose 'prefill' (default) or 'decode'"
            )

    @classmethod
    def uniform(cls, name: str) -> BackendSpec:
        """The same backend for every phase: ``BackendSpec.uniform("torch")``."""
        return cls(prefill=name, decode=name)

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """Parse ``"prefill=a,decode=b[,verify=c][,verify_mode=decode]"``.

        A bare name is the default for prefill and decode: ``"triton,decode=flashinfer"``.
        """
        if not isinstance(text, str):
            raise InvalidSpecError("spec", text, "expected a string such as 'prefill=a,decode=b'")
        fields: dict[str, str] = {}
        default: str | None = None
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                raise InvalidSpecError("spec", text, "empty item; write 'prefill=a,decode=b'")
            if "=" not in item:
                if default is not None:
                    raise InvalidSpecError("spec", text, "more than one bare backend name")
                default = item
                continue
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in _KEYS:
                raise InvalidSpecError(
                    "spec", text, f"unknown key {key!r}; keys are {', '.join(map(repr, _KEYS))}"
                )
            if key in fields:
                raise InvalidSpecError("spec", text, f"key {key!r} given twice")
            fields[key] = value
        prefill = fields.pop("prefill", default)
        decode = fields.pop("decode", default)
        if prefill is None or decode is None:
            missing = "prefill" if prefill is None else "decode"
            raise InvalidSpecError(
                "spec",
                text,
                f"no backend for {missing}; give {missing}=NAME or a bare default name",
            )
        return cls(
            prefill=prefill,
            decode=decode,
            verify=fields.get("verify"),
            verify_mode=fields.get("verify_mode", "prefill"),  # type: ignore[arg-type]
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendSpec:
        unknown = set(data) - set(_DICT_KEYS)
        if unknown:
            raise InvalidSpecError(
                "spec",
                dict(data),
                f"unknown keys {sorted(unknown)!r}; keys are {list(_DICT_KEYS)!r}",
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidSpecError("spec", dict(data), str(exc)) from None

    @classmethod
    def from_json(cls, text: str) -> BackendSpec:
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidSpecError("spec", text, f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidSpecError("spec", text, "expected a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_server_args(
        cls,
        args: object,
        *,
        is_draft: bool = False,
        speculative_algorithm: str | None = None,
    ) -> BackendSpec:
        """The spec SGLang gives one runner, from its ``ServerArgs`` (or a mapping of them).

        >>> args = {"attention_backend": "triton", "decode_attention_backend": "flashinfer",
        ...         "speculative_attention_mode": "decode"}
        >>> str(BackendSpec.from_server_args(args))
        'prefill=triton,decode=flashinfer,verify_mode=decode'
        >>> BackendSpec.from_server_args(args, is_draft=True, speculative_algorithm="EAGLE").names
        ('flashinfer', 'flashinfer', 'flashinfer')

        Reads ``resolved_dict()`` when ``args`` has one (SGLang >= 0.5.23 keeps the raw input
        in the attributes), else the attributes or mapping keys. The target runner follows
        ``attention_backends()`` and the hybrid backend; a draft runner follows the rules of
        ``speculative_algorithm`` (else ``args.speculative_algorithm``, else EAGLE's), as
        SGLang 0.5.23's draft factories apply them. Names SGLang rewrites are rewritten the
        same way and listed in ``note``. A phase without a name raises ``InvalidSpecError``.
        """
        return _sglang_spec(cls, args, is_draft=is_draft, algorithm=speculative_algorithm)

    def backend_for(self, phase: Phase) -> str:
        """The backend name that serves ``phase``."""
        if phase is Phase.PREFILL:
            return self.prefill
        if phase is Phase.DECODE:
            return self.decode
        if self.verify is not None:
            return self.verify
        return self.prefill if self.verify_mode == "prefill" else self.decode

    @property
    def names(self) -> tuple[str, str, str]:
        """Backend names indexed by ``Phase``."""
        return (self.prefill, self.decode, self.backend_for(Phase.VERIFY))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``note`` only when there is one."""
        data: dict[str, Any] = {
            "prefill": self.prefill,
            "decode": self.decode,
            "verify": self.verify,
            "verify_mode": self.verify_mode,
        }
        if self.note is not None:
            data["note"] = self.note
        return data

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), sort_keys=True)

    def __str__(self) -> str:
        if self.prefill == self.decode and self.verify is None and self.verify_mode == "prefill":
            return self.prefill
        text = f"prefill={self.prefill},decode={self.decode}"
        if self.verify is not None:
            text += f",verify={self.verify}"
        if self.verify_mode != "prefill":
            text += f",verify_mode={self.verify_mode}"
        return text


# --- SGLang server args -------------------------------------------------------------------
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


def _sglang_spec(
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
