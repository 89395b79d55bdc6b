"""``python -m attn_dispatch demo``: speculative decoding with two runners in one process.

A DeepSeek-style MLA target and a GQA MHA draft, each with its own ``AttnConfig``,
``BackendSpec``, binding and paged KV cache; the draft proposes a token tree, the target
verifies it in one forward, the output is checked against the target's own greedy decoding.

    $ python -m attn_dispatch demo
    $ python -m attn_dispatch demo --size tiny --target-spec torch --draft-spec native
    $ python -m attn_dispatch demo --legacy-global
    $ python -m attn_dispatch demo --shared-prefix 512 --batch 8   # one system prompt, shared

Modules: ``shapes`` (model sizes), ``values`` (options, a request, a run's statistics),
``layers`` (norm, rotary, MLP, FP8 storage, greedy/top-k, and ``PagedModel``: what both models
share), ``models`` (the MLA target, torch), ``draft`` (the GQA draft), ``runner`` (a runner:
model, paged cache, binding, its own dispatch record), ``engine`` (greedy and speculative
decoding, one function per step of a round; a shared prefix's pages), ``factory`` (sizes,
dtype, default backends), ``compare`` (decodings side by side; what a shared prefix saved),
``report`` (progress, the isolation check, the numbers), ``legacy`` (the old global-setting
pattern and its run, for ``--legacy-global``), ``cli`` (options and the run). Importing this
package does not import torch.
"""

from __future__ import annotations

from attn_dispatch.demo.cli import main
from attn_dispatch.demo.engine import speculative
from attn_dispatch.demo.engine import step
from attn_dispatch.demo.engine import target_greedy
from attn_dispatch.demo.factory import _binds
from attn_dispatch.demo.factory import build
from attn_dispatch.demo.factory import default_specs
from attn_dispatch.demo.factory import prompts_for
from attn_dispatch.demo.factory import sizes
from attn_dispatch.demo.values import DemoOptions
from attn_dispatch.demo.values import Request
from attn_dispatch.demo.values import Stats

__all__ = [
    "DemoOptions",
    "Request",
    "Stats",
    "_binds",
    "build",
    "default_specs",
    "main",
    "prompts_for",
    "sizes",
    "speculative",
    "step",
    "target_greedy",
]
