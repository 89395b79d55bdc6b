"""The ``sdpa`` backend: PyTorch's fused attention over the paged-KV contract.

Per forward, ``plan`` turns the batch into *calls*: each is one fused-attention call over a
run of requests that share one shape (equal query and key counts: a uniform batch, decode
with equal lengths), made of one or two *parts* over key ranges of those requests:

- causal prefill/extend: the cached prefix (every new token sees all of it, no mask) and the
  new tokens (a square, top-left-aligned ``is_causal`` block), merged by their LSE
  (``extend="split"``), or one call with a bottom-right causal mask (``extend="mask"``);
  ``extend="auto"`` (the default) masks while the mask has at most ``MASK_MAX_ELEMENTS``
  entries and splits beyond (bench/sdpa_notes.md has the measurements);
- decode: one query over its visible keys, no mask;
- window / chunked attention: queries in blocks (cut at chunk boundaries) over the keys the
  block can see, with an additive band mask where rows' first keys differ;
- tree verify and any custom mask: one masked call per request (the chunk and window folded
  into the mask first, as every backend does);
- ``causal=False``: all keys, no mask.

Per layer call the pages each request reads are gathered, whole pages at a time, into a
buffer reused by the calling thread: on CPU head-major ``[heads, rows, e]`` (the CPU flash
kernel runs 1.3-2x slower on the cache's own ``[rows, heads, e]`` layout than on head-major
K/V, more than the gather costs), one copy per run of consecutive pages when the runs are
few, else one ``index_select`` and one transposing copy; an FP8 cache is converted and
scaled there. A request whose pages follow each other in the cache is read in place, as a
view, where that layout is as fast (``in_place="auto"``: on CUDA, and on CPU when the cache
has one KV head, where rows are head-major already). Parts are merged and sinks applied
through the LSE in fp32: ``out * sigmoid(lse - sink)``, ``lse' = logaddexp(lse, sink)``.

On CPU every call is ``aten._scaled_dot_product_flash_attention_for_cpu`` (the op the public
function runs there), which returns the natural-log LSE. On CUDA calls that need no LSE go to
``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention, cuDNN or
memory-efficient, chosen by PyTorch); calls that need it to the memory-efficient op.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import Literal

import torch
import torch.nn.functional as F

from attn_dispatch._batch import AttnBatch
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import BackendBase
from attn_dispatch._protocol import Handler
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch._snapshot import BatchSnapshot
from attn_dispatch._tensor_checks import TensorChecks
from attn_dispatch._values import call_scale
from attn_dispatch.backends._masks import chunk_tree_mask
from attn_dispatch.backends._masks import window_tree_mask

Extend = Literal["auto", "split", "mask"]
_EXTENDS = ("auto", "split", "mask")
InPlace = bool | Literal["auto"]
#: ``extend="auto"``: one masked call while its mask (queries x keys) has at most this many
#: entries, prefix and new tokens as two parts merged by LSE beyond (a mask that size costs
#: 8 MiB in bf16; bench/sdpa_notes.md has the measurements behind the choice).
MASK_MAX_ELEMENTS = 1 << 22
#: Query block of windowed layers (rows per masked call).
WINDOW_BLOCK = 256
_NEG_INF = -math.inf
_SOURCE_BUF, _SOURCE_CACHE = 0, 1
#: CPU gather: one copy per run of consecutive pages while there are at most
#: ``RUN_COPY_MAX_RUNS`` runs averaging at least ``RUN_COPY_MIN_BYTES``; otherwise one
#: ``index_select`` into a row-major scratch buffer and one transposing copy (two passes,
#: two parallel regions). Each copy is a parallel region of its own: on a machine shared
#: with other work, every region can wait a time slice for its second thread (64 per-page
#: copies made a 2-thread layer call 1.4-5x slower there), and a copy's own cost is a few
#: microseconds; on an idle machine the per-run copies are ~1.5x faster than two passes.
RUN_COPY_MIN_BYTES = 16 << 10
RUN_COPY_MAX_RUNS = 8
#: Keys or values of one layer call: (tensor, heads, head stride, row stride) in elements.
_Source = tuple[torch.Tensor, int, int, int]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Part:
    """Keys ``k0:k1`` (positions in the request) of one call: a square top-left ``causal``
    block, an additive ``mask`` ``[queries, keys]``, or neither (every key visible)."""

    k0: int
    k1: int
    causal: bool = False
    mask: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Call:
    """``count`` requests with ``n`` query rows each, from q row ``q0`` on (adjacent), whose
    keys start at rows ``base + j * stride`` of ``source`` (the gather buffer or the cache)."""

    count: int
    q0: int
    n: int
    source: int
    base: int
    stride: int
    parts: tuple[_Part, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SdpaPlan(PlanBase):
    """One forward's plan, made by ``SdpaBackend.plan`` and accepted only by that object."""

    owner: SdpaBackend
    snap: BatchSnapshot
    phase: Phase
    num_tokens: int
    #: Page indices to gather (int64, on the batch's device), request after request.
    pages: torch.Tensor
    #: On CPU: the same pages as runs ``(first page, count)`` of consecutive pages, copied
    #: one run at a time into head-major buffers. None on CUDA.
    runs: tuple[tuple[int, int], ...] | None
    calls: tuple[_Call, ...]
    #: Requests read in place (their pages follow each other in the cache).
    in_place: int

    @property
    def dispatch_note(self) -> str | None:
        """What ``record_dispatch`` shows beside the call."""
        return f"{len(self.calls)} sdpa calls, {self.pages.numel()} pages gathered"


