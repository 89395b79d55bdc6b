"""The SGLang classes of the integration (imports SGLang and torch; loaded by SGLang's factory).

- ``AttnDispatchSGLangBackend``: one SGLang ``AttentionBackend`` per runner (and per EAGLE
  draft-extend backend). ``init_forward_metadata`` turns SGLang's forward batch into one
  ``AttnBatch`` (per-request query rows and the request's token slots from
  ``req_to_token``, as pages of the token-to-KV pool); every layer's ``forward`` writes its K/V
  through the pool, then reads the pool's own K and V buffers in place as contract pages
  (``[slots / page_size, page_size, kv_heads, head_dim]``) inside
  ``attn_scope(binding, batch)``.
- ``AttnDispatchMultiStepDraftBackend``: EAGLE-family drafts' multi-step decode, one child per
  step (what SGLang's ``DraftBackendFactory`` builds for a backend name).

Query rows and KV per forward mode (SGLang 0.5.23's eager batches):

- EXTEND / MIXED / DRAFT_EXTEND_V2: ``extend_seq_lens`` rows over ``seq_lens`` keys (prefix
  included, causal bottom-right).
- DECODE: one row over ``seq_lens`` keys.
- TARGET_VERIFY: ``draft_token_num`` rows over ``seq_lens + draft_token_num`` keys; with a
  token tree (``topk > 1``) the verify mask: the prefix fully visible, the tree block from
  ``spec_info.custom_mask`` (SGLang's CPU "qlen only" block or its full mask).
- Multi-step draft decode, step ``i``: for each request and branch ``j``, one row over the
  prefix plus the branch's draft slots ``seq_len + j * num_steps .. + i`` (the order SGLang's
  draft cache locations have).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._record import record_dispatch
from attn_dispatch._scope import attention
from attn_dispatch._scope import attn_scope
from attn_dispatch.integrations._sglang_rules import phase_of
from attn_dispatch.integrations.sglang import attn_config_from_layer
from attn_dispatch.integrations.sglang_engine._settings import BACKEND_NAME
from attn_dispatch.integrations.sglang_engine._settings import DRAFT
from attn_dispatch.integrations.sglang_engine._settings import TARGET
from attn_dispatch.integrations.sglang_engine._settings import Settings
from attn_dispatch.integrations.sglang_engine._settings import settings_from_env

# -- the dispatch record of this process (the "record" setting) -------------------------------

_RECORD_LOCK = threading.Lock()
_RECORDER: record_dispatch | None = None


def _recording(settings: Settings) -> record_dispatch | None:
    """One recorder for every backend of this process, entered around each call."""
    global _RECORDER
    if settings.record is None:
        return None
    with _RECORD_LOCK:
        if _RECORDER is None:
            _RECORDER = record_dispatch()
        return _RECORDER


def _write_record(path: str, rec: record_dispatch) -> None:
    counts = rec._recorder.counts()
    rows = sorted([label, phase, backend, n] for (label, phase, backend), n in counts.items())
    # Written whole and renamed: a reader never sees half a file.
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".attn_dispatch_record")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    os.replace(tmp, path)


# -- one runner's backend ------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class AttnDispatchSGLangBackend(AttentionBackend):  # type: ignore[misc]
    """SGLang attention backend ``"attn_dispatch"`` of one runner (target or draft)."""

    def __init__(self, model_runner: Any, *, label: str | None = None) -> None:
        super().__init__()
        settings = settings_from_env()
        # SGLang's own word on the runner: every STANDALONE / EAGLE / EAGLE-3 draft runner is
        # built with is_draft_worker=True. The draft's spec is its own (refused if missing).
        self.label = label or (DRAFT if getattr(model_runner, "is_draft_worker", False) else TARGET)
        self.settings = settings
        self.spec = settings.spec_for(self.label)
        if getattr(model_runner, "use_mla_backend", False):
            raise InvalidSpecError(
                "attention_backend",
                BACKEND_NAME,
                f"the {self.label} runner's model is an MLA model; this SGLang integration serves "
                "MHA/GQA layers (MLA pools are not read yet): give this runner another backend",
            )
        pool = model_runner.token_to_kv_pool
        if type(pool) is not MHATokenToKVPool or getattr(pool, "kv_cache_layout", None) not in (
            None,
            "default",
            "nhd",
        ):
            raise InvalidSpecError(
                "token_to_kv_pool",
                f"{type(pool).__name__} layout {getattr(pool, 'kv_cache_layout', None)!r}",
                "the attn_dispatch backend reads SGLang's plain MHA token-to-KV pool "
                "(token-major K and V buffers per layer); hybrid, SWA, quantized and "
                "vectorized pools are not served",
            )
        if pool.store_dtype != pool.dtype:
            raise InvalidSpecError(
                "kv_cache_dtype",
                _dtype_name(pool.store_dtype),
                "a quantized KV cache is not served by this integration; use kv_cache_dtype='auto'",
            )
        self.device = model_runner.device
        # AttnConfig names a device type ("cpu", "cuda"); SGLang's may carry an index.
        self.device_type = torch.device(self.device).type
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = int(pool.page_size)
        self.num_pages = (pool.size + self.page_size) // self.page_size
        self.dtype = _dtype_name(model_runner.dtype)
        self.kv_dtype = _dtype_name(pool.dtype)
        server_args = model_runner.server_args
        topk = getattr(server_args, "speculative_eagle_topk", None) or 1
        # A token tree is verified by the target only.
        self.tree_verify = self.label == TARGET and topk > 1
        self._bindings: dict[AttnConfig, Binding] = {}
        self._batch: AttnBatch | None = None
        self._recorder = _recording(settings)
        # Bind once now for the model's attention shape, so a spec the kernels cannot serve
        # fails at start-up, not at the first request. Layers bind their own config (scale,
        # window, cap) on first use, from the same spec.
        mc = model_runner.model_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        heads = int(mc.num_attention_heads) // tp
        kv_heads = int(mc.get_num_kv_heads(tp))
        head_dim = int(mc.head_dim)
        self._binding(
            AttnConfig(
                kind="mha",
                num_q_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=self.dtype,
                kv_dtype=self.kv_dtype if self.kv_dtype != self.dtype else None,
                page_size=self.page_size,
                device=self.device_type,
                tree_verify=self.tree_verify,
            )
        )

    # -- start-up ------------------------------------------------------------------------

    def _binding(self, config: AttnConfig) -> Binding:
        found = self._bindings.get(config)
        if found is None:
            options = self.settings.options or None
            found = self._bindings[config] = bind(
                self.spec, config, label=self.label, options=options
            )
        return found

    def _layer_binding(self, layer: Any) -> Binding:
        cfg = attn_config_from_layer(
            layer,
            dtype=self.dtype,
            page_size=self.page_size,
            device=self.device_type,
            kv_dtype=self.kv_dtype if self.kv_dtype != self.dtype else None,
            tree_verify=self.tree_verify,
        )
        return self._binding(cfg)

    # -- per forward ---------------------------------------------------------------------

    def _pages(self, req: int, slots: torch.Tensor) -> list[int]:
        """The pages of one request's token slots (positions 0..n-1), checked page-aligned."""
        # Host copies: the page table is built once per forward, on the host (AttnBatch.build).
        slots = slots.to(device="cpu", dtype=torch.int64)
        p = self.page_size
        if p == 1:
            return [int(s) for s in slots.tolist()]
        n = slots.numel()
        pages = torch.div(slots[::p], p, rounding_mode="floor")
        expected = pages.repeat_interleave(p)[:n] * p + torch.arange(n) % p
        if not torch.equal(expected, slots):
            raise InvalidBatchError(
                "req_to_token",
                f"request pool slot {req}: token slots {slots.tolist()!r} are not laid out in "
                f"whole pages of {p} (token t in page slot t % {p}); attn_dispatch reads "
                "SGLang's pool as pages",
            )
        return [int(x) for x in pages.tolist()]

    def _verify_masks(
        self, spec_info: Any, seq_lens: list[int], n: int
    ) -> list[torch.Tensor] | None:
        topk = getattr(spec_info, "tree_topk", None) or getattr(spec_info, "topk", 1) or 1
        mask = getattr(spec_info, "custom_mask", None)
        if topk == 1 or mask is None or mask.numel() == 0:
            return None  # a chain: causal bottom-right is the verify rule
        bs = len(seq_lens)
        flat = mask.reshape(-1).to(torch.bool)
        masks = []
        if flat.numel() >= bs * n * n and flat.numel() < sum(seq_lens) * n + bs * n * n:
            # SGLang's CPU tree mask: one [n, n] block per request, the prefix implied.
            for i, s in enumerate(seq_lens):
                block = flat[i * n * n : (i + 1) * n * n].view(n, n)
                prefix = torch.ones(n, s, dtype=torch.bool, device=block.device)
                masks.append(torch.cat([prefix, block], dim=1))
            return masks
        at = 0
        for s in seq_lens:
            size = n * (s + n)
            masks.append(flat[at : at + size].view(n, s + n))
            at += size
        return masks

    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self._batch = None
            return
        phase = phase_of(mode)
        reqs = [int(r) for r in forward_batch.req_pool_indices.tolist()]
        seq = [int(s) for s in forward_batch.seq_lens.tolist()]
        masks = None
        if mode.is_target_verify():
            spec_info = forward_batch.spec_info
            n = int(spec_info.draft_token_num)
            q_lens = [n] * len(reqs)
            masks = self._verify_masks(spec_info, seq, n)
            kv_lens = [s + n for s in seq]
        elif mode.is_decode():
            q_lens = [1] * len(reqs)
            kv_lens = seq
        else:
            extend = forward_batch.extend_seq_lens_cpu
            if extend is None:
                extend = forward_batch.extend_seq_lens.tolist()
            q_lens = [int(x) for x in extend]
            kv_lens = seq
        tables = [
            self._pages(r, self.req_to_token[r, :kv]) for r, kv in zip(reqs, kv_lens, strict=True)
        ]
        self._batch = AttnBatch.build(
            phase,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            page_size=self.page_size,
            num_pages=self.num_pages,
            masks=masks,
            device=self.device,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], heads * v_dim)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        batch = self._batch
        if batch is None:
            raise InvalidBatchError(
                "forward_batch",
                f"the {self.label} runner's attn_dispatch backend has no metadata for this "
                f"{forward_batch.forward_mode.name} forward (init_forward_metadata was not run)",
            )
        binding = self._layer_binding(layer)
        cfg = binding.config
        p = self.page_size
        k_pages = self.pool.get_key_buffer(layer.layer_id).view(
            -1, p, cfg.num_kv_heads, cfg.head_dim
        )
        v_pages = self.pool.get_value_buffer(layer.layer_id).view(
            -1, p, cfg.num_kv_heads, cfg.v_head_dim
        )
        query = q.reshape(-1, heads, cfg.head_dim)
        if query.shape[0] != batch.num_tokens:
            raise InvalidBatchError(
                "q",
                f"{query.shape[0]} query rows for a {batch.phase.name} batch of "
                f"{batch.num_tokens} (the {self.label} runner, {forward_batch.forward_mode.name})",
            )
        rec = self._recorder
        out: torch.Tensor
        if rec is None:
            with attn_scope(binding, batch):
                out = attention(query, k_pages, v_pages)
        else:
            with rec, attn_scope(binding, batch):
                out = attention(query, k_pages, v_pages)
            assert self.settings.record is not None
            _write_record(self.settings.record, rec)
        return out.reshape(-1, heads * v_dim)

    def forward_decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward_extend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def support_triton(self) -> bool:
        return False


