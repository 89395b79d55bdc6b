"""What ``register`` changes in SGLang, and how ``unregister`` takes it back (imports SGLang).

Three things, all keyed by the backend name ``"attn_dispatch"``:

1. ``ATTENTION_BACKENDS["attn_dispatch"]`` (SGLang's attention registry): the factory SGLang
   calls with each model runner whose backend is this one (target and draft runners alike).
2. The name joins SGLang's argument choices for ``attention_backend`` (and the prefill/decode
   ones) and for ``speculative_draft_attention_backend``.
3. A BEFORE hook (SGLang's ``HookRegistry``) on ``DraftBackendFactory._create_backend``: that
   method picks EAGLE-family draft backends from a closed name map; the hook adds this name to
   the map it is handed, so the draft-extend backend and the multi-step draft decode are ours
   too. It adds nothing for any other name.
4. An AROUND hook on ``sglang.srt.models.sarvam_moe.get_attn_forward_method``: SGLang picks a
   Sarvam MLA layer's form (separate or concatenated rope) from the process-wide backend pair,
   so a Sarvam draft on its own backend gets the form of the target's. While this backend is
   in the pair or runs the forward, the hook reads the names SGLang stamped on the backend of
   the forward running now (the runner's own) instead; otherwise it calls SGLang's function
   unchanged.
5. The form of an MLA layer on this backend, in SGLang's two registries of backend names:
   DeepSeek's (``deepseek_common.attention_backend_handler.AttentionBackendRegistry``) gets a
   handler that asks the runner's own binding (absorbed ``MLA``, or decompressed: SGLang's
   ``MHA`` without a prefix; with one, its chunked-KV MHA when the binding picks
   ``mha_chunked``, else its one-shot MHA); Sarvam's gets separate rope (the backend takes
   either rope form; FlashInfer's is separate too). The name joins SGLang's list of backends
   that serve the chunked prefix cache (else SGLang turns that cache off at model load).

The backend stamps its own names on itself (``backend.AttnDispatchSGLangBackend``), so DeepSeek's
fallback for an unstamped backend (the process-wide pair) is never taken for it.
"""

from __future__ import annotations

from typing import Any

from attn_dispatch.integrations.sglang_engine._settings import BACKEND_NAME
from attn_dispatch.integrations.sglang_engine._settings import DRAFT
from attn_dispatch.integrations.sglang_engine._settings import FACTORY_TARGET


def _create_runner_backend(runner: Any) -> Any:
    from attn_dispatch.integrations.sglang_engine.backend import AttnDispatchSGLangBackend

    return AttnDispatchSGLangBackend(runner)


def _factory_before(
    factory: Any,
    backend_name: str,
    backend_map: dict[str, Any],
    error_template: str,
    stamps_children: bool = False,
) -> None:
    """BEFORE ``DraftBackendFactory._create_backend``: add our name to its (fresh) map."""
    from attn_dispatch.integrations.sglang_engine.backend import AttnDispatchMultiStepDraftBackend
    from attn_dispatch.integrations.sglang_engine.backend import AttnDispatchSGLangBackend

    runner = factory.draft_model_runner
    if stamps_children:  # create_decode_backend: the multi-step draft decode container

        def build() -> tuple[str, Any]:
            return BACKEND_NAME, AttnDispatchMultiStepDraftBackend(
                runner, factory.topk, factory.speculative_num_steps
            )
    else:  # create_draft_extend_backend: the draft runner's backend for its other forwards

        def build() -> tuple[str, Any]:
            return BACKEND_NAME, AttnDispatchSGLangBackend(runner, label=DRAFT)

    backend_map[BACKEND_NAME] = build


SARVAM_TARGET = "sglang.srt.models.sarvam_moe.get_attn_forward_method"


def _sarvam_around(original: Any, forward_batch: Any) -> Any:
    """AROUND ``sarvam_moe.get_attn_forward_method``: the runner's own backend names."""
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.model_executor.forward_context import has_forward_context
    from sglang.srt.models import sarvam_moe

    if not has_forward_context():
        return original(forward_batch)
    backend = get_attn_backend()
    prefill = getattr(backend, "prefill_attention_backend_str", None)
    decode = getattr(backend, "decode_attention_backend_str", None)
    pair = tuple(sarvam_moe.attention_backends())
    if BACKEND_NAME not in pair and BACKEND_NAME not in (prefill, decode):
        return original(forward_batch)
    if prefill is None or decode is None:  # unstamped: nothing better to read than SGLang's
        return original(forward_batch)
    mode = forward_batch.forward_mode
    if mode.is_decode_or_idle():
        name = decode
    else:
        name = prefill
        # SGLang's one special case, kept: FA3 prefills without speculation in MHA form.
        if mode.is_extend_without_speculative() and name == "fa3":
            return sarvam_moe.AttnForwardMethod.MHA_PREFILL
    return sarvam_moe.AttentionBackendRegistry.get_forward_method(name, None, forward_batch)


