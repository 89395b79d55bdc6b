"""vLLM's CPU engine serving its attention through attn_dispatch, one binding per runner.

Installed with the package (``pip install "attn_dispatch[vllm]"``), the ``vllm.general_plugins``
entry point ``attn_dispatch`` (``register`` below) runs in every vLLM process. It stays inert
until an engine asks for it through vLLM's own plugin configuration:

.. code-block:: python

    llm = vllm.LLM(model=path, additional_config={"attn_dispatch": {
        "target": "native", "draft": "prefill=torch,decode=native"}},
        speculative_config={"method": "draft_model", "model": draft_path,
                            "num_speculative_tokens": 3})

(``vllm serve ... --additional-config '{"attn_dispatch": {"target": "native"}}'`` is the same.)
Without the ``"attn_dispatch"`` key every vLLM object behaves exactly as vLLM's own CPU
attention: the registered classes subclass vLLM's and hand every call to it.

Keys of ``additional_config["attn_dispatch"]`` (``Settings.parse``):

- ``"target"``: the target model's ``BackendSpec`` string (``"native"``,
  ``"prefill=torch,decode=native"``).
- ``"draft"``: the draft's spec; required when vLLM's proposer has attention layers of its own
  (``speculative_config`` methods ``draft_model``, ``eagle``, ``eagle3``, ``mtp``, ...: vLLM's
  ``uses_draft_kv_cache()``), refused when it has none (no speculation, ``ngram``, ``suffix``,
  ``medusa``). Never copied from the target: the draft's choice is its own.
- ``"mixed"``: ``"split"`` (default) or ``"extend"``: how a step that mixes phases runs (below).

Which runner a layer belongs to is what vLLM says while it builds the layer: a layer built by
vLLM's proposer (a proposer object on the call stack, under one of its model tags such as
``"eagle_head"`` or ``"draft_model"``) is the draft's, any other the target's; the two signals
must agree, and the layers labelled ``"draft"`` must be those the proposer records as its own
(checked when vLLM builds the metadata builders). Anything else fails at start with the reason.
EAGLE heads are built under the target's model config, so the config cannot tell.

Phase of each request of a step (``request_phase``, under the rule of the layer's runner): one
query token -> DECODE; with speculative decoding (k tokens), at most 1 + k query tokens over a
cached prefix (the target verifying the drafts) or, for the draft, 2 + k (its pass over them and
the bonus token) -> VERIFY; otherwise (a prompt or a chunk of one, over its cached prefix) ->
PREFILL. vLLM schedules decodes and prefills in one step; with ``"split"`` such a step makes
one ``AttnBatch`` per phase present and every layer calls each phase's backend on its own rows;
``"extend"`` runs the whole step as one batch of the "largest" phase present (PREFILL over
VERIFY over DECODE).

Import cost: this module imports no vLLM and no torch; ``attn_dispatch.integrations.vllm.backend``
holds the vLLM classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec

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
        options = raw.get("options", {})
        if not isinstance(options, Mapping) or not all(
            isinstance(name, str)
            and isinstance(kw, Mapping)
            and all(isinstance(k, str) for k in kw)
            for name, kw in options.items()
        ):
            raise InvalidSpecError(
                "options",
                options,
                'expected backend name -> keywords, such as {"native": {"cascade": False}}',
            )
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
            _spec("target", raw["target"]),
            None if draft is None else _spec("draft", draft),
            mixed,
            {name: dict(kw) for name, kw in options.items()},
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


def _spec(field: str, value: object) -> BackendSpec:
    if isinstance(value, BackendSpec):
        return value
    if isinstance(value, Mapping):
        return BackendSpec.from_dict(dict(value))
    if not isinstance(value, str):
        raise InvalidSpecError(field, value, "expected a BackendSpec string such as 'native'")
    return BackendSpec.parse(value)


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


def rank_tables(llm: Any) -> list[dict[str, Any]]:
    """Each vLLM worker's dispatch table, in worker order (``LLM.collective_rpc``).

    With ``tensor_parallel_size > 1`` (and by default) vLLM runs its model in worker
    processes, where an in-process ``record_dispatch`` sees nothing; this asks every worker.
    Each entry (JSON-able): ``rank``, ``tp_rank``, ``tp_size``; ``runners``: label ->
    ``{"spec", "table": {phase: backend}, "configs": [per-rank heads, head size, page size,
    dtypes], "layers"}``; ``agreement``: the ``check_agreement`` runs at start-up (empty on a
    single rank).

    .. code-block:: python

        for t in rank_tables(llm):
            print(t["tp_rank"], t["runners"]["target"]["table"], t["runners"]["target"]["configs"])
    """
    from attn_dispatch.integrations.vllm.backend import worker_table

    return list(llm.collective_rpc(worker_table))


class record_ranks:
    """``record_dispatch`` in every vLLM worker: the calls each rank made, by runner and phase.

    .. code-block:: python

        with record_ranks(llm) as rec:
            llm.generate(prompts, params)
        rec.counts  # per worker: [[label, phase, backend, calls], ...]

    ``counts`` is filled when the block exits (one list per worker, worker order).
    """

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.counts: list[list[list[Any]]] | None = None

    def __enter__(self) -> record_ranks:
        from attn_dispatch.integrations.vllm.backend import worker_start_recording

        self._llm.collective_rpc(worker_start_recording)
        return self

    def __exit__(self, *exc_info: object) -> None:
        from attn_dispatch.integrations.vllm.backend import worker_stop_recording

        self.counts = list(self._llm.collective_rpc(worker_stop_recording))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route vLLM's CPU_ATTN to our subclass.

    Runs in every vLLM process, possibly more than once. The class it names behaves exactly
    as vLLM's own CPU attention unless the engine's ``additional_config`` has
    ``"attn_dispatch"``, so registering costs nothing to engines that do not ask for it.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


__all__ = [
    "BACKEND_PATH",
    "CONFIG_KEY",
    "DRAFT",
    "MIXED_MODES",
    "TARGET",
    "Settings",
    "rank_tables",
    "record_ranks",
    "register",
    "request_phase",
    "settings_of",
]
