"""Run a Hugging Face transformers model's attention through an attn_dispatch binding.

    >>> from attn_dispatch.integrations.transformers import use
    >>> use(model, "torch", label="target")          # model.generate(...) now dispatches per call

``use`` binds ``spec`` to an ``AttnConfig`` derived from the model config and:

- registers one attention function AND its mask function under the implementation name
  ``"attn_dispatch"`` (``AttentionInterface`` / ``AttentionMaskInterface``). A custom attention
  name without a mask function makes transformers skip mask creation (``attention_mask=None``),
  which silently drops causal masking of multi-token steps; ours receives the mask request,
  accepts transformers' causal, sliding-window causal and chunked causal masks, refuses
  patterns it does not represent (bidirectional, packed sequences, custom or/and masks) and
  lets the attention function apply causality, the window and the chunks itself.
- switches the model to that implementation (``set_attn_implementation``) and wraps its
  ``forward`` so that every forward of this model runs inside its own ``attn_scope`` with an
  ``AttnBatch`` made for that forward. Two models (a target and its assistant) therefore use
  their own bindings even though they share the registered function.

The model's cache is a ``PagedCache`` (``_hf_cache``): ``use`` replaces the cache
``generate`` would make (``_prepare_cache_for_generation``) and the one a forward with
``use_cache`` would make, converts a passed ``DynamicCache`` once, and refuses other caches.
Each layer's ``cache.update`` writes the new tokens into pages and returns its page pools;
the attention function hands them to ``attention`` as they are (no copy of past K/V). Only
the real tokens of each row (its 2-D ``attention_mask``) are stored, so the queries of a row
are its real new tokens, its last real tokens: the contract's causal, bottom-right aligned
rule is exactly transformers' causal + padding mask. Padding query rows return zeros.

Without a cache (``use_cache=False``) and for DeepSeek-V3 (whose attention expands a cached
latent after the update, so it needs dense latents) the dense path remains: keys/values of
one layer arrive as ``[B, Hkv, S, D]`` and are laid out as pages of ONE token
(``page_size=1``), token ``t`` of row ``b`` being page ``b * S + t``.

Phase from the shapes: no cached tokens -> PREFILL; one new token on a cache -> DECODE;
several new tokens on a cache (assisted generation's candidate check) -> VERIFY.

Layer variants: a sliding layer (``config.layer_types`` or, without it, ``sliding_window``)
gets ``window_left = sliding_window - 1``; ``attn_logit_softcapping`` is every layer's
``logit_cap``; attention modules holding ``sinks`` (gpt-oss, passed as ``s_aux``) make
``sinks=True``. A model with both kinds of layer gets one grouped binding (``"sliding"``,
``"full"``), each layer passing ``group=``; each group gets its own page tables and batch
(a sliding group keeps only its window's pages). On the dense path a sliding layer's
``DynamicSlidingWindowLayer`` returns only the window's keys (a suffix of the sequence):
they are placed at their positions in the same one-token pages.

Chunked layers (Llama 4's ``"chunked_attention"``) form the group ``"chunked"`` with
``attention_chunk_size = config.attention_chunk_size``: transformers starts a row's chunks
after its left padding, the contract at the request's first key, so both agree (padding
inside a row is refused, as for windows). The layer passes nothing that says it is chunked:
its ``layer_idx`` names its group, and the forward must have asked for the chunked mask. The
chunked group frees the pages before the next query's chunk in whole chunks (its positions
then shift by whole chunks, so the chunk boundaries stay put).

Supported: decoder-only models with full, sliding-window and chunked attention layers and a
``DynamicCache`` (or no cache): Llama, Qwen2 (with or without sliding layers), Mistral,
Gemma 2, Gemma 3 (text), Cohere 2, gpt-oss, Llama 4 (text), DeepSeek-V3 (the non-absorbed
192/128 q/k vs v form, on the dense path). The 2-D mask is read on the host once per forward.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attention
from attn_dispatch._scope import attn_scope
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations._hf_cache import DEFAULT_PAGE_SIZE
from attn_dispatch.integrations._hf_cache import FP8_MAX
from attn_dispatch.integrations._hf_cache import GroupedBatches
from attn_dispatch.integrations._hf_cache import PagedCache
from attn_dispatch.integrations._hf_cache import UnsupportedModelError
from attn_dispatch.integrations._hf_cache import _Step

if TYPE_CHECKING:
    # typing.Unpack and NotRequired are Python 3.11+; the package supports 3.10.
    from typing_extensions import NotRequired
    from typing_extensions import TypedDict
    from typing_extensions import Unpack

    class ConfigOptions(TypedDict):
        """The keywords of ``attn_configs_for`` (``attn_config_for`` passes them on)."""

        dtype: Any
        device: Any
        page_size: NotRequired[int]
        tree_verify: NotRequired[bool]
        sinks: NotRequired[bool]
        kv_dtype: NotRequired[str | None]


IMPLEMENTATION = "attn_dispatch"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DenseView:
    """How one forward's dense tensors map onto its ``AttnBatch``."""

    batch: AttnBatch | None  # None when no row has a real query token
    batch_size: int
    q_len: int
    kv_len: int  # dense key length S (cached + new)
    q_rows: torch.Tensor  # int64: rows of the flattened [B * q_len] queries that are real
    model: _ModelMap | None = None  # the bound model's groups (None: a DenseView made by hand)
    step: _Step | None = None  # the paged cache's plan of this forward (None: dense K/V)
    cache: PagedCache | None = None
    # The mask kinds transformers asked for in this forward (a chunked layer needs "chunked":
    # its attention call itself carries no sign of the pattern the model meant).
    asked: set[str] = dataclasses.field(default_factory=set)
    # The dense path with a bound page size P > 1 (a paged model run with use_cache=False):
    # int64 [pages * P], the dense token row [B * S] that lands in each page slot; None for
    # pages of one token (row b * S + t is page b * S + t).
    slots: torch.Tensor | None = None
    page_size: int = 1


