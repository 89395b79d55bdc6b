"""``use(model, spec)``: bind a transformers model's attention to a spec, and what that sets on
the model.

``use`` binds ``spec`` to the ``AttnConfig`` of each attention group of the model config
(``_config``), registers the attention function (``_attention``) and its mask function
(``_masks``) under the implementation name ``"attn_dispatch"``, switches the model to it
(``set_attn_implementation``) and wraps the model's ``forward`` so that every forward runs
inside its own ``attn_scope`` with the ``AttnBatch`` (or, for several groups, one batch per
group) made for that forward. Two models (a target and its assistant) therefore use their own
bindings even though they share the registered function.

The model's cache is a ``PagedCache`` (``_cache``): ``use`` replaces the cache ``generate``
would make (``_prepare_cache_for_generation``) and the one a forward with ``use_cache`` would
make, converts a passed ``DynamicCache`` once, and refuses other caches.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch

from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attn_scope
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations.transformers._attention import _view_for
from attn_dispatch.integrations.transformers._attention import attention_forward
from attn_dispatch.integrations.transformers._cache import GroupedBatches
from attn_dispatch.integrations.transformers._cache import PagedCache
from attn_dispatch.integrations.transformers._common import _PUBLIC_MODULE
from attn_dispatch.integrations.transformers._common import DEFAULT_PAGE_SIZE
from attn_dispatch.integrations.transformers._common import FP8_MAX
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import GROUP_SLIDING
from attn_dispatch.integrations.transformers._common import IMPLEMENTATION
from attn_dispatch.integrations.transformers._common import UnsupportedModelError
from attn_dispatch.integrations.transformers._config import attn_configs_for
from attn_dispatch.integrations.transformers._config import has_sinks
from attn_dispatch.integrations.transformers._config import layer_groups
from attn_dispatch.integrations.transformers._masks import _real_mask
from attn_dispatch.integrations.transformers._masks import _refuse_inner_padding
from attn_dispatch.integrations.transformers._masks import dispatch_mask
from attn_dispatch.integrations.transformers._view import _VIEW
from attn_dispatch.integrations.transformers._view import DenseView
from attn_dispatch.integrations.transformers._view import _ModelMap


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Bound:
    """What ``use`` did to one model; ``remove()`` undoes it."""

    model: Any
    binding: Binding
    previous_implementation: str | None
    original_forward: Callable[..., Any]
    page_size: int = DEFAULT_PAGE_SIZE
    paged: bool = True  # K/V live in a PagedCache (False: DeepSeek-V3's latent cache, copied)
    # The forward's cache argument: "cache" (transformers 5.24) or "past_key_values" (5.19).
    cache_arg: str = "cache"

    @property
    def attn_binding(self) -> Binding:
        return self.binding

    def new_cache(self, max_length: int | None = None) -> PagedCache:
        """An empty ``PagedCache`` for this model (``use()`` makes one by itself for
        ``generate`` and for forwards that ask for a cache)::

            cache = bound.new_cache()
            model(input_ids=ids, cache=cache, use_cache=True)
        """
        if not self.paged:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} caches a latent that its attention expands after "
                "the cache update; it is served on transformers' DynamicCache (copied into "
                "one-token pages per forward), not on a PagedCache"
            )
        mapped: _ModelMap = self.model.__dict__["_attn_dispatch_map"]
        kv_dtype = next(iter(mapped.configs.values())).kv_dtype
        kv_dtype = kv_dtype if kv_dtype in FP8_MAX else None  # else the model's own dtype
        return PagedCache(
            self.model,
            layer_groups(self.model.config),
            mapped.window,
            page_size=self.page_size,
            kv_dtype=kv_dtype,
            max_length=max_length,
            chunk=mapped.chunk,
        )

    def remove(self) -> None:
        """Restore the model's own forward and attention implementation."""
        for name in _INSTANCE_ATTRIBUTES:
            self.model.__dict__.pop(name, None)
        if self.previous_implementation is not None:
            self.model.set_attn_implementation(self.previous_implementation)


