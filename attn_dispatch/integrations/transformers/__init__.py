"""Run a Hugging Face transformers model's attention through an attn_dispatch binding::

    from attn_dispatch.integrations.transformers import use
    bound = use(model, "torch", label="target")     # model.generate(...) now dispatches per call

``use`` binds ``spec`` to one ``AttnConfig`` per attention group of the model config, registers
one attention function AND its mask function under the implementation name
``"attn_dispatch"``, switches the model to it and wraps its ``forward`` so that every forward
runs inside its own ``attn_scope``. The model's cache becomes a ``PagedCache``: each layer
writes its new tokens into pages and attention reads them in place.

Supported: decoder-only models with full, sliding-window and chunked attention layers and a
``DynamicCache`` (or no cache): Llama, Qwen2 (with or without sliding layers), Mistral,
Gemma 2, Gemma 3 (text), Cohere 2, gpt-oss, Llama 4 (text), DeepSeek-V3 (the non-absorbed
192/128 q/k vs v form, on the dense path). Generation modes: greedy, sampling, beam search
(``reorder_cache``) and assisted generation (``crop``), FP8 pages included.

One module per concept, each importing only those before it:

- ``_common``: the implementation name, group names, FP8 limits, ``UnsupportedModelError``;
- ``_config``: reading a model config (``layer_groups``, ``attn_configs_for``, ``has_sinks``);
- ``_allocator``: page numbers of the paged cache (``PageGroup``);
- ``_layer``: one layer's page pools, its writes and page moves (``PagedLayer``);
- ``_buffers``: the layers' reused attention outputs (``OutBuffers``, ``attention(out=)``);
- ``_cache``: the transformers ``Cache`` over the layers' pools (``PagedCache``);
- ``_view``: what one forward tells the registered functions (``DenseView``);
- ``_masks``: the 2-D padding mask and the registered mask function (``dispatch_mask``);
- ``_attention``: the registered attention function, paged and dense paths;
- ``_use``: ``use()`` and ``Bound``.
"""

from __future__ import annotations

from attn_dispatch.integrations.transformers._attention import attention_forward
from attn_dispatch.integrations.transformers._cache import GroupedBatches
from attn_dispatch.integrations.transformers._cache import PagedCache
from attn_dispatch.integrations.transformers._common import DEFAULT_PAGE_SIZE
from attn_dispatch.integrations.transformers._common import FP8_MAX
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import GROUP_FULL
from attn_dispatch.integrations.transformers._common import GROUP_SLIDING
from attn_dispatch.integrations.transformers._common import IMPLEMENTATION
from attn_dispatch.integrations.transformers._common import UnsupportedModelError
from attn_dispatch.integrations.transformers._config import attn_config_for
from attn_dispatch.integrations.transformers._config import attn_configs_for
from attn_dispatch.integrations.transformers._config import has_sinks
from attn_dispatch.integrations.transformers._config import layer_groups
from attn_dispatch.integrations.transformers._layer import PagedLayer
from attn_dispatch.integrations.transformers._masks import dispatch_mask
from attn_dispatch.integrations.transformers._use import Bound
from attn_dispatch.integrations.transformers._use import use
from attn_dispatch.integrations.transformers._view import DenseView

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "FP8_MAX",
    "GROUP_CHUNKED",
    "GROUP_FULL",
    "GROUP_SLIDING",
    "IMPLEMENTATION",
    "Bound",
    "DenseView",
    "GroupedBatches",
    "PagedCache",
    "PagedLayer",
    "UnsupportedModelError",
    "attention_forward",
    "attn_config_for",
    "attn_configs_for",
    "dispatch_mask",
    "has_sinks",
    "layer_groups",
    "use",
]
