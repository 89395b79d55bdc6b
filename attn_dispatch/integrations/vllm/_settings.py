"""The engine settings of the vLLM integration: what ``additional_config["attn_dispatch"]``
says, and the phase rule of one request. Torch-free and vLLM-free; the package and its
``backend`` module both read it (so neither imports the other for it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations._options import backend_options
from attn_dispatch.integrations._options import spec_value

#: The key of vLLM's ``additional_config`` that turns the integration on.
CONFIG_KEY = "attn_dispatch"
#: The labels of the two runners' bindings (``record_dispatch()`` shows them).
TARGET = "target"
DRAFT = "draft"
MIXED_MODES = ("split", "extend")
#: The class vLLM's CPU platform loads for CPU_ATTN once ``register`` ran.
BACKEND_PATH = "attn_dispatch.integrations.vllm.backend.AttnDispatchCPUBackend"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The parsed ``additional_config["attn_dispatch"]`` of one engine.

    >>> str(Settings.parse({"target": "native", "draft": "torch"}).spec_for(DRAFT))
    'torch'
    """

    target: BackendSpec
    draft: BackendSpec | None = None
    mixed: str = "split"
    #: ``bind``'s ``options`` for every runner: backend name -> factory keywords, e.g.
    #: ``{"native": {"cascade": False}}``.
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, raw: object) -> Settings:
        """From the JSON-shaped mapping; every bad key or value is an ``InvalidSpecError``."""
        if not isinstance(raw, Mapping):
            raise InvalidSpecError(
                CONFIG_KEY,
                raw,
                'expected a mapping such as {"target": "native", "draft": "torch"}',
            )
        unknown = sorted(str(k) for k in raw if k not in ("target", "draft", "mixed", "options"))
        if unknown:
            raise InvalidSpecError(
                CONFIG_KEY,
                dict(raw),
                f"unknown key(s) {unknown!r}; keys are 'target', 'draft', 'mixed' and 'options'",
            )
        options = backend_options(raw.get("options", {}), example='{"native": {"cascade": False}}')
        if "target" not in raw:
            raise InvalidSpecError(
                CONFIG_KEY,
                dict(raw),
                'name the target model\'s backends: {"target": "native"} (a BackendSpec string)',
            )
        mixed = raw.get("mixed", "split")
        if mixed not in MIXED_MODES:
            raise InvalidSpecError("mixed", mixed, f"choose one of {MIXED_MODES!r}")
        draft = raw.get("draft")
        return cls(
            spec_value("target", raw["target"]),
            None if draft is None else spec_value("draft", draft),
            mixed,
            options,
        )

    def spec_for(self, label: str) -> BackendSpec:
        """The spec of runner ``label``; the draft's must have been named."""
        if label == TARGET:
            return self.target
        if self.draft is None:
            raise InvalidSpecError(
                "draft",
                None,
                "this engine runs a draft model, and its attention backends are its own choice: "
                'add "draft": "<spec>" to additional_config["attn_dispatch"] (the target\'s '
                "spec is never copied to the draft)",
            )
        return self.draft


def settings_of(vllm_config: Any) -> Settings | None:
    """The engine's ``Settings``, or None when ``additional_config`` has no ``"attn_dispatch"``."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, Mapping) or CONFIG_KEY not in extra:
        return None
    return Settings.parse(extra[CONFIG_KEY])


def request_phase(
    q_len: int, kv_len: int, num_speculative_tokens: int, *, draft: bool = False
) -> Phase:
    """The phase of one request of a vLLM step (see the module docstring).

    >>> request_phase(1, 70, 0).name, request_phase(4, 70, 3).name, request_phase(9, 9, 3).name
    ('DECODE', 'VERIFY', 'PREFILL')

    VERIFY is a multi-token step on a cache no longer than speculation makes it: the target
    verifies at most ``1 + k`` tokens (the last accepted one and ``k`` drafts); the draft's
    pass over them adds the bonus token, ``2 + k`` (``draft=True``), as SGLang's
    draft-extend, which follows the verify backend too.
    """
    if q_len == 1:
        return Phase.DECODE
    longest = num_speculative_tokens + (2 if draft else 1)
    if num_speculative_tokens and q_len <= longest and kv_len > q_len:
        return Phase.VERIFY
    return Phase.PREFILL