# What use() sets on the model instance (remove() takes each away).
_INSTANCE_ATTRIBUTES = (
    "forward",
    "attn_binding",
    "attn_dispatch",
    "_attn_dispatch_map",
    "_prepare_cache_for_generation",
    "generate_batch",
    "init_continuous_batching",
    "continuous_batching_context_manager",
)


def table_specs(
    value: Mapping[str, Any], label: str | None
) -> BackendSpec | dict[str, BackendSpec]:
    """``{"table": path, "label": ..., "on_stale": ...}``: the spec(s) a saved dispatch table
    holds for the runner (``label`` defaults to ``use``'s label), checked against this
    environment (``StaleTableError`` names what changed)."""
    from attn_dispatch.dispatch_table import spec_from_table

    unknown = sorted(str(k) for k in value if k not in ("table", "label", "on_stale"))
    if unknown:
        raise InvalidSpecError(
            "spec", dict(value), f"a table spec takes 'table', 'label', 'on_stale'; not {unknown!r}"
        )
    return spec_from_table(
        value["table"], label=value.get("label", label), on_stale=value.get("on_stale", "raise")
    )


def use(
    model: Any,
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    *,
    label: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    kv_dtype: str | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
) -> Bound:
    """Make ``model`` (a transformers ``PreTrainedModel``) dispatch through ``spec``::

        bound = use(model, "prefill=torch,decode=native", label="target")
        model.generate(**inputs)        # every forward inside attn_scope(bound, batch)
        bound.remove()                  # back to the model's own attention
        use(gemma2, "torch", kv_dtype="float8_e4m3fn")   # sliding + full groups, FP8 pages

    The model's cache becomes a ``PagedCache``: each layer writes its new tokens into pages of
    ``page_size`` tokens and attention reads them in place. A model whose layers differ
    (sliding and full: Gemma 2/3, Cohere 2, gpt-oss, Qwen2 with ``use_sliding_window``) gets
    one grouped binding ``{"sliding": ..., "full": ...}``; ``spec`` may then be a mapping
    group -> spec. ``spec`` may name a saved dispatch table, ``{"table": "t.json"}``
    (``tune --save``; runner ``label``, or ``"label": ...``): a stale one is refused with
    ``StaleTableError`` naming what changed. ``kv_dtype`` (``"float8_e4m3fn"``/
    ``"float8_e5m2"``) stores K and V in FP8 pages, each layer with scales ``amax / FP8_MAX``
    fixed at the prefill.

    Raises ``IncompatibleBackendError`` (every reason) when the spec cannot serve the model,
    ``UnsupportedModelError`` for models this mapping would get wrong.
    """
    if "attn_dispatch" in model.__dict__:
        raise UnsupportedModelError(
            f"model {type(model).__name__} is already bound "
            f"({model.__dict__['attn_dispatch'].binding!r}); call .remove() on the object "
            "use() returned before binding it again"
        )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidSpecError("page_size", page_size, "expected an int >= 1 (default 16)")
    # DeepSeek-V3 caches its compressed latent and expands it to K/V after the cache update:
    # its attention needs dense latents, so it stays on transformers' cache (copied per forward).
    paged = not any(hasattr(m, "expand_kv") for m in model.modules())
    configs = attn_configs_for(
        model.config,
        dtype=model.dtype,
        device=model.device,
        page_size=page_size if paged else 1,
        sinks=has_sinks(model),
        kv_dtype=kv_dtype,
    )
    grouped = len(configs) > 1
    if isinstance(spec, Mapping) and "table" in spec:
        spec = table_specs(spec, label)
    target: AttnConfig | dict[str, AttnConfig] = configs
    if not grouped:
        ((only, target),) = configs.items()
        if isinstance(spec, Mapping):
            if only not in spec:
                raise InvalidSpecError(
                    "spec",
                    dict(spec),
                    f"this model has one group, {only!r}: name it or pass one spec",
                )
            spec = spec[only]
    binding = bind(spec, target, label=label, options=options)
    sliding = configs.get(GROUP_SLIDING)
    window = None if sliding is None or sliding.window_left is None else sliding.window_left + 1
    chunked = configs.get(GROUP_CHUNKED)
    chunk = None if chunked is None else chunked.attention_chunk_size
    mapped = _ModelMap(configs, grouped, window, chunk, tuple(layer_groups(model.config)))
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    original = model.forward
    signature = inspect.signature(original)
    cache_arg = "cache" if "cache" in signature.parameters else "past_key_values"
    bound = Bound(model, binding, previous, original, page_size, paged, cache_arg)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            call = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # transformers' own error for a bad call
        named = _named(call)
        _refuse_options(named, model)
        cache = named.get(cache_arg, named.get("past_key_values"))
        use_cache = named.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(model.config, "use_cache", True))
        if not paged or (cache is None and not use_cache):
            view = _view_for(signature, args, kwargs, mapped)
            return _run_dense(view, binding, original, args, kwargs)
        b, q, real, device = _real_mask(named, cache)
        _refuse_inner_padding(real, mapped)
        paged_cache = _paged_cache_for(bound, cache, real, q, device)
        if paged_cache is not cache:
            extra = call.arguments.get("kwargs")
            if cache_arg == "cache" and isinstance(extra, dict):
                extra.pop("past_key_values", None)  # the deprecated name of the same argument
            call.arguments[cache_arg] = paged_cache
            if "use_cache" in signature.parameters:
                call.arguments["use_cache"] = True
        step = paged_cache.begin(real, q, device)
        view = DenseView(
            None, b, q, paged_cache.dense_len + q, step.q_rows, mapped, step, paged_cache
        )
        token = _VIEW.set(view)
        try:
            if not step.batches:
                out = original(*call.args, **call.kwargs)
            else:
                batch: Any = (
                    GroupedBatches(step.phase, step.batches)
                    if grouped
                    else next(iter(step.batches.values()))
                )
                step.takes_out = _takes_out(binding, step.phase, step.batches, grouped)
                with attn_scope(binding, batch):
                    out = original(*call.args, **call.kwargs)
        except BaseException:
            paged_cache.abort()
            raise
        finally:
            _VIEW.reset(token)
        paged_cache.commit(step)
        return out

    def prepare_cache(*args: Any, **kwargs: Any) -> Any:
        return _prepare_generation_cache(bound, args, kwargs)

    def no_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            f"transformers' continuous batching (generate_batch, cache_implementation='paged') "
            f"runs its own paged cache and accepts only its own attention implementations; "
            f"a model bound by {IMPLEMENTATION}.use() is not served by it. Choices: "
            "model.generate(...) with a padded batch, or bound.remove() first"
        )

    # Instance attributes: nn.Module.__call__ finds this forward; attn_binding makes the model
    # itself a runner (attn_scope(model) works too).
    object.__setattr__(model, "forward", forward)
    object.__setattr__(model, "attn_binding", binding)
    object.__setattr__(model, "attn_dispatch", bound)
    object.__setattr__(model, "_attn_dispatch_map", mapped)
    object.__setattr__(model, "_prepare_cache_for_generation", prepare_cache)
    for name in (
        "generate_batch",
        "init_continuous_batching",
        "continuous_batching_context_manager",
    ):
        object.__setattr__(model, name, no_continuous_batching)
    return bound