_VIEW: contextvars.ContextVar[DenseView | None] = contextvars.ContextVar(
    "attn_dispatch.transformers.view", default=None
)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Bound:
    """What ``use`` did to one model; ``remove()`` undoes it."""

    model: Any
    binding: Binding
    previous_implementation: str | None
    original_forward: Callable[..., Any]
    page_size: int = DEFAULT_PAGE_SIZE
    paged: bool = True  # K/V live in a PagedCache (False: DeepSeek-V3's latent cache, copied)

    @property
    def attn_binding(self) -> Binding:
        return self.binding

    def new_cache(self, max_length: int | None = None) -> PagedCache:
        """An empty ``PagedCache`` for this model (``use()`` makes one by itself for
        ``generate`` and for forwards that ask for a cache).

        >>> cache = bound.new_cache()
        >>> model(input_ids=ids, cache=cache, use_cache=True)
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
GROUP_CHUNKED = "chunked"
GROUP_FULL = "full"
GROUP_SLIDING = "sliding"
_LAYER_GROUPS = {
    "chunked_attention": GROUP_CHUNKED,
    "full_attention": GROUP_FULL,
    "sliding_attention": GROUP_SLIDING,
}


def layer_groups(config: Any) -> list[str]:
    """The attention group (``"full"``, ``"sliding"`` or ``"chunked"``) of every layer of a
    model config.

    From ``config.layer_types`` when present (Gemma 2/3, Cohere 2, gpt-oss, Qwen2, Llama 4's
    ``"chunked_attention"``/``"full_attention"``), otherwise every layer is sliding when
    ``config.sliding_window`` is set (Mistral) and full if not.

    >>> layer_groups(llama4_text_config)[:4]
    ['chunked', 'chunked', 'chunked', 'full']
    """
    config = _text_config(config)
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(
        config, "is_causal", True
    ):
        raise UnsupportedModelError(
            f"model type {model_type!r} uses bidirectional attention; {IMPLEMENTATION!r} serves "
            "causal decoders only. Choices: keep transformers' own attention for this model"
        )
    types = getattr(config, "layer_types", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise UnsupportedModelError(
            f"model type {model_type!r}: num_hidden_layers={layers!r}; expected an int >= 1"
        )
    if not types:
        sliding = getattr(config, "sliding_window", None) is not None
        return [GROUP_SLIDING if sliding else GROUP_FULL] * layers
    if len(types) != layers:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layer_types lists {len(types)} layers but "
            f"num_hidden_layers={layers}; transformers cannot tell each layer's kind either. "
            "Choices: fix the config so that both agree"
        )
    other = sorted({t for t in types if t not in _LAYER_GROUPS})
    if other:
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers of type {other!r}; {IMPLEMENTATION!r} serves "
            f"{sorted(_LAYER_GROUPS)!r} layers only (linear, recurrent and other attention "
            "kinds are not mapped onto the paged contract). Choices: keep transformers' own "
            "attention"
        )
    return [_LAYER_GROUPS[t] for t in types]


def attn_configs_for(
    config: Any,
    *,
    dtype: Any,
    device: Any,
    page_size: int = 1,
    tree_verify: bool = False,
    sinks: bool = False,
    kv_dtype: str | None = None,
) -> dict[str, AttnConfig]:
    """One ``AttnConfig`` per attention group the model has (``"full"``, ``"sliding"``,
    ``"chunked"``).

    Llama/Qwen2: ``head_dim`` (or hidden / heads), GQA ``num_key_value_heads``. DeepSeek-V3:
    q/k ``qk_nope_head_dim + qk_rope_head_dim`` and v ``v_head_dim`` per head, the latent
    expanded to every head before attention (so KV heads = query heads). Sliding layers get
    ``window_left = sliding_window - 1`` (transformers' window counts the query itself),
    every layer ``logit_cap = attn_logit_softcapping`` (Gemma 2) and ``sinks`` when the
    attention modules hold learned sinks (gpt-oss). Chunked layers (Llama 4) get
    ``attention_chunk_size = config.attention_chunk_size``: transformers' chunked mask counts
    positions from a row's first real token, as the contract counts a request's keys.

    >>> attn_configs_for(gemma2.config, dtype=torch.float32, device="cpu")["sliding"].window_left
    """
    groups = layer_groups(config)
    config = _text_config(config)
    try:
        shape = _shape_of(config, groups)
    except (AttributeError, TypeError, ValueError) as err:
        if isinstance(err, AttnDispatchError):
            raise
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r}: its config cannot be read as "
            f"one attention shape per group ({type(err).__name__}: {err})"
        ) from err
    base = AttnConfig(
        kind="mha",
        num_q_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        v_head_dim=shape.v_head_dim,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=kv_dtype,
        page_size=page_size,
        device=str(device),
        tree_verify=tree_verify,
        logit_cap=shape.cap,
        sinks=sinks,
    )
    out: dict[str, AttnConfig] = {}
    for group in groups:
        if group not in out:
            left = shape.window - 1 if group == GROUP_SLIDING and shape.window else None
            size = shape.chunk if group == GROUP_CHUNKED else None
            out[group] = dataclasses.replace(base, window_left=left, attention_chunk_size=size)
    return out


def _text_config(config: Any) -> Any:
    """The decoder's config; heterogeneous (per-layer) configs are refused by name."""
    try:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception as err:  # transformers' own error for a config it cannot split
        raise UnsupportedModelError(
            f"transformers cannot read this model's text config ({type(err).__name__}: {err})"
        ) from err
    per_layer = set(getattr(config, "per_layer_attributes", None) or ())
    varying = sorted(per_layer & _ATTENTION_FIELDS)
    if varying:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} sets {varying!r} per layer "
            "(per_layer_config): its layers' attention shapes or windows differ in ways one "
            f"binding per group cannot express; {IMPLEMENTATION!r} serves models whose "
            "attention fields are global. Choices: keep transformers' own attention"
        )
    return config


