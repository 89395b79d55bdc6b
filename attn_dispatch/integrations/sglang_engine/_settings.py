"""The engine's settings: the backend name, the runner labels and ``ATTN_DISPATCH_SGLANG``.

A module of its own so that ``_hooks`` and ``backend`` import these names without importing
the package that imports them lazily (no import cycle). Imports no SGLang and no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from attn_dispatch._env import SGLANG_SPECS
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations._options import backend_options
from attn_dispatch.integrations._options import spec_value

#: The attention backend name SGLang's arguments use (``attention_backend="attn_dispatch"``).
BACKEND_NAME = "attn_dispatch"
#: The environment variable holding the specs (JSON); read in the scheduler subprocess.
ENV_VAR = SGLANG_SPECS
#: The labels of the two runners' bindings (``record_dispatch()`` shows them).
TARGET = "target"
DRAFT = "draft"
#: The hooked method (a BEFORE hook: it adds ``BACKEND_NAME`` to the factory's name map).
FACTORY_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
_KEYS = ("target", "draft", "options", "record")


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The parsed ``ATTN_DISPATCH_SGLANG`` of one engine.

    >>> s = Settings.parse({"target": "native", "draft": "torch"})
    >>> str(s.spec_for(TARGET)), str(s.spec_for(DRAFT))
    ('native', 'torch')
    """

    target: BackendSpec
    draft: BackendSpec | None = None
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    record: str | None = None

    @classmethod
    def parse(cls, raw: object) -> Settings:
        """From the JSON text or mapping; every bad key or value is an ``InvalidSpecError``."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise InvalidSpecError(
                    ENV_VAR, raw, f'is not JSON ({exc}); e.g. {{"target": "native"}}'
                ) from None
        if not isinstance(raw, Mapping):
            raise InvalidSpecError(
                ENV_VAR,
                raw,
                'expected a JSON object such as {"target": "native", "draft": "torch"}',
            )
        unknown = sorted(str(k) for k in raw if k not in _KEYS)
        if unknown:
            raise InvalidSpecError(
                ENV_VAR, dict(raw), f"unknown key(s) {unknown!r}; keys are {list(_KEYS)!r}"
            )
        if "target" not in raw:
            raise InvalidSpecError(
                ENV_VAR,
                dict(raw),
                'name the target model\'s backends: {"target": "native"} (a BackendSpec string)',
            )
        options = backend_options(raw.get("options", {}), example='{"native": {"cascade": false}}')
        record = raw.get("record")
        if record is not None and not isinstance(record, str):
            raise InvalidSpecError("record", record, "expected a file path (a string)")
        draft = raw.get("draft")
        return cls(
            spec_value("target", raw["target"]),
            None if draft is None else spec_value("draft", draft),
            options,
            record,
        )

    def spec_for(self, label: str) -> BackendSpec:
        """The spec of runner ``label``; the draft's must have been named."""
        if label == TARGET:
            return self.target
        if self.draft is None:
            raise InvalidSpecError(
                "draft",
                None,
                f"this SGLang engine runs a draft model on the {BACKEND_NAME!r} attention "
                "backend, and a draft's attention backends are its own choice: add "
                f'"draft": "<spec>" to {ENV_VAR} (the target\'s spec is never copied to the '
                "draft), or give the draft another backend (speculative_draft_attention_backend)",
            )
        return self.draft


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """The engine's ``Settings`` from ``ATTN_DISPATCH_SGLANG``; unset is an ``InvalidSpecError``
    (this is read only once SGLang builds a backend of this name)."""
    raw = os.environ.get(SGLANG_SPECS) if environ is None else environ.get(SGLANG_SPECS)
    if raw is None:
        raise InvalidSpecError(
            ENV_VAR,
            None,
            f"the SGLang attention backend {BACKEND_NAME!r} was chosen, but {ENV_VAR} is unset: "
            f'set it before the engine starts, e.g. {ENV_VAR}=\'{{"target": "native", '
            '"draft": "torch"}\'',
        )
    return Settings.parse(raw)


def read_record(path: str) -> dict[tuple[str, str, str], int]:
    """The dispatch table a ``"record"`` file holds: ``(runner, phase, backend) -> calls``."""
    table: dict[tuple[str, str, str], int] = {}
    for runner, phase, backend, _form, calls in _record_rows(path):
        key = (runner, phase, backend)
        table[key] = table.get(key, 0) + calls
    return table


def read_record_forms(path: str) -> dict[tuple[str, str, str, str | None], int]:
    """As ``read_record``, with the form of each call (MLA layers: ``"mla"``, ``"mha"``,
    ``"mha_chunked"``; None for MHA/GQA layers): ``(runner, phase, backend, form) -> calls``."""
    return {(r, p, b, f): n for r, p, b, f, n in _record_rows(path)}


def _record_rows(path: str) -> list[tuple[str, str, str, str | None, int]]:
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    # Rows: [runner, phase, backend, calls, form].
    return [
        (str(r[0]), str(r[1]), str(r[2]), None if r[4] is None else str(r[4]), int(r[3]))
        for r in rows
    ]