# ---------------------------------------------------------------------------------------------
# Per forward: the cache and the batch


def _named(call: inspect.BoundArguments) -> dict[str, Any]:
    named = dict(call.arguments)
    extra = named.get("kwargs")
    if isinstance(extra, dict):
        named = {**extra, **named}
    return named


def _refuse_options(named: dict[str, Any], model: Any) -> None:
    if named.get("output_attentions") or getattr(model.config, "output_attentions", False):
        raise UnsupportedModelError(
            "output_attentions=True: paged attention kernels return no attention weights; "
            f"{IMPLEMENTATION!r} cannot give them. Choices: leave output_attentions off, or "
            "bound.remove() and use transformers' eager attention for that call"
        )


def _takes_out(
    binding: Binding, phase: Phase, batches: Mapping[str, Any], grouped: bool
) -> dict[str, bool]:
    """Per group: whether the backend serving this forward's batch declares
    ``Capabilities.out_buffer`` (a shape bucket's own backend for a bucketed spec)."""
    takes = {}
    for name, batch in batches.items():
        served = (binding.groups[name] if grouped else binding).for_batch(batch)
        takes[name] = served.capabilities(served.backend_name(phase)).out_buffer
    return takes


def _run_dense(
    view: DenseView,
    binding: Binding,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    token = _VIEW.set(view)
    try:
        if view.batch is None:
            return original(*args, **kwargs)
        with attn_scope(binding, view.batch):
            return original(*args, **kwargs)
    finally:
        _VIEW.reset(token)


def _paged_cache_for(
    bound: Bound, cache: Any, real: torch.Tensor, q: int, device: Any
) -> PagedCache:
    """The PagedCache this forward runs on: the one passed, a new one, or a DynamicCache
    converted once. Every other cache is refused with the reason."""
    from transformers.cache_utils import DynamicCache
    from transformers.cache_utils import DynamicLayer

    model = bound.model
    if isinstance(cache, PagedCache):
        if cache.owner is not model:
            raise UnsupportedModelError(
                f"this PagedCache belongs to another model ({type(cache.owner).__name__} at "
                f"{id(cache.owner):#x}); each model (a target and its assistant) keeps its own"
            )
        return cache
    if cache is None:
        return bound.new_cache()
    name = type(cache).__name__
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        raise UnsupportedModelError(
            f"a {name} cannot be served: {IMPLEMENTATION!r} keeps K/V in its own pages "
            "(PagedCache). Choices: pass no cache (generate and use_cache=True make a "
            "PagedCache), an empty or full DynamicCache (converted once), or bound.new_cache()"
        )
    if getattr(cache, "_attn_dispatch_converted", False):
        raise UnsupportedModelError(
            "this DynamicCache was converted into a PagedCache by an earlier forward and is "
            "not updated any more; continue with that forward's output.past_key_values"
        )
    past = real.shape[1] - q
    paged = bound.new_cache()
    if past:
        layers = cache.layers
        short = [
            i
            for i, layer in enumerate(layers)
            if not isinstance(layer, DynamicLayer)
            or layer.keys is None
            or int(layer.keys.shape[-2]) != past
        ]
        if len(layers) != len(paged.layers) or short:
            raise UnsupportedModelError(
                f"this DynamicCache cannot be converted: layers {short or 'count'} do not hold "
                f"all {past} cached positions (a sliding layer past its window keeps only the "
                "window). Choices: start from no cache, or convert before the window fills"
            )
        dense = [(la.keys, la.values) for la in layers]  # type: ignore[union-attr]
        paged.fill(real[:, :past], dense, device)  # type: ignore[arg-type]
        if any(getattr(layer, "record_past", False) for layer in layers):
            paged.activate_past_recording()
    object.__setattr__(cache, "_attn_dispatch_converted", True)
    return paged


def _prepare_generation_cache(bound: Bound, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``generate``'s cache set-up for a bound model: a PagedCache sized for ``max_length``."""
    model = bound.model
    original = type(model)._prepare_cache_for_generation
    call = inspect.signature(original).bind(model, *args, **kwargs)
    config = call.arguments["generation_config"]
    model_kwargs = call.arguments["model_kwargs"]
    implementation = getattr(config, "cache_implementation", None)
    if implementation not in (None, "dynamic"):
        raise UnsupportedModelError(
            f"cache_implementation={implementation!r}: a model bound by {IMPLEMENTATION}.use() "
            "runs on its own paged cache (PagedCache), which is dynamic; static, offloaded and "
            "quantized caches are not served. Choices: leave cache_implementation unset"
        )
    if not bound.paged or model_kwargs.get(bound.cache_arg) is not None:
        return original(model, *args, **kwargs)  # a user's cache: the forward converts it
    if config.use_cache is False or not model._supports_default_dynamic_cache():
        return None
    cache = bound.new_cache(max_length=int(call.arguments["max_cache_length"]))
    model_kwargs[bound.cache_arg] = cache
    if getattr(config, "is_assistant", False):
        cache.activate_past_recording()
    return None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, dispatch_mask)
    _registered = True


Bound.__module__ = _PUBLIC_MODULE