def _deepseek_form(attn: Any, forward_batch: Any) -> Any:
    """DeepSeek's handler for our name: the form the runner's own binding picks."""
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    from attn_dispatch._forms import AttnForm
    from attn_dispatch.integrations.sglang_engine.backend import AttnDispatchSGLangBackend

    backend = get_attn_backend()
    backend = getattr(backend, "primary", backend)  # SGLang's two-batch-overlap wrapper
    if not isinstance(backend, AttnDispatchSGLangBackend):
        # Not ours after all: what SGLang does for a name it has no handler for.
        return handlers.handle_attention_triton(attn, forward_batch)
    method = handlers.AttnForwardMethod
    form = backend.form_for(attn)
    if form is AttnForm.MLA:
        return method.MLA
    prefix = sum(forward_batch.extend_prefix_lens_cpu or [0])
    if prefix == 0:
        return method.MHA
    if form is AttnForm.MHA_CHUNKED and not getattr(attn, "disable_chunked_prefix_cache", False):
        # SGLang splits the prefix into chunks of SGLANG_MAX_KV_CHUNK_CAPACITY tokens and
        # merges the partial states itself; each call is served by the backend.
        return method.MHA_CHUNKED_KV
    return method.MHA_ONE_SHOT


_DEEPSEEK_FORMS = "sglang.srt.models.deepseek_common.attention_backend_handler"
_SARVAM = "sglang.srt.models.sarvam_moe"


def _install_forms() -> None:
    import importlib

    from sglang.srt.arg_groups import choices

    # SGLang turns its chunked prefix cache off at model load for a prefill backend not on
    # this list; ours serves it (the form is still the binding's choice).
    if BACKEND_NAME not in choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS:
        choices.add_chunked_prefix_cache_attention_backend(BACKEND_NAME)
    deepseek = importlib.import_module(_DEEPSEEK_FORMS)
    deepseek.AttentionBackendRegistry.register(BACKEND_NAME, _deepseek_form)
    sarvam = importlib.import_module(_SARVAM)
    sarvam.AttentionBackendRegistry.register(BACKEND_NAME, sarvam._handle_separate_rope_backend)


def _uninstall_forms() -> None:
    import sys

    from sglang.srt.arg_groups import choices

    names = choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    while BACKEND_NAME in names:
        names.remove(BACKEND_NAME)
    for name in (_DEEPSEEK_FORMS, _SARVAM):
        module = sys.modules.get(name)
        if module is not None:
            module.AttentionBackendRegistry._handlers.pop(BACKEND_NAME, None)


_HOOKS = ((FACTORY_TARGET, _factory_before, "BEFORE"), (SARVAM_TARGET, _sarvam_around, "AROUND"))


def _hook_registry() -> Any:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return HookRegistry


def install() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookType
    from sglang.srt.plugins.hook_registry import _current_plugin_source

    attention_registry.ATTENTION_BACKENDS[BACKEND_NAME] = _create_runner_backend
    # The add_* helpers are list.extend: add the name once however often plugins load.
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([BACKEND_NAME])
    _install_forms()
    registry = _hook_registry()
    for target, fn, kind in _HOOKS:
        if not any(hook is fn for _, hook, _ in registry._hooks[target]):
            registry.register(target, fn, HookType[kind])
    # Inside SGLang's load_plugins (a plugin source is set) the loader applies every hook once
    # all plugins ran; called by hand afterwards, apply ours now (apply_hooks skips targets it
    # already patched).
    if _current_plugin_source.get() is None:
        for target, _, _ in _HOOKS:
            if target in registry._patched:
                _reapply(registry, target)
        registry.apply_hooks()


def _original(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _reapply(registry: Any, target: str) -> None:
    """Put ``target`` back as SGLang shipped it, then apply the hooks still listed for it."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import _propagate_patch

    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    current = vars(owner)[attr]
    original = _original(current)
    setattr(owner, attr, original)
    # SGLang's apply_hooks also rebinds every module-level name that held the original; take
    # those back too, so no module keeps calling the hooked method.
    if current is not original:
        _propagate_patch(current, original, owner)
    registry._patched.discard(target)
    if registry._hooks.get(target):
        registry._apply_target(target, registry._hooks[target])
        registry._patched.add(target)


def uninstall() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention import attention_registry

    attention_registry.ATTENTION_BACKENDS.pop(BACKEND_NAME, None)
    for names in (choices.ATTENTION_BACKEND_CHOICES, choices.DRAFT_ATTENTION_BACKEND_CHOICES):
        while BACKEND_NAME in names:
            names.remove(BACKEND_NAME)
    _uninstall_forms()
    registry = _hook_registry()
    for target, fn, _ in _HOOKS:
        hooks = registry._hooks.get(target, [])
        kept = [h for h in hooks if h[1] is not fn]
        if len(kept) != len(hooks):
            registry._hooks[target] = kept
            if target in registry._patched:
                _reapply(registry, target)
