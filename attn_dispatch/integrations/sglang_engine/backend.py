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

import collections
import dataclasses
import json
import os
import tempfile
import threading
from typing import Any
from typing import cast

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._record import record_dispatch
from attn_dispatch._scope import attention
from attn_dispatch._scope import attention_form
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
    counts = collections.Counter(
        (e.label, e.phase.name.lower(), e.backend, e.form) for e in rec._recorder.events
    )
    rows = sorted(
        ([label, phase, backend, n, form] for (label, phase, backend, form), n in counts.items()),
        key=lambda r: tuple(str(x) for x in r),
    )
    # Written whole and renamed: a reader never sees half a file.
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".attn_dispatch_record")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    os.replace(tmp, path)


#: What a layer call returns: the output, or ``(out, lse)`` when SGLang asks for the state
#: (its chunked-KV prefill sets ``forward_batch.mha_return_lse``).
_Out = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


# -- MLA layers ------------------------------------------------------------------------------


def _asks_forms(model: Any) -> bool:
    """Whether the model's MLA layers ask the backend for their form (DeepSeek's family:
    ``dispatch_attn_forward_method`` looks the backend's name up in DeepSeek's registry, where
    ``_hooks`` puts ours). Other MLA models (Sarvam) run only the absorbed form here."""
    return any(hasattr(m, "dispatch_attn_forward_method") for m in model.modules())