# The config fields the attention mapping reads: a heterogeneous config may vary others.
_ATTENTION_FIELDS = frozenset(
    {
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "sliding_window",
        "layer_types",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
        "is_causal",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "attention_chunk_size",
        "use_sliding_window",
        "max_window_layers",
    }
)


class _Shape(NamedTuple):
    """What the attention mapping reads from a model config."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    cap: float | None  # attn_logit_softcapping (None: off)
    window: int | None  # sliding_window, checked when some layer slides
    chunk: int | None  # attention_chunk_size, checked when some layer is chunked


def _shape_of(config: Any, groups: list[str]) -> _Shape:
    heads = int(config.num_attention_heads)
    if getattr(config, "qk_nope_head_dim", None) is not None:
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        v_head_dim = int(config.v_head_dim)
        kv_heads = heads
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        v_head_dim = head_dim
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    cap = getattr(config, "attn_logit_softcapping", None)
    window = getattr(config, "sliding_window", None)
    if GROUP_SLIDING not in groups:
        window = None
    elif not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has sliding layers but "
            f"sliding_window={window!r}; expected an int >= 1"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if GROUP_CHUNKED not in groups:
        chunk = None
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has 'chunked_attention' layers "
            f"but attention_chunk_size={chunk!r}; expected an int >= 1"
        )
    return _Shape(
        heads,
        kv_heads,
        head_dim,
        v_head_dim,
        float(cap) if cap else None,
        window,
        chunk,
    )


def attn_config_for(
    config: Any, *, group: str | None = None, **options: Unpack[ConfigOptions]
) -> AttnConfig:
    """The ``AttnConfig`` of one attention group of a transformers model config (``group``
    may be left out when every layer is alike); ``options`` are ``attn_configs_for``'s.

    >>> attn_config_for(llama.config, dtype=torch.bfloat16, device="cpu", page_size=16)
    """
    configs = attn_configs_for(config, **options)
    if group is None and len(configs) == 1:
        return next(iter(configs.values()))
    if group not in configs:
        raise UnsupportedModelError(
            f"group {group!r} is not one of this model's attention groups {sorted(configs)!r}"
        )
    return configs[group]


def _has_sinks(model: Any) -> bool:
    # gpt-oss keeps one learned sink logit per head on each attention module (``sinks``) and
    # passes it as ``s_aux``; no config field says so.
    return any(
        isinstance(getattr(m, "sinks", None), torch.Tensor)
        for m in model.modules()
        if hasattr(m, "sinks")
    )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ModelMap:
    """What the per-call functions need to know about one bound model."""

    configs: dict[str, AttnConfig]
    grouped: bool  # several groups: each layer passes group= to attention()
    window: int | None  # transformers' sliding_window (W) when some layer slides
    chunk: int | None = None  # attention_chunk_size when some layer is chunked (Llama 4)
    layers: tuple[str, ...] = ()  # each layer's group, by layer_idx

    def positional(self) -> str | None:
        """What makes the contract's positions (a request's real tokens) and transformers'
        (the row's columns) differ when padding sits inside a row: None if nothing does."""
        if self.window is not None:
            return f"a sliding window (sliding_window={self.window!r})"
        if self.chunk is not None:
            return f"chunked attention (attention_chunk_size={self.chunk!r})"
        return None


def use(
    model: Any,
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    *,
    label: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    kv_dtype: str | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
) -> Bound:
    """Make ``model`` (a transformers ``PreTrainedModel``) dispatch through ``spec``.

    >>> bound = use(model, "prefill=torch,decode=native", label="target")
    >>> model.generate(**inputs)        # every forward inside attn_scope(bound, batch)
    >>> bound.remove()                  # back to the model's own attention
    >>> use(gemma2, "torch", kv_dtype="float8_e4m3fn")   # sliding + full groups, FP8 pages

    The model's cache becomes a ``PagedCache``: each layer writes its new tokens into pages of
    ``page_size`` tokens and attention reads them in place. A model whose layers differ
    (sliding and full: Gemma 2/3, Cohere 2, gpt-oss, Qwen2 with ``use_sliding_window``) gets
    one grouped binding ``{"sliding": ..., "full": ...}``; ``spec`` may then be a mapping
    group -> spec. ``kv_dtype`` (``"float8_e4m3fn"``/``"float8_e5m2"``) stores K and V in FP8
    pages, each layer with scales ``amax / FP8_MAX`` fixed at the prefill.

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
        sinks=_has_sinks(model),
        kv_dtype=kv_dtype,
    )
    grouped = len(configs) > 1
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
    bound = Bound(model, binding, previous, original, page_size, paged)

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


def _real_mask(named: dict[str, Any], cache: Any) -> tuple[int, int, torch.Tensor, Any]:
    """(batch, new tokens, bool [B, cached + new] real-token mask on the host, device)."""
    ids = named.get("input_ids")
    embeds = named.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None:
        raise UnsupportedModelError("a forward needs input_ids or inputs_embeds")
    b, q = int(ref.shape[0]), int(ref.shape[1])
    past = 0
    if cache is not None:
        try:
            past = int(cache.get_seq_length())
        except Exception as err:  # a cache object that is no transformers Cache
            raise UnsupportedModelError(
                f"cache of type {type(cache).__name__} cannot say its length ({err})"
            ) from err
    s = past + q
    mask = named.get("attention_mask")
    if mask is None:
        return b, q, torch.ones(b, s, dtype=torch.bool), ref.device
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise UnsupportedModelError(
            "attention_mask must be the 2-D padding mask [batch, cached + new] "
            f"(got {type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}); "
            "prepared 4-D masks cannot be mapped onto per-request kv ranges"
        )
    real = mask.detach().to("cpu", torch.bool)
    if tuple(real.shape) != (b, s):
        raise UnsupportedModelError(
            f"attention_mask has shape {tuple(real.shape)} but the cache holds {past} positions "
            f"and the forward adds {q} for {b} rows (= {(b, s)}); pass the mask of the whole "
            "sequence"
        )
    return b, q, real, ref.device


def _refuse_inner_padding(real: torch.Tensor, mapped: _ModelMap) -> None:
    # transformers windows absolute positions (padding included) and starts chunks after a
    # row's left padding only, the contract counts the request's own tokens: the same keys
    # only when a row's real tokens are contiguous.
    what = mapped.positional()
    if what is None:
        return
    counts = real.sum(dim=1)
    idx = torch.arange(real.shape[1])
    first = torch.where(real, idx, real.shape[1]).amin(dim=1)
    last = torch.where(real, idx, -1).amax(dim=1)
    bad = torch.nonzero((counts > 0) & (last - first + 1 != counts)).flatten().tolist()
    if bad:
        raise UnsupportedModelError(
            f"row {bad[0]} of attention_mask has padding between real tokens; {what} is "
            "served with left padding only (transformers counts positions, padding inside a "
            "row included). Choices: left-pad"
        )


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
    if not bound.paged or model_kwargs.get("cache") is not None:
        return original(model, *args, **kwargs)  # a user's cache: the forward converts it
    if config.use_cache is False or not model._supports_default_dynamic_cache():
        return None
    cache = bound.new_cache(max_length=int(call.arguments["max_cache_length"]))
    model_kwargs["cache"] = cache
    if getattr(config, "is_assistant", False):
        cache.activate_past_recording()
    return None


def _view_for(
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mapped: _ModelMap | None = None,
) -> DenseView:
    """The dense path (DeepSeek-V3's latent cache, or no cache): K/V copied into one-token
    pages per forward."""
    try:
        named = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        named = dict(kwargs)
    extra = named.get("kwargs")
    if isinstance(extra, dict):
        named = {**extra, **named}
    cache = named.get("cache", named.get("past_key_values"))
    if cache is not None and type(cache).__name__ != "DynamicCache":
        raise UnsupportedModelError(
            f"a {type(cache).__name__} cannot be served here: this model runs on "
            "transformers' DynamicCache (or no cache)"
        )
    b, q, real, device = _real_mask(named, cache)
    s = real.shape[1]
    past = s - q
    if mapped is not None:
        _refuse_inner_padding(real, mapped)
    phase = Phase.PREFILL if past == 0 else Phase.DECODE if q == 1 else Phase.VERIFY
    # The bound page size: 1 for the dense-only models (DeepSeek-V3), the model's page size
    # for a paged model run without a cache; its K/V are then gathered into pages of that size.
    ps = next(iter(mapped.configs.values())).page_size if mapped is not None else 1
    kv_lens, q_lens, tables, rows = [], [], [], []
    gather: list[int] = []
    for i in range(b):
        keys = torch.nonzero(real[i]).flatten()
        nq = int(real[i, s - q :].sum())
        if nq == 0:
            continue  # a row with no real new token: its outputs stay zero
        if ps == 1:
            tables.append((keys + i * s).tolist())
        else:
            first = len(gather) // ps
            n_pages = -(-int(keys.numel()) // ps)
            tables.append(list(range(first, first + n_pages)))
            # Slots past the row's keys repeat a real row: past kv_len, they are never read.
            tail = n_pages * ps - int(keys.numel())
            gather.extend((keys + i * s).tolist() + [i * s + int(keys[0])] * tail)
        kv_lens.append(int(keys.numel()))
        q_lens.append(nq)
        rows.extend((torch.nonzero(real[i, s - q :]).flatten() + i * q).tolist())
    batch = None
    slots = torch.tensor(gather, dtype=torch.long, device=device) if ps > 1 else None
    if q_lens:
        batch = AttnBatch.build(
            phase,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            page_size=ps,
            num_pages=b * s if ps == 1 else max(1, len(gather) // ps),
            device=device,
        )
    q_rows = torch.tensor(rows, dtype=torch.long, device=device)
    return DenseView(batch, b, q, s, q_rows, mapped, slots=slots, page_size=ps)


# ---------------------------------------------------------------------------------------------
# The functions transformers calls


def _current_view(what: str) -> DenseView:
    view = _VIEW.get()
    if view is None:
        raise NoActiveScopeError(
            f"transformers {what} for implementation {IMPLEMENTATION!r} outside a forward "
            "wrapped by attn_dispatch.integrations.transformers.use(model, spec)"
        )
    return view


def attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, q, D]`` in, ``[B, q, H, Dv]`` out.

    The layer's group is what the layer asks for: ``sliding_window`` set -> ``"sliding"``;
    a chunked layer (Llama 4 passes nothing that says so) by its ``layer_idx``;
    ``softcap`` and ``s_aux`` (gpt-oss sinks) must agree with the bound configs."""
    view = _current_view("attention")
    b, h, q, d = query.shape
    if dropout and getattr(module, "training", False):
        raise UnsupportedModelError("attention dropout in training is not served; use .eval()")
    group, extra = _layer_call(module, view, kwargs)
    if view.step is not None:
        return _paged_attention(module, query, key, value, scaling, view, group, extra), None
    s_layer, dv = key.shape[2], value.shape[-1]
    s = view.kv_len
    # A sliding layer's DynamicSlidingWindowLayer returns only the last keys (at least the
    # window before the first new token): a suffix of the sequence.
    shortest = s
    if group == GROUP_SLIDING and view.model is not None and view.model.window is not None:
        shortest = min(s, view.model.window - 1 + q)
    if (b, q) != (view.batch_size, view.q_len) or not shortest <= s_layer <= s:
        raise InvalidBatchError(
            "key",
            f"layer tensors (batch {b}, new {q}, keys {s_layer}) do not match the forward's "
            f"inputs (batch {view.batch_size}, new {view.q_len}, keys {s}); only a "
            "DynamicCache (or no cache) holding every past token (or, for sliding layers, "
            "every token of the window) is supported",
        )
    out = query.new_zeros(b * q, h, dv)
    if view.batch is not None:
        cfg = view.model.configs[group] if view.model is not None else None
        kv_dtype = cfg.kv_dtype if cfg is not None else None
        # Pages of one token: [B, Hkv, S, D] -> [B * S, 1, Hkv, D], contiguous (kernels such as
        # the native ones take row-major pages only; a copy unless the layout already is).
        k_cache, k_scale = _pages(key, s, kv_dtype, view.slots, view.page_size)
        v_cache, v_scale = _pages(value, s, kv_dtype, view.slots, view.page_size)
        if k_scale is not None:
            extra["k_scale"], extra["v_scale"] = k_scale, v_scale
        q_flat = query.transpose(1, 2).reshape(b * q, h, d)[view.q_rows].contiguous()
        scale = float(scaling) if scaling is not None else d**-0.5
        out[view.q_rows] = attention(q_flat, k_cache, v_cache, sm_scale=scale, **extra)
    return out.view(b, q, h, dv), None


def _paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    view: DenseView,
    group: str,
    extra: dict[str, Any],
) -> torch.Tensor:
    """Attention on the layer's pages, read in place: ``key``/``value`` are the page pools
    the PagedCache's ``update`` returned."""
    step, cache = view.step, view.cache
    assert step is not None and cache is not None
    idx = getattr(module, "layer_idx", None)
    layers = cache.paged_layers
    layer = layers[idx] if isinstance(idx, int) and 0 <= idx < len(layers) else None
    if layer is None or key is not layer.keys or value is not layer.values:
        raise InvalidBatchError(
            "key",
            f"layer {idx!r} handed attention K/V that are not its pages in the PagedCache "
            f"(shape {tuple(key.shape)}); the layer must pass what cache.update returned",
        )
    if layer.group.name != group:
        raise UnsupportedModelError(
            f"layer {idx}: asks for {group!r} attention, but the model config makes it a "
            f"{layer.group.name!r} layer"
        )
    if layer.k_scale is not None:
        extra["k_scale"], extra["v_scale"] = layer.k_scale, layer.v_scale
    b, h, q, d = query.shape
    dv = value.shape[-1]
    # [B, H, q, D] -> [B * q, H, D]: a view when q == 1 (the projections write [B, q, H, D]).
    q_flat = query.transpose(1, 2).reshape(b * q, h, d)
    if not step.all_real:
        q_flat = q_flat.index_select(0, step.q_rows)
    elif not q_flat.is_contiguous():
        q_flat = q_flat.contiguous()
    scale = float(scaling) if scaling is not None else d**-0.5
    if not step.batches:
        return query.new_zeros(b, q, h, dv)
    out: torch.Tensor = attention(q_flat, key, value, sm_scale=scale, **extra)
    if step.all_real:
        return out.view(b, q, h, dv)
    dense = query.new_zeros(b * q, h, dv)
    dense[step.q_rows] = out
    return dense.view(b, q, h, dv)


def _layer_call(module: Any, view: DenseView, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The group of the calling layer and the extra keywords of its ``attention`` call."""
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    group = GROUP_SLIDING if window is not None else GROUP_FULL
    mapped = view.model
    if window is None and mapped is not None and mapped.chunk is not None:
        # Llama 4's attention passes no sign of chunking (its mask carried it): the layer's
        # index says which group it is in.
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or not 0 <= idx < len(mapped.layers):
            raise UnsupportedModelError(
                f"a layer with layer_idx={idx!r} called attention, but the model config has "
                f"{len(mapped.layers)} layers; a model with chunked layers is served only "
                "when each attention module's layer_idx names its layer"
            )
        if mapped.layers[idx] == GROUP_CHUNKED:
            group = GROUP_CHUNKED
            if GROUP_CHUNKED not in view.asked:
                raise UnsupportedModelError(
                    f"layer {idx}: the model config makes it a chunked_attention layer, but "
                    "the model asked for no chunked mask in this forward; its code does not "
                    "chunk as the config says (only Llama 4's does). Choices: keep "
                    "transformers' own attention for this model"
                )
    if mapped is None:  # a DenseView made without use(): full attention, no variants
        if window is not None or cap or sinks is not None:
            raise UnsupportedModelError(
                "a layer asked for a window, a soft-cap or sinks outside use(model, spec)"
            )
        return group, {}
    cfg = mapped.configs.get(group)
    problem = None
    if cfg is None:
        problem = f"a {group!r} layer, but the model config has only {sorted(mapped.configs)!r}"
    elif window is not None and int(window) - 1 != cfg.window_left:
        problem = f"sliding_window={window!r}, but the config says {mapped.window!r}"
    elif (float(cap) if cap else None) != cfg.logit_cap:
        problem = f"softcap={cap!r}, but the config says {cfg.logit_cap!r}"
    elif (sinks is not None) != cfg.sinks:
        given = "given" if sinks is not None else "missing"
        problem = f"sinks (s_aux) {given}, but the config says sinks={cfg.sinks!r}"
    if problem is not None:
        raise UnsupportedModelError(
            f"layer {getattr(module, 'layer_idx', '?')!r}: {problem}; the binding was made from "
            "the model config and cannot serve a layer that differs from it"
        )
    extra: dict[str, Any] = {}
    if mapped.grouped:
        extra["group"] = group
    if sinks is not None:
        extra["sinks"] = sinks.detach().to(torch.float32)
    return group, extra


def _pages(
    x: torch.Tensor,
    s: int,
    kv_dtype: str | None,
    slots: torch.Tensor | None = None,
    page_size: int = 1,
) -> tuple[torch.Tensor, float | None]:
    """``[B, Hkv, S_layer, D]`` -> one-token pages ``[B * S, 1, Hkv, D]`` (and the FP8 scale),
    or, with ``slots``, pages of ``P`` tokens ``[len(slots) / P, P, Hkv, D]`` gathered from
    those rows (``DenseView.slots``).

    A sliding layer's suffix lands at its absolute positions; the positions before it are
    zeros that its window never reaches."""
    b, hkv, s_layer, d = x.shape
    fp8 = kv_dtype in FP8_MAX
    scale = None
    if fp8:
        limit = FP8_MAX[str(kv_dtype)]
        amax = float(x.detach().abs().amax()) if x.numel() else 0.0
        scale = amax / limit if amax > 0.0 and amax == amax else 1.0
        x = (x.float() / scale).clamp_(-limit, limit).to(getattr(torch, str(kv_dtype)))
    src = x.transpose(1, 2)
    if s_layer == s:
        rows = src.reshape(b * s, 1, hkv, d)
    else:
        rows = src.new_zeros(b, s, hkv, d)
        rows[:, s - s_layer :] = src
        rows = rows.view(b * s, 1, hkv, d)
    if slots is None:
        return rows.contiguous(), scale
    return rows[slots].view(-1, page_size, hkv, d), scale


def dispatch_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Any = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask-function signature. Returns None: the attention function applies
    causality, the window, the chunks and padding from the forward's batch. Accepts exactly
    transformers' causal mask and, for a model bound with sliding (chunked) layers, its
    sliding-window (chunked) causal mask of the config's width; refuses any other pattern."""
    from transformers.masking_utils import causal_mask_function

    window = _sliding_width(mask_function)
    chunk = _chunk_size(mask_function)
    if chunk is not None:
        return _chunked_mask(batch_size, q_length, kv_length, chunk, local_size)
    if mask_function is not None and mask_function is not causal_mask_function and window is None:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise UnsupportedModelError(
            f"the model asked for a mask pattern {name!r} beyond causal, sliding-window causal, "
            "chunked causal and padding (bidirectional, packed sequences or a custom overlay); "
            f"{IMPLEMENTATION!r} serves causal attention with an optional window or chunks "
            "and per-request padding only. Choices: keep transformers' own attention for this "
            "model"
        )
    view = _current_view("mask creation")
    bound_window = view.model.window if view.model is not None else None
    if window is not None and window != bound_window:
        raise UnsupportedModelError(
            f"the model asked for a sliding window of {window!r} tokens but was bound with "
            f"sliding_window={bound_window!r}"
        )
    if local_size is not None and local_size != window:
        raise UnsupportedModelError(f"local attention (size {local_size!r}) is not served")
    # A sliding layer's cache holds only the window's keys: its mask covers a suffix.
    shortest = view.kv_len if window is None else min(view.kv_len, window - 1 + view.q_len)
    if (batch_size, q_length) != (view.batch_size, view.q_len) or not (
        shortest <= kv_length <= view.kv_len
    ):
        raise InvalidBatchError(
            "attention_mask",
            f"mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not match the "
            f"forward's inputs (batch {view.batch_size}, q {view.q_len}, kv {view.kv_len})",
        )
    return None


def _chunked_mask(
    batch_size: int, q_length: int, kv_length: int, chunk: int, local_size: int | None
) -> None:
    """transformers' chunked causal mask (Llama 4): served when the model was bound with
    chunked layers of that size. Its chunks start after each row's left padding, the
    contract's at each request's first key: the same once inner padding is refused."""
    view = _current_view("mask creation")
    bound = view.model.chunk if view.model is not None else None
    if chunk != bound or local_size not in (None, chunk):
        raise UnsupportedModelError(
            f"the model asked for chunked attention of {chunk!r} tokens (local_size="
            f"{local_size!r}) but was bound with attention_chunk_size={bound!r}; "
            f"{IMPLEMENTATION!r} serves the chunk size the config names"
        )
    view.asked.add(GROUP_CHUNKED)
    if (batch_size, q_length, kv_length) != (view.batch_size, view.q_len, view.kv_len):
        raise InvalidBatchError(
            "attention_mask",
            f"chunked mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not "
            f"match the forward's inputs (batch {view.batch_size}, q {view.q_len}, kv "
            f"{view.kv_len})",
        )
    return None


def _cells(f: Any) -> dict[str, Any]:
    names = getattr(getattr(f, "__code__", None), "co_freevars", ())
    closure = getattr(f, "__closure__", None) or ()
    return {n: c.cell_contents for n, c in zip(names, closure, strict=False)}


def _overlay_cell(fn: Any, overlay: str, cell: str) -> Any:
    """The ``cell`` captured by ``overlay`` when ``fn`` is transformers' ``and_masks`` of that
    overlay and the causal function (how its sliding and chunked causal masks are built), else
    None."""
    from transformers.masking_utils import causal_mask_function

    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _cells(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", "") != f"{overlay}.<locals>.inner_mask":
        return None
    return _cells(parts[0]).get(cell)


def _chunk_size(fn: Any) -> int | None:
    """C when ``fn`` is transformers' ``chunked_causal_mask_function(C, left_padding)``."""
    size = _overlay_cell(fn, "chunked_overlay", "chunk_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _sliding_width(fn: Any) -> int | None:
    """W when ``fn`` is transformers' ``sliding_window_causal_mask_function(W)``."""
    width = _overlay_cell(fn, "sliding_window_overlay", "sliding_window")
    return width if isinstance(width, int) else None


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


__all__ = [
    "FP8_MAX",
    "GROUP_CHUNKED",
    "GROUP_FULL",
    "GROUP_SLIDING",
    "IMPLEMENTATION",
    "Bound",
    "DenseView",
    "PagedCache",
    "UnsupportedModelError",
    "attention_forward",
    "attn_config_for",
    "attn_configs_for",
    "dispatch_mask",
    "layer_groups",
    "use",
]