class AttnDispatchMultiStepDraftBackend:
    """The multi-step draft decode of an EAGLE-family draft: one child backend per step."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        self.topk = int(topk)
        self.speculative_num_steps = int(speculative_num_steps)
        self.attn_backends = [
            AttnDispatchSGLangBackend(model_runner, label=DRAFT)
            for _ in range(self.speculative_num_steps - 1)
        ]
        first = self.attn_backends[0] if self.attn_backends else None
        if first is not None and self.topk > 1 and first.page_size > 1:
            raise InvalidSpecError(
                "page_size",
                first.page_size,
                f"a draft token tree (speculative_eagle_topk={self.topk}) over pages larger than "
                "one token is not served by the attn_dispatch draft decode; use page_size=1 or "
                "speculative_eagle_topk=1",
            )

    def init_forward_metadata(self, forward_batch: Any) -> None:
        if not self.attn_backends:
            return
        first = self.attn_backends[0]
        phase = phase_of(forward_batch.forward_mode)
        reqs = [int(r) for r in forward_batch.req_pool_indices.tolist()]
        seq = [int(s) for s in forward_batch.seq_lens.tolist()]
        steps, topk = self.speculative_num_steps, self.topk
        rows = len(reqs) * topk
        for step, child in enumerate(self.attn_backends):
            tables, kv_lens = [], []
            for r, s in zip(reqs, seq, strict=True):
                table = first.req_to_token[r]
                for j in range(topk):
                    if topk == 1:
                        slots = table[: s + step + 1]
                    else:
                        start = s + j * steps
                        slots = torch.cat([table[:s], table[start : start + step + 1]])
                    tables.append(first._pages(r, slots))
                    kv_lens.append(s + step + 1)
            child._batch = AttnBatch.build(
                phase,
                q_lens=[1] * rows,
                kv_lens=kv_lens,
                page_tables=tables,
                page_size=first.page_size,
                num_pages=first.num_pages,
                device=first.device,
            )


__all__ = ["AttnDispatchMultiStepDraftBackend", "AttnDispatchSGLangBackend"]
