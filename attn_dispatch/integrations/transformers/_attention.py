"""The attention function ``use()`` registers with transformers (``attention_forward``), with
its two paths.

Paged (a model with a ``PagedCache``): ``key``/``value`` are the layer's page pools, as the
cache's ``update`` returned them; they go to ``attention`` as they are (no copy of past K/V).
The queries of a row are its real new tokens (padding query rows return zeros).

Dense (no cache, ``use_cache=False``, and DeepSeek-V3, whose attention expands a cached latent
after the update, so it needs dense latents): keys/values of one layer arrive as
``[B, Hkv, S, D]`` and are laid out as pages of ONE token (``page_size=1``), token ``t`` of row
``b`` being page ``b * S + t`` (``_view_for`` builds that forward's batch); a paged model run
without a cache gathers them into pages of its bound page size. A sliding layer's
``DynamicSlidingWindowLayer`` returns only the window's keys (a suffix of the sequence): they
are placed at their positions.

Phase from the shapes: no cached tokens -> PREFILL; one new token on a cache -> DECODE;
several new tokens on a cache (assisted generation's candidate check) -> VERIFY.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attention
from attn_dispatch.integrations.transformers._common import FP8_MAX
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import GROUP_FULL
from attn_dispatch.integrations.transformers._common import GROUP_SLIDING
from attn_dispatch.integrations.transformers._common import UnsupportedModelError
from attn_dispatch.integrations.transformers._masks import _real_mask
from attn_dispatch.integrations.transformers._masks import _refuse_inner_padding
from attn_dispatch.integrations.transformers._view import DenseView
from attn_dispatch.integrations.transformers._view import _current_view
from attn_dispatch.integrations.transformers._view import _ModelMap


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
    # A backend without Capabilities.out_buffer would have its result copied into a buffer
    # (one more copy than returning it); autograd refuses out= on tensors that need grad.
    if not step.takes_out.get(group, False) or (query.requires_grad and torch.is_grad_enabled()):
        out: torch.Tensor = attention(q_flat, key, value, sm_scale=scale, **extra)
        if step.all_real:
            return out.view(b, q, h, dv)
        dense = query.new_zeros(b * q, h, dv)
        dense[step.q_rows] = out
        return dense.view(b, q, h, dv)
    # The backend writes into a buffer of the cache's pool (_buffers: reused only once nothing
    # else holds it, so a layer output transformers or autograd still keeps is never
    # overwritten; never q or the pages, which the core's out rule checks too). Every token
    # real: that buffer, viewed [B, q, H, Dv], is what transformers reshapes for o_proj, so
    # nothing is allocated or copied. With padding rows the real rows are not one contiguous
    # span of the dense output: the kernel writes them compactly, then they are scattered.
    bufs = cache.out_buffers
    rows = int(q_flat.shape[0])
    if step.all_real:
        out = bufs.take(rows, h, dv, query)
        attention(q_flat, key, value, sm_scale=scale, out=out, **extra)
        return out.view(b, q, h, dv)
    compact = bufs.take(rows, h, dv, query)
    attention(q_flat, key, value, sm_scale=scale, out=compact, **extra)
    dense = bufs.take(b * q, h, dv, query)
    assert step.pad_rows is not None
    dense.index_fill_(0, step.pad_rows, 0.0)
    dense.index_copy_(0, step.q_rows, compact)
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