class _MLAShape:
    """An MLA model's widths: latent ``kv_lora_rank`` + ``rope``; decompressed
    ``nope + rope`` / ``v`` (only when the model asks the backend for its form)."""

    __slots__ = ("heads", "latent", "mha_head_dim", "mha_v_head_dim", "rope")

    def __init__(
        self, heads: int, latent: int, rope: int, mha_head_dim: int | None, mha_v: int | None
    ) -> None:
        self.heads, self.latent, self.rope = heads, latent, rope
        self.mha_head_dim, self.mha_v_head_dim = mha_head_dim, mha_v

    @classmethod
    def of(cls, model_runner: Any, pool: Any, heads: int) -> _MLAShape:
        mc = model_runner.model_config
        hf = getattr(mc, "hf_text_config", None) or mc.hf_config
        latent, rope = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
        if not _asks_forms(model_runner.model):
            return cls(heads, latent, rope, None, None)
        nope, v = int(hf.qk_nope_head_dim), int(hf.v_head_dim)
        return cls(heads, latent, rope, nope + rope, v)


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
        # SGLang's models read the backend names stamped on the backend of the forward running
        # now (DeepSeek's form choice; Sarvam's through our hook). SGLang stamps what it builds
        # in build_attention_backends and DraftBackendFactory, but not what
        # ModelRunner._get_attention_backend builds (EAGLE v2's adaptive steps, UNO's draft),
        # where DeepSeek falls back to the process-wide pair (the target's names, for a
        # draft): this backend stamps itself, so a model always reads its own runner's backend.
        self.prefill_attention_backend_str = BACKEND_NAME
        self.decode_attention_backend_str = BACKEND_NAME
        pool = model_runner.token_to_kv_pool
        self.is_mla = bool(getattr(model_runner, "use_mla_backend", False))
        if self.is_mla:
            if type(pool) is not MLATokenToKVPool:
                raise InvalidSpecError(
                    "token_to_kv_pool",
                    type(pool).__name__,
                    "the attn_dispatch backend reads an MLA model's latent cache from SGLang's "
                    "plain MLATokenToKVPool; DSA, FP4 and hybrid latent pools are not served",
                )
        elif type(pool) is not MHATokenToKVPool or getattr(pool, "kv_cache_layout", None) not in (
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
        # SGLang's forward context reads the running backend's pools (get_token_to_kv_pool).
        self.token_to_kv_pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
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
        # SGLang's chunked-KV prefill of this forward (``init_mha_chunk_metadata``): the new
        # tokens' own batch, then one batch per prefix chunk.
        self._chunked: _ChunkedKV | None = None
        self._recorder = _recording(settings)
        # Bind once now for the model's attention shape, so a spec the kernels cannot serve
        # fails at start-up, not at the first request. Layers bind their own config (scale,
        # window, cap) on first use, from the same spec.
        mc = model_runner.model_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        heads = int(mc.num_attention_heads) // tp
        if self.is_mla:
            self._mla = _MLAShape.of(model_runner, pool, heads)
            mla = self._binding(self._mla_config(None))
            if _may_choose_chunked(mla):
                # SGLang's chunked-KV calls run on two bindings of the decompressed config
                # (new tokens causal, prefix chunks not): bound now too, so a spec that
                # cannot serve them (no lse, no non-causal prefill) fails at start-up.
                for causal in (True, False):
                    self._binding(self._chunk_config(None, causal=causal))
            return
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

    def _mla_config(self, sm_scale: float | None) -> AttnConfig:
        m = self._mla
        return AttnConfig(
            kind="mla",
            num_q_heads=m.heads,
            num_kv_heads=1,
            head_dim=m.latent + m.rope,
            v_head_dim=m.latent,
            mha_head_dim=m.mha_head_dim,
            mha_v_head_dim=m.mha_v_head_dim,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype if self.kv_dtype != self.dtype else None,
            page_size=self.page_size,
            device=self.device_type,
            tree_verify=self.tree_verify,
            sm_scale=sm_scale,
        )

    def form_for(self, layer: Any) -> AttnForm:
        """The form this runner's binding picks for the current forward's batch (what
        DeepSeek's layers ask through the handler ``_hooks`` registers under our name)."""
        batch = self._batch
        if batch is None or not self.is_mla:
            return AttnForm.MLA
        route = self._mla_binding(layer).route(batch.phase)
        return AttnForm.MLA if route.chooser is None else route.chooser(batch)

    def _mla_binding(self, layer: Any) -> Binding:
        scale = getattr(layer, "scaling", None)
        return self._binding(self._mla_config(float(scale) if scale else None))

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
        self._chunked = None
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
        if self.is_mla and mode.is_extend_without_speculative():
            # SGLang's one-shot decompressed MHA gathers every token's latent by these slots
            # (request after request); given here, SGLang skips its own Triton gather.
            slots = [self.req_to_token[r, :kv] for r, kv in zip(reqs, kv_lens, strict=True)]
            forward_batch.mha_one_shot_kv_indices = torch.cat(slots).to(torch.int64)

    def _require_batch(self, forward_batch: Any) -> AttnBatch:
        batch = self._batch
        if batch is None:
            raise InvalidBatchError(
                "forward_batch",
                f"the {self.label} runner's attn_dispatch backend has no metadata for this "
                f"{forward_batch.forward_mode.name} forward (init_forward_metadata was not run)",
            )
        return batch

    def _check_rows(self, query: torch.Tensor, batch: AttnBatch, forward_batch: Any) -> None:
        if query.shape[0] != batch.num_tokens:
            raise InvalidBatchError(
                "q",
                f"{query.shape[0]} query rows for a {batch.phase.name} batch of "
                f"{batch.num_tokens} (the {self.label} runner, {forward_batch.forward_mode.name})",
            )

    def _attend(self, binding: Binding, batch: AttnBatch, *args: Any, **kw: Any) -> torch.Tensor:
        """``attention(*args)`` inside ``attn_scope(binding, batch)`` (recorded if asked)."""
        rec = self._recorder
        out: torch.Tensor
        if rec is None:
            with attn_scope(binding, batch):
                self._check_form(kw.pop("form", None))
                out = attention(*args, **kw)
            return out
        filed_as: AttnForm | None = kw.pop("filed_as", None)
        first = len(rec._recorder.events)
        with rec, attn_scope(binding, batch):
            self._check_form(kw.pop("form", None))
            out = attention(*args, **kw)
        if filed_as is not None:
            # A call of SGLang's chunked-KV prefill runs on an MHA binding of the layer's
            # decompressed config (no form of its own): filed under the MLA layer's form.
            events = rec._recorder.events
            for i in range(first, len(events)):
                if events[i].label == binding.label and events[i].form is None:
                    events[i] = dataclasses.replace(events[i], form=filed_as.value)
        assert self.settings.record is not None
        _write_record(self.settings.record, rec)
        return out

    def _attend_lse(
        self, binding: Binding, batch: AttnBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ragged ``[rows, H, D]`` K/V (pages of one token)."""
        got = self._attend(
            binding,
            batch,
            q,
            k.unsqueeze(1),
            v.unsqueeze(1),
            return_lse=True,
            filed_as=AttnForm.MHA_CHUNKED,
        )
        out, lse = cast("tuple[torch.Tensor, torch.Tensor]", got)
        return out, lse

    def _check_form(self, called: AttnForm | None) -> None:
        """An MLA call's form (absorbed, or decompressed) must be the one the binding chose."""
        if called is None:
            return
        chosen = attention_form()
        decompressed = chosen is not AttnForm.MLA
        if (called is AttnForm.MLA) == decompressed:
            raise InvalidBatchError(
                "layer",
                f"the model called the {called.value!r} form of an MLA layer, but the "
                f"{self.label} runner's backend chose {chosen.value!r} for this batch: the "
                "model did not ask this backend for the form (SGLang's DeepSeek layers do, "
                "through the handler attn_dispatch registers)",
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
    ) -> _Out:
        heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], heads * v_dim)
        if self.is_mla:
            return self._forward_mla(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        batch = self._require_batch(forward_batch)
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
        self._check_rows(query, batch, forward_batch)
        out = self._attend(binding, batch, query, k_pages, v_pages)
        return out.reshape(-1, heads * v_dim)

    def _forward_mla(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool,
        q_rope: torch.Tensor | None = None,
        k_rope: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> _Out:
        """One MLA layer call: SGLang's absorbed call (``attn_mqa``: latent + rope, rope
        separate or concatenated) reads the latent pool in place; its decompressed call
        (``attn_mha``: ``nope + rope`` / ``v`` per head, K/V given whole) attends the rows
        SGLang decompressed."""
        m = self._mla
        heads = m.heads
        batch = self._require_batch(forward_batch)
        binding = self._mla_binding(layer)
        absorbed = q_rope is not None or (
            int(layer.tp_k_head_num) == 1
            and int(layer.qk_head_dim) == m.latent + m.rope
            and int(layer.v_head_dim) == m.latent
        )
        if absorbed:
            if q_rope is not None:  # the separate-rope form: SGLang hands the parts apart
                query = torch.cat(
                    [q.reshape(-1, heads, m.latent), q_rope.reshape(-1, heads, m.rope)], dim=-1
                )
                if k is not None and k_rope is not None:
                    k = torch.cat(
                        [k.reshape(-1, 1, m.latent), k_rope.reshape(-1, 1, m.rope)], dim=-1
                    )
            else:
                query = q.reshape(-1, heads, m.latent + m.rope).contiguous()
            if save_kv_cache and k is not None:
                self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, None)
            self._check_rows(query, batch, forward_batch)
            latent = self.pool.get_key_buffer(layer.layer_id).view(
                -1, self.page_size, m.latent + m.rope
            )
            out = self._attend(binding, batch, query, latent, None, form=AttnForm.MLA)
            return out.reshape(-1, heads * m.latent)
        # The decompressed call: K/V are the model's own rows (save_kv_cache is False: the
        # model wrote the latent itself), every token of each request in order (SGLang's
        # MHA over a batch without prefix, or its one-shot MHA over prefix + new tokens).
        if m.mha_head_dim is None or m.mha_v_head_dim is None or k is None or v is None:
            raise InvalidBatchError(
                "layer",
                f"a decompressed MLA call reached the {self.label} runner's attn_dispatch "
                "backend, whose binding serves this model in the absorbed form only",
            )
        dk, dv = m.mha_head_dim, m.mha_v_head_dim
        # SGLang's rows are views of its up-projection (V a slice of it): made contiguous.
        query = q.reshape(-1, heads, dk).contiguous()
        self._check_rows(query, batch, forward_batch)
        keys = k.reshape(-1, heads, dk).contiguous()
        values = v.reshape(-1, heads, dv).contiguous()
        if getattr(forward_batch, "attn_attend_prefix_cache", None) is not None and getattr(
            forward_batch, "mha_return_lse", None
        ):
            # SGLang's chunked-KV prefill (MHA_CHUNKED_KV): it merges the parts itself.
            return self._chunked_kv_call(layer, forward_batch, query, keys, values)
        if self.form_for(layer) is AttnForm.MHA_CHUNKED:
            # SGLang decompressed the whole prefix at once (one-shot): hand it over as one
            # chunk, the new tokens apart.
            new, pre, indptr = _split_prefix(batch)
            out = self._attend(
                binding,
                batch,
                query,
                keys[new],
                values[new],
                prefix=[(keys[pre], values[pre], indptr)],
                form=AttnForm.MHA_CHUNKED,
            )
        else:
            out = self._attend(binding, batch, query, keys, values, form=AttnForm.MHA)
        return out.reshape(-1, heads * dv)

    # -- SGLang's chunked-KV prefill (MHA_CHUNKED_KV) --------------------------------------

    def init_mha_chunk_metadata(self, forward_batch: Any) -> None:
        """SGLang calls this once per forward after splitting the cached prefix into chunks
        (``prepare_chunked_prefix_cache_info``): the batches of its calls are built here,
        on the host, from the chunk lengths SGLang computed (none for its one-shot MHA)."""
        self._chunked = None
        n = int(getattr(forward_batch, "num_prefix_chunks", None) or 0)
        if n == 0 or not self.is_mla:
            return
        batch = self._require_batch(forward_batch)
        chunk_lens = forward_batch.prefix_chunk_seq_lens_cpu
        self._chunked = _ChunkedKV.of(
            batch.q_lens(),
            [[int(x) for x in chunk_lens[i].tolist()] for i in range(n)],
            self.device,
        )

    def _chunk_binding(self, layer: Any, *, causal: bool) -> Binding:
        """The decompressed MHA config of ``layer`` with the attention state (``lse``);
        ``causal=False`` for a prefix chunk (every new row sees every chunk key)."""
        scale = getattr(layer, "scaling", None)
        return self._binding(self._chunk_config(float(scale) if scale else None, causal=causal))

    def _chunk_config(self, sm_scale: float | None, *, causal: bool) -> AttnConfig:
        cfg = self._mla_config(sm_scale).decompressed()
        return cfg.replace(return_lse=True, causal=causal)

    def _chunked_kv_call(
        self,
        layer: Any,
        forward_batch: Any,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of SGLang's chunked-KV prefill, ``(out [T, H, dv], lse [T, H])``.

        First the new tokens over themselves (causal; ``attn_attend_prefix_cache`` False),
        then, per prefix chunk ``prefix_chunk_idx``, the new tokens over the chunk's rows
        (SGLang decompressed them, request after request): no causal mask. SGLang merges
        the states (``merge_state``)."""
        chosen = self.form_for(layer)
        if chosen is not AttnForm.MHA_CHUNKED:
            raise InvalidBatchError(
                "layer",
                f"SGLang ran its chunked-KV prefill on the {self.label} runner's attn_dispatch "
                f"backend, whose binding chose {chosen.value!r} for this batch (the backend "
                "answers SGLang's MHA_CHUNKED_KV only for 'mha_chunked')",
            )
        plan = self._chunked
        if plan is None:
            raise InvalidBatchError(
                "forward_batch",
                f"SGLang's chunked-KV prefill reached the {self.label} runner's attn_dispatch "
                "backend without its chunk metadata (init_mha_chunk_metadata was not called)",
            )
        if not forward_batch.attn_attend_prefix_cache:
            binding = self._chunk_binding(layer, causal=True)
            return self._attend_lse(binding, plan.new, query, keys, values)
        idx = int(forward_batch.prefix_chunk_idx)
        chunk = plan.chunks[idx]
        binding = self._chunk_binding(layer, causal=False)
        # Rows of requests with no key in this chunk attended nothing: out 0, lse -inf
        # (what merge_state takes as an empty part).
        heads, dv = query.shape[1], values.shape[-1]
        out = query.new_zeros(query.shape[0], heads, dv)
        lse = torch.full(
            (query.shape[0], heads), -torch.inf, dtype=torch.float32, device=query.device
        )
        if chunk.batch is None:  # no request has keys in this chunk
            return out, lse
        if chunk.rows is None:
            return self._attend_lse(binding, chunk.batch, query, keys, values)
        rows = chunk.rows.to(query.device)
        out[rows], lse[rows] = self._attend_lse(binding, chunk.batch, query[rows], keys, values)
        return out, lse

    def forward_decode(self, *args: Any, **kwargs: Any) -> _Out:
        return self.forward(*args, **kwargs)

    def forward_extend(self, *args: Any, **kwargs: Any) -> _Out:
        return self.forward(*args, **kwargs)

    def support_triton(self) -> bool:
        return False


def _may_choose_chunked(binding: Binding) -> bool:
    """Whether the prefill form policy of an MLA binding can pick ``mha_chunked``."""
    chooser = binding.route(Phase.PREFILL).chooser
    policy = getattr(chooser, "__self__", None)  # FormPolicy.choose, bound to its policy
    if not isinstance(policy, FormPolicy):
        return chooser is not None
    return AttnForm.MHA_CHUNKED in (policy.no_prefix, policy.short_prefix, policy.long_prefix)


def _split_prefix(batch: AttnBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows of whole-sequence K/V (request after request): the new tokens' rows, the prefix
    rows, and the prefix rows' per-request offsets."""
    kv = [int(x) for x in batch.kv_lens_host.tolist()]
    q_lens = batch.q_lens()
    new, pre, indptr, at = [], [], [0], 0
    for n, ql in zip(kv, q_lens, strict=True):
        pre.append(torch.arange(at, at + n - ql))
        new.append(torch.arange(at + n - ql, at + n))
        indptr.append(indptr[-1] + n - ql)
        at += n
    return torch.cat(new), torch.cat(pre), indptr


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Chunk:
    """One prefix chunk's call: ``batch`` over the chunk's K/V rows (None: no request has
    keys in it), and ``rows``, the new-token rows it attends (None: all of them)."""

    batch: AttnBatch | None
    rows: torch.Tensor | None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ChunkedKV:
    """The batches of SGLang's chunked-KV prefill for one forward.

    ``new``: the new tokens over their own rows (K/V of the new tokens only, ragged: one
    token per page), causal. ``chunks[i]``: the new tokens over prefix chunk ``i``'s rows,
    for a non-causal config. An ``AttnBatch`` needs ``kv_len >= q_len`` per request, so a
    request with more new tokens than keys in the chunk is split into pieces of at most
    ``kv_len`` rows over the same keys (the same pages, listed again): without a causal mask
    every row's attention is its own, so the pieces compute exactly the request's rows. A
    request with no key in the chunk leaves its rows out (they attended nothing).
    """

    new: AttnBatch
    chunks: tuple[_Chunk, ...]

    @classmethod
    def of(cls, q_lens: list[int], chunk_lens: list[list[int]], device: Any) -> _ChunkedKV:
        total = sum(q_lens)
        pages, at = [], 0
        for n in q_lens:
            pages.append(list(range(at, at + n)))
            at += n
        new = _rows_batch(q_lens, q_lens, pages, total, device)
        return cls(new, tuple(_chunk(q_lens, lens, device) for lens in chunk_lens))


def _rows_batch(
    q_lens: list[int], kv_lens: list[int], tables: list[list[int]], rows: int, device: Any
) -> AttnBatch:
    """A prefill batch over K/V rows SGLang decompressed (one row per page, ``rows`` in all):
    the shape of both chunked-KV calls."""
    return AttnBatch.build(
        Phase.PREFILL,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=1,
        num_pages=rows,
        device=device,
    )


def _chunk(q_lens: list[int], lens: list[int], device: Any) -> _Chunk:
    """The call of one chunk: request ``i`` has ``q_lens[i]`` new rows and ``lens[i]`` keys,
    at chunk rows ``sum(lens[:i]) ..`` (SGLang's order)."""
    pieces_q: list[int] = []
    pieces_kv: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    q_at = kv_at = 0
    skipped = False
    for q, c in zip(q_lens, lens, strict=True):
        if c == 0:
            skipped = True
        else:
            keys = list(range(kv_at, kv_at + c))
            for start in range(0, q, c):
                pieces_q.append(min(c, q - start))
                pieces_kv.append(c)
                tables.append(keys)
            rows.extend(range(q_at, q_at + q))
        q_at += q
        kv_at += c
    if not pieces_q:
        return _Chunk(None, None)
    batch = _rows_batch(pieces_q, pieces_kv, tables, kv_at, device)
    return _Chunk(batch, torch.tensor(rows, dtype=torch.int64) if skipped else None)


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