class _Buffers(threading.local):
    """Gather buffers of one backend object, one set per thread (threads that share a plan
    never share a buffer), reused across layers and grown when a batch needs more."""

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        buf = self.store.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype)
            self.store[name] = buf
        return buf[:numel]


class SdpaBackend(BackendBase):
    """Paged attention through ``scaled_dot_product_attention``, CPU and CUDA.

    Options: ``extend`` ("auto", "split" or "mask": how a causal block after a cached prefix
    runs, see the module docstring), ``window_block`` (query rows per masked window call),
    ``in_place`` (read requests whose pages follow each other without gathering: ``"auto"``
    where the kernel reads the cache's layout as fast as gathered K/V, True always, False
    never), ``validate``
    (CUDA: read page indices back at plan time to check them; otherwise they are clamped into
    the cache given at each call).
    """

    name = "sdpa"

    def __init__(
        self,
        config: AttnConfig,
        *,
        extend: Extend = "auto",
        window_block: int = WINDOW_BLOCK,
        in_place: InPlace = "auto",
        validate: bool = False,
    ) -> None:
        if extend not in _EXTENDS:
            raise InvalidSpecError("extend", extend, f"choose one of {_EXTENDS!r}")
        if isinstance(window_block, bool) or not isinstance(window_block, int) or window_block < 1:
            raise InvalidSpecError("window_block", window_block, "must be a positive int")
        if not isinstance(validate, bool):
            raise InvalidSpecError("validate", validate, "must be True or False")
        if not isinstance(in_place, bool) and in_place != "auto":
            raise InvalidSpecError("in_place", in_place, "must be True, False or 'auto'")
        if config.logit_cap:
            raise InvalidSpecError(
                "logit_cap", config.logit_cap, "the sdpa backend serves no logit soft-cap"
            )
        self.config = config
        self.extend = extend
        self.window_block = window_block
        self.validate = validate
        self.mla = config.kind == "mla"
        self.q_dtype: torch.dtype = getattr(torch, config.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, str(config.kv_dtype))
        self.fp8 = config.kv_fp8
        # The dtype the fused op computes in: q's, unless the cache holds another 16/32-bit
        # type (then fp32, so neither side is rounded); FP8 is widened to q's dtype.
        self.dtype: torch.dtype = (
            self.q_dtype if self.fp8 or self.kv_dtype == self.q_dtype else torch.float32
        )
        self.hq, self.hkv = config.num_q_heads, config.num_kv_heads
        self.d, self.dv = config.head_dim, int(config.out_head_dim)
        # One head size for q, k and v (the CPU flash op takes one): MLA's V is the first dv
        # columns of the latent, so K itself serves as V and the output is cut to dv.
        self.e = self.d if self.mla else max(self.d, self.dv)
        self.h_cache = 1 if self.mla else self.hkv
        convert = self.kv_dtype != self.dtype
        self.k_direct = not convert and self.d == self.e
        self.v_direct = self.mla or (not convert and self.dv == self.e)
        self.q_direct = self.q_dtype == self.dtype and self.d == self.e
        self.device_type = config.device_type
        # On CPU the flash kernel ran 1.3-2x slower on the cache's [rows, heads, e] view than
        # on head-major K/V, more than the gather it saves (bench/sdpa_notes.md); with one
        # KV head the cache's rows are head-major already.
        fast_view = self.device_type != "cpu" or self.h_cache == 1
        wanted = fast_view if in_place == "auto" else in_place
        self.in_place = wanted and self.k_direct and self.v_direct
        self._checks = TensorChecks.of(config, backend="sdpa", layout="rows")
        self._buffers = _Buffers()

    # -- planning (once per forward) ----------------------------------------------------------

    def plan(self, batch: AttnBatch) -> SdpaPlan:
        c = self.config
        snap = BatchSnapshot.of(batch, c.page_size, check_device=self.validate)
        dev = snap.device
        ps = c.page_size
        qo = snap.qo_indptr_host.tolist()
        kv = snap.kv_indptr_host.tolist()
        lens = snap.kv_lens_host.tolist()
        b = snap.num_requests
        host_idx = snap.kv_indices.tolist() if dev.type == "cpu" else None
        # Where each request's key 0 lives: (source, row).
        where: list[tuple[int, int]] = []
        gather: list[tuple[int, int]] = []  # (start in kv_indices, pages) per gathered request
        rows = 0
        in_place = 0
        for i in range(b):
            need = -(-lens[i] // ps)
            start = kv[i]
            pages = None if host_idx is None else host_idx[start : start + need]
            if (
                self.in_place
                and pages
                and all(pages[j] == pages[0] + j for j in range(1, len(pages)))
            ):
                where.append((_SOURCE_CACHE, pages[0] * ps))
                in_place += 1
            else:
                where.append((_SOURCE_BUF, rows))
                gather.append((start, need))
                rows += need * ps
        pages_t = _page_list(snap.kv_indices, gather, dev)
        runs = None if host_idx is None else _runs(host_idx, gather)
        units = self._units(snap, qo, lens)
        calls = _group(units, where, lens)
        plan = SdpaPlan(
            owner=self,
            snap=snap,
            phase=snap.phase,
            num_tokens=snap.num_tokens,
            pages=pages_t,
            runs=runs,
            calls=calls,
            in_place=in_place,
        )
        return issue_plan(self, plan)

    def _units(
        self, snap: BatchSnapshot, qo: list[int], lens: list[int]
    ) -> list[tuple[int, int, int, tuple[_Part, ...]]]:
        """``(request, q0, n, parts)`` for every block of queries, in q-row order."""
        c = self.config
        masks = _MaskCache(self.dtype, snap.device)
        out: list[tuple[int, int, int, tuple[_Part, ...]]] = []
        mask_off = 0
        for i in range(snap.num_requests):
            q0, n, length = qo[i], qo[i + 1] - qo[i], lens[i]
            if snap.custom_mask is not None:
                flat = snap.custom_mask[mask_off : mask_off + n * length].view(n, length)
                mask_off += n * length
                if c.attention_chunk_size is not None:  # the chunk first, then the window
                    flat = chunk_tree_mask(flat, c.attention_chunk_size)
                if c.window_left is not None:
                    flat = window_tree_mask(flat, c.window_left)
                out.append((i, q0, n, (_Part(0, length, mask=masks.additive(flat)),)))
                continue
            if not c.causal:
                out.append((i, q0, n, (_Part(0, length),)))
                continue
            first = length - n
            for a, b in self._blocks(first, length):
                out.append((i, q0 + a - first, b - a, self._causal_parts(a, b, masks)))
        return out

    def _lo(self, p: int) -> int:
        """The first key position a (causal) query at position ``p`` sees."""
        c = self.config
        lo = 0
        if c.window_left is not None:
            lo = max(lo, p - c.window_left)
        if c.attention_chunk_size is not None:
            lo = max(lo, p - p % c.attention_chunk_size)
        return lo

    def _blocks(self, first: int, end: int) -> Iterable[tuple[int, int]]:
        """Query position blocks ``[a, b)``: cut at chunk boundaries, and every
        ``window_block`` rows when a window bands the mask."""
        c = self.config
        chunk = c.attention_chunk_size
        step = self.window_block if c.window_left is not None else None
        a = first
        while a < end:
            b = end
            if chunk is not None:
                b = min(b, (a // chunk + 1) * chunk)
            if step is not None:
                b = min(b, a + step)
            yield a, b
            a = b

    def _causal_parts(self, a: int, b: int, masks: _MaskCache) -> tuple[_Part, ...]:
        lo_a, lo_b = self._lo(a), self._lo(b - 1)
        n = b - a
        if n == 1:  # one query sees every key of its range
            return (_Part(lo_a, b),)
        if lo_a == lo_b:  # every row starts at the same key: prefix + causal square
            if a == lo_a:
                return (_Part(a, b, causal=True),)
            small = n * (b - lo_a) <= MASK_MAX_ELEMENTS
            if self.extend == "mask" or (self.extend == "auto" and small):
                rel = torch.arange(n)[:, None] + (a - lo_a) >= torch.arange(b - lo_a)[None, :]
                return (_Part(lo_a, b, mask=masks.additive(rel, ("causal", n, b - lo_a))),)
            return (_Part(lo_a, a), _Part(a, b, causal=True))
        pos = torch.arange(a, b)[:, None]
        keys = torch.arange(lo_a, b)[None, :]
        los = [self._lo(p) - lo_a for p in range(a, b)]
        lo = torch.tensor(los)[:, None] + lo_a
        key = ("band", b - lo_a, *los)
        return (_Part(lo_a, b, mask=masks.additive((keys <= pos) & (keys >= lo), key)),)

    # -- per layer ----------------------------------------------------------------------------

    def handler(self, phase: Phase) -> Handler:
        return functools.partial(self._forward, Phase(phase))

    def _forward(
        self,
        phase: Phase,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        plan: Any,
        sm_scale: float,
        /,
        *,
        sinks: Any = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        check_plan(plan, self, "sdpa")
        if plan.phase is not phase:
            raise InvalidBatchError(
                "phase", f"the plan is for {plan.phase.name}, this handler serves {phase.name}"
            )
        num_pages = self._checks.check(plan.snap, q, k_cache, v_cache)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache is not None and not cache.is_contiguous():
                raise InvalidBatchError(name, "sdpa: must be contiguous (call .contiguous())")
        if c.sinks:
            self._checks.check_sinks(sinks, q)
        elif sinks is not None:
            raise InvalidBatchError("sinks", "given to a layer whose config has sinks=False")
        ks, vs = call_scale("k_scale", k_scale), call_scale("v_scale", v_scale)
        if not self.fp8 and (ks, vs) != (1.0, 1.0):
            raise InvalidBatchError("k_scale", "scales apply to FP8 caches only")
        scale = call_scale("sm_scale", sm_scale)
        if return_lse is not True and return_lse is not False:
            raise InvalidBatchError("return_lse", f"must be True or False, got {return_lse!r}")
        if plan.num_tokens == 0:
            out = q.new_empty((0, self.hq, self.dv))
            return (out, torch.empty(0, self.hq, device=q.device)) if return_lse else out
        pages = plan.pages
        if plan.snap.max_page is None and pages.numel():
            # Page indices never read on the host (CUDA without validate): keep every gather
            # inside this call's cache; an out-of-range index gives wrong numbers, not a fault.
            pages = pages.clamp(0, max(num_pages - 1, 0))
        runs = plan.runs
        kbuf = self._gather("k", k_cache, pages, runs, self.d, ks, self.k_direct)
        vbuf = kbuf
        if not self.mla:
            vbuf = self._gather("v", v_cache, pages, runs, self.dv, vs, self.v_direct)
        h, e = self.h_cache, self.e
        kflat: _Source | None = None
        vflat: _Source | None = None
        if plan.in_place:  # the cache itself, [rows, heads, e]
            kflat = (k_cache, h, e, h * e)
            vflat = kflat if self.mla else (v_cache, h, e, h * e)
        qc = q if self.q_direct else _widen(q, self.d, self.e, self.dtype)
        result = self._attend(plan, qc, (kbuf, kflat), (vbuf, vflat), scale, sinks, return_lse)
        # The contract: NaN in a query row gives NaN in that row (out and lse), in every
        # backend. The CPU flash kernel's running max skips a NaN score and returns the row
        # as if the query were finite, so the rows are marked here. First one reduction with
        # no temporary: a NaN in q makes the sum NaN, so a sum that is not NaN proves q has
        # none; only a NaN sum (NaN in q, or +inf meeting -inf) looks row by row.
        if bool(q.sum().isnan()):
            bad = q.isnan().any(dim=-1)
            out, lse = result if isinstance(result, tuple) else (result, None)
            out.masked_fill_(bad.unsqueeze(-1), math.nan)
            if lse is not None:
                lse.masked_fill_(bad, math.nan)
        return result

    def _gather(
        self, name: str, cache: torch.Tensor, pages: torch.Tensor,
        runs: tuple[tuple[int, int], ...] | None, width: int, scale: float, direct: bool,
    ) -> _Source:  # fmt: skip
        """The pages of ``pages`` in the compute dtype, converted, scaled and padded to ``e``
        columns when the cache is FP8, another dtype or narrower. On CPU head-major
        ``[heads, rows, e]`` in this thread's buffer (the layout the CPU flash kernel reads
        fastest; bench/sdpa_notes.md); on CUDA ``[rows, heads, e]``."""
        ps, h, e = self.config.page_size, self.h_cache, self.e
        n = pages.numel()
        rows = n * ps
        if n == 0:  # every request is read in place
            return torch.empty(0, dtype=self.dtype, device=cache.device), h, 0, 0
        if self.device_type == "cpu":
            assert runs is not None
            buf = self._buffers.get(name, rows * h * e, self.dtype, zero=width < e)
            # Padding columns sit at the same offsets (mod e) whatever the row count, so the
            # zeros written when the buffer was made stay zero: gathers write columns < width.
            out = buf.view(h, n, ps, e)
            target = out[..., :width] if width < e else out
            paged = cache.view(cache.shape[0], ps, h, width)
            nbytes = n * ps * h * width * cache.element_size()
            if len(runs) <= RUN_COPY_MAX_RUNS and len(runs) * RUN_COPY_MIN_BYTES <= nbytes:
                # One copy per run, transposing (and converting) as it goes. The page
                # indices were checked against this cache at the call (``TensorChecks``).
                src = paged.permute(2, 0, 1, 3)
                j = 0
                for p, count in runs:
                    target[:, j : j + count].copy_(src[:, p : p + count])
                    j += count
            else:
                scratch = self._buffers.get(
                    name + "_rows", rows * h * width, cache.dtype, zero=False
                ).view(n, ps, h, width)
                torch.index_select(paged, 0, pages, out=scratch)
                target.copy_(scratch.permute(2, 0, 1, 3))
            if scale != 1.0:
                target.mul_(scale)
            return buf, h, rows * e, e
        if direct:
            out = cache.view(cache.shape[0], -1).index_select(0, pages)
            return out, h, e, h * e
        picked = cache.index_select(0, pages).view(rows, h, width)
        out = torch.zeros(rows, h, e, dtype=self.dtype, device=cache.device)
        target = out[..., :width] if width < e else out
        target.copy_(picked)
        if scale != 1.0:
            target.mul_(scale)
        return out, h, e, h * e

    def _attend(
        self,
        plan: SdpaPlan,
        q: torch.Tensor,
        keys: tuple[_Source, _Source | None],
        values: tuple[_Source, _Source | None],
        scale: float,
        sinks: torch.Tensor | None,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hq, e, dv = self.hq, self.e, self.dv
        t = plan.num_tokens
        calls = plan.calls
        one = len(calls) == 1 and len(calls[0].parts) == 1 and calls[0].count * calls[0].n == t
        need_lse = return_lse or sinks is not None
        out: torch.Tensor | None = None
        lse_out: torch.Tensor | None = None
        if not one:
            out = torch.empty(t, hq, dv, dtype=self.q_dtype, device=q.device)
            if return_lse:
                lse_out = torch.empty(t, hq, dtype=torch.float32, device=q.device)
        for call in calls:
            m = call.count * call.n
            qv = q[call.q0 : call.q0 + m].reshape(call.count, call.n, hq, e).transpose(1, 2)
            merged = len(call.parts) > 1
            o_acc: torch.Tensor | None = None
            l_acc: torch.Tensor | None = None
            for part in call.parts:
                kv = _rows(keys[call.source], call, part, e)
                vv = _rows(values[call.source], call, part, e)
                o, lse = self._sdpa(qv, kv, vv, part, scale, need_lse or merged)
                if o_acc is None or l_acc is None or lse is None:
                    o_acc, l_acc = o, lse
                    continue
                o_acc, l_acc = _merge(o_acc, l_acc, o, lse)
            assert o_acc is not None
            if sinks is not None:
                assert l_acc is not None
                o_acc, l_acc = _with_sinks(o_acc, l_acc, sinks)
            rows_o = o_acc.transpose(1, 2).reshape(m, hq, e)
            if one:
                res = rows_o if dv == e else rows_o[..., :dv]
                res = res if res.dtype == self.q_dtype and res.is_contiguous() else _to(res, self)
                if not return_lse:
                    return res
                assert l_acc is not None
                return res, l_acc.transpose(1, 2).reshape(m, hq).float().contiguous()
            assert out is not None
            out[call.q0 : call.q0 + m].copy_(rows_o if dv == e else rows_o[..., :dv])
            if lse_out is not None:
                assert l_acc is not None
                lse_out[call.q0 : call.q0 + m].copy_(l_acc.transpose(1, 2).reshape(m, hq))
        assert out is not None
        return (out, lse_out) if lse_out is not None else out

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        part: _Part,
        scale: float,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One fused call: ``[B, Hq, n, e]`` out and ``[B, Hq, n]`` float32 LSE (natural log;
        None when not asked for on CUDA)."""
        if self.device_type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, part.causal, attn_mask=part.mask, scale=scale
            )
            return out, lse
        if not need_lse:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=part.mask, is_causal=part.causal, scale=scale,
                enable_gqa=self.hq != self.hkv,
            )  # fmt: skip
            return out, None
        # CUDA with the LSE: the memory-efficient op returns it (natural log, padded to 32
        # query rows). It takes no grouped heads: repeat K/V per query head.
        group = self.hq // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        mask = part.mask
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], *mask.shape)
        out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, part.causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()

    # -- the decompressed, chunked-prefix form of MLA layers ------------------------------------

    def chunked_handler(self, phase: Phase) -> Any:
        """Handler of ``AttnForm.MHA_CHUNKED``: ``run(q, k_new, v_new, batch, sm_scale,
        prefix)``; the prefix chunks and the new tokens are parts merged by their LSE."""
        return self.run_chunked

    def run_chunked(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        batch: AttnBatch,
        sm_scale: float,
        prefix: Iterable[tuple[torch.Tensor, torch.Tensor, Sequence[int]]] | None = None,
        *,
        sinks: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if c.sinks:
            self._checks.check_sinks(sinks, q)
        elif sinks is not None:
            raise InvalidBatchError("sinks", "given to a layer whose config has sinks=False")
        if prefix is None:
            raise InvalidBatchError(
                "prefix",
                "the 'mha_chunked' form needs the cached prefix as chunks: "
                "attention(q, k_new, v_new, sm_scale=..., prefix=latent_prefix_chunks(...))",
            )
        if batch.custom_mask is not None:
            raise InvalidBatchError("custom_mask", "the 'mha_chunked' form is causal only")
        scale = call_scale("sm_scale", sm_scale)
        snap = BatchSnapshot.of(batch, None)  # this form's plan: checked here, once per layer
        t = snap.num_tokens
        for name, x, d in (("q", q, self.d), ("k_new", k_new, self.d), ("v_new", v_new, self.dv)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (t, self.hq, d):
                raise InvalidBatchError(
                    name,
                    f"shape {tuple(getattr(x, 'shape', ()))} != [{t}, {self.hq}, {d}] (new tokens)",
                )
            if x.dtype != self.q_dtype or x.device != q.device:
                raise InvalidBatchError(
                    name, f"dtype {x.dtype} on {x.device}, want {self.q_dtype} on {q.device}"
                )
        b = snap.num_requests
        hq, dv = self.hq, self.dv
        out = torch.empty(t, hq, dv, dtype=self.q_dtype, device=q.device)
        lse_out = torch.empty(t, hq, device=q.device) if return_lse else None
        if b == 0:
            return (out, lse_out) if lse_out is not None else out
        qo = snap.qo_indptr_host.tolist()
        lens = snap.kv_lens_host.tolist()
        first = [lens[i] - (qo[i + 1] - qo[i]) for i in range(b)]
        masks = _MaskCache(self.dtype, q.device)
        qc = _widen(q, self.d, self.e, self.dtype)
        kc = _widen(k_new, self.d, self.e, self.dtype)
        vc = _widen(v_new, self.dv, self.e, self.dtype)
        need_lse = True
        # The new tokens first: every row sees itself, so each state starts non-empty.
        state: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(b):
            q0, q1 = qo[i], qo[i + 1]
            qv = qc[q0:q1].transpose(0, 1).unsqueeze(0)
            kv = kc[q0:q1].transpose(0, 1).unsqueeze(0)
            vv = vc[q0:q1].transpose(0, 1).unsqueeze(0)
            part = self._new_part(first[i], lens[i], masks)
            o, lse = self._sdpa(qv, kv, vv, part, scale, need_lse)
            assert lse is not None
            state.append((o.float(), lse))
        seen = [0] * b
        for k_c, v_c, indptr in prefix:
            ind = [int(x) for x in indptr]
            if len(ind) != b + 1:
                raise InvalidBatchError(
                    "prefix", f"chunk indptr has {len(ind)} entries, want {b + 1}"
                )
            kcw = _widen(k_c, self.d, self.e, self.dtype)
            vcw = _widen(v_c, self.dv, self.e, self.dtype)
            for i in range(b):
                r0, r1 = ind[i], ind[i + 1]
                if r1 <= r0:
                    continue
                k0 = seen[i]
                seen[i] += r1 - r0
                if seen[i] > first[i]:
                    break  # reported below
                q0, q1 = qo[i], qo[i + 1]
                los = [self._lo(p) for p in range(first[i], lens[i])]
                if min(los) >= seen[i]:
                    continue  # no row sees any key of this chunk
                mask = None
                row_any = None
                if max(los) > k0:
                    keys = torch.arange(k0, seen[i])[None, :]
                    allowed = keys >= torch.tensor(los)[:, None]
                    mask = masks.additive(allowed)
                    row_any = allowed.any(dim=1).to(q.device)
                qv = qc[q0:q1].transpose(0, 1).unsqueeze(0)
                kv = kcw[r0:r1].transpose(0, 1).unsqueeze(0)
                vv = vcw[r0:r1].transpose(0, 1).unsqueeze(0)
                o, lse = self._sdpa(qv, kv, vv, _Part(k0, seen[i], mask=mask), scale, need_lse)
                assert lse is not None
                if row_any is not None:  # rows that saw no key of the chunk: an empty state
                    lse = lse.masked_fill(~row_any, _NEG_INF)
                state[i] = _merge(state[i][0], state[i][1], o, lse)
        bad = next((i for i in range(b) if seen[i] != first[i]), None)
        if bad is not None:
            raise InvalidBatchError(
                "prefix",
                f"chunks cover {seen[bad]} prefix tokens but the request has {first[bad]}",
                request=bad,
            )
        for i in range(b):
            o, lse = state[i]
            if sinks is not None:
                o, lse = _with_sinks(o, lse, sinks)
            n = qo[i + 1] - qo[i]
            out[qo[i] : qo[i + 1]].copy_(o[0].transpose(0, 1)[..., :dv])
            if lse_out is not None:
                lse_out[qo[i] : qo[i + 1]].copy_(lse[0].transpose(0, 1).reshape(n, hq))
        return (out, lse_out) if lse_out is not None else out

    def _new_part(self, first: int, end: int, masks: _MaskCache) -> _Part:
        """The new tokens (positions ``first:end``) against themselves: a causal square, or a
        mask when a window or chunk cuts it."""
        n = end - first
        if not self.config.causal:
            return _Part(0, n)
        los = [self._lo(p) for p in range(first, end)]
        if all(lo <= first for lo in los):
            return _Part(0, n, causal=True)
        pos = torch.arange(first, end)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= torch.tensor(los)[:, None])
        return _Part(0, n, mask=masks.additive(allowed))


class _MaskCache:
    """Additive masks in the compute dtype on the device; a pattern named by a ``key`` is
    made once per plan (calls with the same mask object can then be grouped). The storage
    has a multiple of 16 columns (CUDA's memory-efficient kernel needs aligned rows); the
    mask is a view of it."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.seen: dict[tuple[Any, ...], torch.Tensor] = {}

    def additive(self, allowed: torch.Tensor, key: tuple[Any, ...] | None = None) -> torch.Tensor:
        if key is not None and key in self.seen:
            return self.seen[key]
        n, k = allowed.shape
        store = torch.zeros(n, -(-k // 16) * 16, dtype=self.dtype, device=self.device)
        store[:, :k].masked_fill_(~allowed.to(self.device, torch.bool), _NEG_INF)
        mask = store[:, :k]
        if key is not None:
            self.seen[key] = mask
        return mask


def _page_list(
    indices: torch.Tensor, gather: list[tuple[int, int]], dev: torch.device
) -> torch.Tensor:
    """int64 page indices of the gathered requests (the first ``pages`` of each table),
    taken from the snapshot's own copy on its device (no device-to-host read)."""
    if not gather:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    pos = torch.cat([torch.arange(s, s + n) for s, n in gather])
    return indices.index_select(0, pos.to(dev)).long()


def _runs(host_idx: list[int], gather: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The gathered pages as runs ``(first page, count)`` of consecutive page indices."""
    runs: list[list[int]] = []
    for start, need in gather:
        for p in host_idx[start : start + need]:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
    return tuple((p, c) for p, c in runs)


def _group(
    units: list[tuple[int, int, int, tuple[_Part, ...]]],
    where: list[tuple[int, int]],
    lens: list[int],
) -> tuple[_Call, ...]:
    """Fold adjacent units of one shape whose keys sit at a constant stride into one call."""
    calls: list[_Call] = []
    for req, q0, n, parts in units:
        src, base = where[req]
        last = calls[-1] if calls else None
        if (
            last is not None
            and last.n == n
            and last.source == src
            and last.q0 + last.count * last.n == q0
            and _same_parts(last.parts, parts)
        ):
            stride = base - last.base if last.count == 1 else last.stride
            if stride > 0 and base == last.base + last.count * stride:
                calls[-1] = dataclasses.replace(last, count=last.count + 1, stride=stride)
                continue
        calls.append(_Call(1, q0, n, src, base, max(lens[req], 1), parts))
    return tuple(calls)


def _same_parts(a: tuple[_Part, ...], b: tuple[_Part, ...]) -> bool:
    return len(a) == len(b) and all(
        x.k0 == y.k0 and x.k1 == y.k1 and x.causal == y.causal and x.mask is y.mask
        for x, y in zip(a, b, strict=True)
    )


def _rows(src: _Source | None, call: _Call, part: _Part, e: int) -> torch.Tensor:
    """``[count, heads, k1 - k0, e]``: keys ``k0:k1`` of each request of ``call``, a view of
    ``src`` (``(tensor, heads, head stride, row stride)``)."""
    assert src is not None
    t, h, hs, rs = src
    return t.as_strided(
        (call.count, h, part.k1 - part.k0, e),
        (call.stride * rs, hs, rs, 1),
        t.storage_offset() + (call.base + part.k0) * rs,
    )


def _widen(x: torch.Tensor, width: int, e: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., width]`` in ``dtype`` with zero columns up to ``e`` (a copy only when
    needed)."""
    if width == e:
        return x if x.dtype == dtype else x.to(dtype)
    return F.pad(x.to(dtype), (0, e - width))


def _to(x: torch.Tensor, backend: SdpaBackend) -> torch.Tensor:
    return x.to(backend.q_dtype).contiguous()


def _merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention states over disjoint keys -> the state over their union (fp32).
    ``l1`` may be -inf (an empty part); ``l2`` is never (every row saw a key there)."""
    w = torch.sigmoid(l1 - l2).unsqueeze(-1)
    o2f = o2.float()
    return torch.lerp(o2f, o1.float(), w), torch.logaddexp(l1, l2)


def _with_sinks(
    o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per head to the normaliser: ``out * sigmoid(lse - sink)`` and
    ``logaddexp(lse, sink)`` (a NaN sink gives NaN, +inf all-zero rows, -inf no sink)."""
    s = sinks.to(o.device, torch.float32).view(1, -1, 1)
    return o.float() * torch.sigmoid(lse - s).unsqueeze(-1), torch.logaddexp(lse, s)
