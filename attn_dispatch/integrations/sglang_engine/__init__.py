"""SGLang's own engine serving each runner's attention through attn_dispatch (SGLang 0.5.23).

Installed with the package, the ``sglang.srt.plugins`` entry point ``attn_dispatch``
(``register`` below) runs in every SGLang process (the engine process, before its server
arguments are parsed, and the scheduler subprocess). It adds an attention backend *named*
``attn_dispatch`` and teaches SGLang's EAGLE draft factory that name; an engine that does not
name it runs exactly as before.

Turn it on by naming the backend and saying each runner's spec in one environment variable,
set before the engine starts (the scheduler subprocess inherits it):

.. code-block:: python

    os.environ["ATTN_DISPATCH_SGLANG"] = '{"target": "native", "draft": "torch"}'
    engine = sglang.Engine(model_path=target, attention_backend="attn_dispatch",
                           speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                           speculative_num_steps=3, speculative_eagle_topk=1,
                           speculative_num_draft_tokens=4, ...)

SGLang's server arguments carry backend *names* only (no free-form backend options), so the
specs travel in ``ATTN_DISPATCH_SGLANG`` (``Settings.parse``), a JSON object:

- ``"target"``: the target model's ``BackendSpec`` string (``"native"``,
  ``"prefill=torch,decode=native"``).
- ``"draft"``: the draft model's spec (STANDALONE, EAGLE, EAGLE-3 drafts run on it). Required
  whenever a draft runner uses this backend: a draft without one is refused at start-up
  (``InvalidSpecError``); the target's spec is never copied to the draft.
- ``"options"``: ``bind``'s per-backend factory keywords, e.g. ``{"native": {"cascade": false}}``.
- ``"record"``: a file path; the scheduler process then records every ``attention`` call
  (``record_dispatch``) and keeps ``(runner, phase, backend) -> calls`` there as JSON
  (``read_record``; ``read_record_forms`` adds each MLA call's form): the engine runs in a
  subprocess where an in-process recorder sees nothing.

Which runner a backend serves is SGLang's own word: ``ModelRunner.is_draft_worker`` (True for
every STANDALONE, EAGLE and EAGLE-3 draft runner). The phase of each forward is
``attn_dispatch.integrations.sglang.phase_of`` of its ``forward_mode``.

MLA models (SGLang's ``MLATokenToKVPool``): the absorbed calls (latent + rope, rope separate
or concatenated) read the latent pool in place; DeepSeek's layers ask the runner's own binding
for their form (absorbed, or decompressed over the rows SGLang decompresses); Sarvam's run
absorbed. See docs/integrations/sglang.md.

Import cost: this module imports no SGLang and no torch; ``...sglang_engine.backend`` holds the
SGLang classes and loads when SGLang first builds this backend.
"""

from __future__ import annotations

from attn_dispatch.integrations.sglang_engine._settings import BACKEND_NAME
from attn_dispatch.integrations.sglang_engine._settings import DRAFT
from attn_dispatch.integrations.sglang_engine._settings import ENV_VAR
from attn_dispatch.integrations.sglang_engine._settings import FACTORY_TARGET
from attn_dispatch.integrations.sglang_engine._settings import TARGET
from attn_dispatch.integrations.sglang_engine._settings import Settings
from attn_dispatch.integrations.sglang_engine._settings import read_record
from attn_dispatch.integrations.sglang_engine._settings import read_record_forms
from attn_dispatch.integrations.sglang_engine._settings import settings_from_env


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: add the backend name and the draft-factory hook.

    Idempotent (SGLang loads plugins in each of its processes, possibly more than once). Inert
    unless an engine names ``"attn_dispatch"``: the factory hook adds an entry to the factory's
    name map only when the draft's configured backend is this one.
    """
    from attn_dispatch.integrations.sglang_engine import _hooks

    _hooks.install()


def unregister() -> None:
    """Remove the backend name, its argument choices and the draft-factory hook (tests; a
    process that wants SGLang exactly as it shipped)."""
    from attn_dispatch.integrations.sglang_engine import _hooks

    _hooks.uninstall()


__all__ = [
    "BACKEND_NAME",
    "DRAFT",
    "ENV_VAR",
    "FACTORY_TARGET",
    "TARGET",
    "Settings",
    "read_record",
    "read_record_forms",
    "register",
    "settings_from_env",
    "unregister",
]
