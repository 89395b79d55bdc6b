"""BackendSpec: the kernel names one runner uses, per phase.

A framework's own way of naming them (SGLang's server arguments) is read by its integration:
``attn_dispatch.integrations.sglang.spec_from_server_args``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._vocab import VERIFY_MODES as _VERIFY_MODES
from attn_dispatch._vocab import VerifyMode

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
