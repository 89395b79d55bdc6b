"""The torch reference backend: clear, vectorised PyTorch with fp32 accumulation.

Requests are padded into one batch; keys are walked in chunks of pages with an online softmax,
so no more than one chunk of scores exists at a time (a 32k decode never materialises 32k
scores per head), and queries are blocked so long prefills stay bounded too.

Layer variants: a sliding window is planned per (query block, request) as the first page any
of those queries can see, so chunks wholly outside the window are never gathered (a decode
reads ``window_left + 1`` keys per request, rounded out to pages); the logit cap applies to the
scores of each chunk; sinks join the normaliser at the end. An FP8 cache is dequantised one
chunk at a time (gathered pages only, never the whole cache). The attention state
(``return_lse=True``) is read off the same online softmax: running max plus log of the running
sum, with the sink counted once; every form returns it (the chunked-prefix one included).

Window semantics, including tree verify: a query sees the ``window_left + 1`` most recent keys
*of its own sequence*. Without a custom mask that is keys at positions ``p - window_left ..= p``
(docs/guides/variants.md). With a tree mask, the sequence of a draft node is the prefix plus
its ancestors (the keys its mask allows, in cache order), so the node sees the last
``window_left + 1`` of those: exactly what decoding that path token by token would see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import torch

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import Handler
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import Phase
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backend import check_plan
from attn_dispatch.backend import chunk_tree_mask
from attn_dispatch.backend import issue_plan
from attn_dispatch.backend import window_tree_mask
from attn_dispatch.backends.reference._seal import Seals
from attn_dispatch.backends.reference._softmax import _OnlineSoftmax

if TYPE_CHECKING:
    from attn_dispatch import AttnBatch

# Max fp32 score elements alive at once (64 MiB): bounds memory for any context length.
SCORE_BUDGET = 1 << 24
CHUNK_TOKENS = 2048


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TorchPlan(PlanBase):
    """One forward's plan: made by ``TorchBackend.plan``, accepted only by that object."""

    owner: TorchBackend
    snap: BatchSnapshot
    page_table: torch.Tensor  # int64 [B, max_pages], padded with page 0 (masked by kv_lens)
    q_rows: torch.Tensor  # int64 [B, max_q], row of q per (request, slot); pads point at row 0
    q_valid: torch.Tensor  # bool [B, max_q]
    out_rows: torch.Tensor  # int64 [T]: flat (request, slot) index of each query in [B * max_q]
    q_pos: torch.Tensor  # int64 [B, max_q], absolute position of each query in its sequence
    kv_lens: torch.Tensor  # int64 [B]
    mask: torch.Tensor | None  # bool [B, max_q, max_kv] (tree verify), else None
    chunk_pages: int
    q_block: int
    # Per query block: (first page column any query of the block may see, per request [B];
    # page columns to walk from there; first key position visible, per request [B]).
    blocks: tuple[tuple[torch.Tensor, int, torch.Tensor], ...]


class TorchBackend(BackendBase):
    """Reference attention for MHA/GQA and absorbed MLA, every phase, CPU or CUDA.

    Every call is checked before any tensor is indexed (``TensorChecks``); on a CUDA batch
    whose page indices were not read at plan time, page indices are clamped into the
    cache given at the call (``validate=True`` reads and checks them at plan time instead).
    """

    name = "torch"

    def __init__(
        self,
        config: AttnConfig,
        *,
        score_budget: int = SCORE_BUDGET,
        validate: bool = False,
    ) -> None:
        """``score_budget``: max fp32 scores alive at once; ``validate``: on CUDA, read the
        page indices back at plan time to check them (a host sync per forward)."""
        self.config = config
        self.score_budget = int(score_budget)
        if not isinstance(validate, bool):  # the flag rule of every backend: a Python bool
            raise InvalidSpecError("validate", validate, "must be a bool (True or False)")
        self.validate = validate
        self.q_dtype = getattr(torch, config.dtype)
        self.kv_dtype = getattr(torch, str(config.kv_dtype))
        self._checks = TensorChecks.of(config, backend="torch")
        # What each issued plan held when it was made (kept here, not in the plan).
        self._seals = Seals()

    # -- planning (once per forward) ----------------------------------------------------------

    def plan(self, batch: AttnBatch) -> TorchPlan:
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self.validate)
        dev = snap.device
        qo = snap.qo_indptr_host.tolist()
        kv = snap.kv_indptr_host.tolist()
        b = snap.num_requests
        ps = self.config.page_size
        max_q = max(snap.max_q_len, 1)
        counts = [kv[i + 1] - kv[i] for i in range(b)]
        max_pages = max(max(counts, default=0), 1)
        # Gather the padded page tables on the device (no device-to-host copy of kv_indices);
        # pads read one extra entry, page 0, that kv_lens masks.
        n = snap.kv_indices.numel()
        slots_p = torch.arange(max_pages)
        have = torch.tensor(counts, dtype=torch.int64).view(b, 1)
        starts_p = torch.tensor(kv[:-1], dtype=torch.int64).view(b, 1)
        pos = torch.where(slots_p[None, :] < have, starts_p + slots_p, n)
        padded = torch.cat((snap.kv_indices.long(), torch.zeros(1, dtype=torch.int64, device=dev)))
        page_table = padded[pos.to(dev)]
        slots = torch.arange(max_q)
        q_lens = torch.tensor([qo[i + 1] - qo[i] for i in range(b)], dtype=torch.int64)
        starts = torch.tensor(qo[:-1], dtype=torch.int64)
        q_valid = slots[None, :] < q_lens[:, None]
        q_rows = torch.where(q_valid, starts[:, None] + slots[None, :], 0)
        kv_lens = snap.kv_lens_host.long()
        q_pos = kv_lens[:, None] - q_lens[:, None] + slots[None, :]
        mask = None
        window = self.config.window_left
        chunk = self.config.attention_chunk_size
        if snap.custom_mask is not None:
            assert snap.mask_indptr is not None
            mask = torch.zeros(b, max_q, max_pages * ps, dtype=torch.bool, device=dev)
            lens = kv_lens.tolist()
            off = 0
            for i in range(b):
                ql, kl = qo[i + 1] - qo[i], lens[i]
                mask[i, :ql, :kl] = snap.custom_mask[off : off + ql * kl].view(ql, kl)
                off += ql * kl
            if chunk is not None:  # the chunk first, then the window (see chunk_tree_mask)
                mask = chunk_tree_mask(mask, chunk)
            if window is not None:
                mask = window_tree_mask(mask, window)
        heads = self.config.num_q_heads
        chunk_pages = max(1, CHUNK_TOKENS // ps)
        chunk_tokens = chunk_pages * ps
        q_block = max(1, min(max_q, self.score_budget // max(1, b * heads * chunk_tokens)))
        blocks = _blocks(
            counts, kv_lens.tolist(), q_lens.tolist(), max_q, q_block, ps, window, chunk, mask,
            dev,
        )  # fmt: skip
        plan = TorchPlan(
            owner=self,
            snap=snap,
            page_table=page_table,
            q_rows=q_rows.to(dev),
            q_valid=q_valid.to(dev),
            # Gathering by index, not by the bool mask, keeps run free of host syncs (a mask
            # index needs nonzero()), so a CUDA graph can capture it.
            out_rows=torch.nonzero(q_valid.flatten()).squeeze(1).to(dev),
            q_pos=q_pos.to(dev),
            kv_lens=kv_lens.to(dev),
            mask=mask,
            chunk_pages=chunk_pages,
            q_block=q_block,
            blocks=blocks,
        )
        self._seals.seal(plan)
        return issue_plan(self, plan)

    def handler(self, phase: Phase) -> Handler:
        return self.run

    # -- per layer ----------------------------------------------------------------------------

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: TorchPlan,
        sm_scale: float,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[T, Hq, Dv]`` in q's dtype, or ``(out, lse)`` with ``return_lse=True`` (lse
        float32 ``[T, Hq]``: log of the sum of exp(score) over the keys each row attended,
        the sink included; see ``_OnlineSoftmax.lse``). ``out``: written and returned (the
        fp32 result is rounded into it, in place of a fresh tensor)."""
        check_plan(plan, self, "torch")
        self._checks.check_keywords(q, sinks=sinks, return_lse=return_lse)  # every backend's
        self._seals.verify(plan)  # our error for a plan edited after it was made
        num_pages = self._checks.check(plan.snap, q, k_cache, v_cache)
        c = self.config
        if out is not None:
            self._checks.check_out(out, q, k_cache, v_cache)
        dv = int(c.out_head_dim)
        if plan.snap.num_requests == 0:  # SGLang's IDLE forward: nothing to attend
            return _empty(q, c.num_q_heads, dv, return_lse, out)
        try:
            return self._attend(q, k_cache, v_cache, plan, sm_scale, sinks, k_scale, v_scale,
                                return_lse, num_pages, out)  # fmt: skip
        except IndexError as exc:
            # Every tensor was checked against the plan's snapshot above, so an index out of
            # range can only come from a plan whose index tensors were edited in place (a page
            # table entry past the cache, say): torch bounds-checks each CPU gather (off the
            # CPU the page table is clamped, below); say so in our terms.
            raise InvalidBatchError(
                "plan",
                f"torch: the plan indexes outside the tensors it was given ({exc}); it was "
                "edited after it was made: plan the batch again",
            ) from exc

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: TorchPlan,
        sm_scale: float,
        sinks: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
        return_lse: bool,
        num_pages: int,
        dest: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        mla = c.kind == "mla"
        hkv, dv = c.num_kv_heads, int(c.out_head_dim)
        b, max_q = plan.q_rows.shape
        max_pages = plan.page_table.shape[1]
        ps = c.page_size
        table = plan.page_table
        if plan.snap.max_page is None or not table.is_cpu:
            # Page indices never read on the host (CUDA without validate), or a device gather
            # that would assert (not raise) on an edited table: keep every gather inside this
            # call's cache; an out-of-range index gives wrong numbers, not a fault.
            table = table.clamp(0, max(num_pages - 1, 0))
        window = c.window_left
        chunk = c.attention_chunk_size
        fp8 = c.kv_fp8
        out = torch.empty(b, max_q, c.num_q_heads, dv, dtype=torch.float32, device=q.device)
        lse = (
            torch.empty(b, max_q, c.num_q_heads, dtype=torch.float32, device=q.device)
            if return_lse
            else None
        )
        qp = self._padded_q(q, plan.q_rows)
        in_page = torch.arange(ps, device=q.device)
        for blk, q0 in enumerate(range(0, max_q, plan.q_block)):
            q1 = min(max_q, q0 + plan.q_block)
            first, span, lo = plan.blocks[blk]
            acc = _OnlineSoftmax(qp[:, :, :, q0:q1], dv, c.logit_cap)
            pos = plan.q_pos[:, q0:q1]
            for p0 in range(0, span, plan.chunk_pages):
                p1 = min(span, p0 + plan.chunk_pages)
                cols = first[:, None] + torch.arange(p0, p1, device=q.device)  # [B, np]
                pages = table.gather(1, cols.clamp(max=max_pages - 1))
                n = (p1 - p0) * ps
                # Key positions per request; columns past the table are past kv_len (masked).
                kpos = (cols[:, :, None] * ps + in_page).reshape(b, n)
                kc = k_cache[pages]
                # Slots no query of this block reads (past kv_len, before the window, the pads
                # of short page tables): zero their V so 0 * NaN never reaches the output.
                unread = (kpos >= plan.kv_lens[:, None]) | (kpos < lo[:, None])
                unread = unread[:, None, :, None]
                if mla:
                    k = kc.reshape(b, 1, n, -1).float()
                    if fp8 and k_scale != 1.0:
                        k = k * k_scale
                    v = k[..., :dv].masked_fill(unread, 0.0)
                else:
                    assert v_cache is not None
                    k = kc.reshape(b, n, hkv, -1).transpose(1, 2).float()
                    v = v_cache[pages].reshape(b, n, hkv, dv).transpose(1, 2).float()
                    if fp8:
                        if k_scale != 1.0:
                            k = k * k_scale
                        if v_scale != 1.0:
                            v = v * v_scale
                    v = v.masked_fill(unread, 0.0)
                allowed = (kpos < plan.kv_lens[:, None])[:, None, :]
                if plan.mask is not None:
                    cols_k = kpos.clamp(max=plan.mask.shape[2] - 1)
                    sub = plan.mask[:, q0:q1].gather(2, cols_k[:, None, :].expand(-1, q1 - q0, -1))
                    allowed = allowed & sub
                elif c.causal:
                    allowed = allowed & (kpos[:, None, :] <= pos[:, :, None])
                    if window is not None:
                        allowed = allowed & (kpos[:, None, :] >= pos[:, :, None] - window)
                    if chunk is not None:
                        start = pos - pos % chunk
                        allowed = allowed & (kpos[:, None, :] >= start[:, :, None])
                # causal=False: every key of the request (kv_len bounds it above)
                acc.update(k, v, allowed, sm_scale)
            out[:, q0:q1] = acc.result(c.num_q_heads, sinks)
            if lse is not None:
                lse[:, q0:q1] = acc.lse(c.num_q_heads, sinks)
        rows = out.view(b * max_q, c.num_q_heads, dv).index_select(0, plan.out_rows)
        if dest is None:
            rows = rows.to(q.dtype)
        else:  # the same rounding as .to(q.dtype), into the caller's buffer
            rows = dest.copy_(rows)
        if lse is None:
            return rows
        return rows, lse.view(b * max_q, c.num_q_heads).index_select(0, plan.out_rows)

    def _padded_q(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[T, Hq, D]`` -> ``[B, Hkv, G, Mq, D]`` in fp32 (pads repeat row 0, masked later)."""
        c = self.config
        b, max_q = rows.shape
        return (
            q[rows].float().view(b, max_q, c.num_kv_heads, c.group_size, -1).permute(0, 2, 3, 1, 4)
        )

    # -- the decompressed, chunked-prefix form of MLA layers ------------------------------------

    def chunked_handler(self, phase: Phase) -> Any:
        """Handler of ``AttnForm.MHA_CHUNKED``: ``run(q, k_new, v_new, batch, sm_scale, prefix)``.

        ``q``/``k_new``/``v_new`` are ``[T, H, D]`` rows of the new tokens (aligned with
        ``batch.qo_indptr``); ``prefix`` yields ``(k_chunk, v_chunk, indptr)`` with request
        ``i``'s prefix rows at ``indptr[i]:indptr[i+1]``. Every prefix token is visible to every
        new token; the new tokens attend causally among themselves.
        """
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
        # The form's call checks, every backend's (attn_dispatch.backend.TensorChecks): the
        # keywords, prefix, causal batch, scale, and the new tokens' rows.
        snap, sm_scale = self._checks.check_chunked(
            q, k_new, v_new, batch, sm_scale, prefix, sinks=sinks, return_lse=return_lse
        )
        dv = int(c.out_head_dim)
        b = snap.num_requests
        if b == 0:
            return _empty(q, c.num_q_heads, dv, return_lse)
        qo = snap.qo_indptr_host.tolist()
        max_q = max(snap.max_q_len, 1)
        dev = q.device
        slots = torch.arange(max_q)
        q_lens = torch.tensor([qo[i + 1] - qo[i] for i in range(b)], dtype=torch.int64)
        valid = slots[None, :] < q_lens[:, None]
        rows = torch.where(valid, torch.tensor(qo[:-1])[:, None] + slots[None, :], 0).to(dev)
        valid = valid.to(dev)
        acc = _OnlineSoftmax(self._padded_q(q, rows), dv, c.logit_cap)
        prefix_lens = (snap.kv_lens_host.long() - q_lens).tolist()
        window = c.window_left
        chunk = c.attention_chunk_size
        # Query positions (the prefix comes first, in chunk order): for the window / chunk.
        qpos = torch.tensor(prefix_lens)[:, None] + slots[None, :]
        qstart = qpos - qpos % chunk if chunk is not None else None
        seen = [0] * b
        for k_c, v_c, ind in self._checks.prefix_chunks(prefix, snap, q):  # each one checked
            n = max(max(ind[i + 1] - ind[i] for i in range(b)), 1)
            cs = torch.arange(n)
            clen = torch.tensor([ind[i + 1] - ind[i] for i in range(b)])
            cvalid = cs[None, :] < clen[:, None]
            crow = torch.where(cvalid, torch.tensor(ind[:-1])[:, None] + cs[None, :], 0).to(dev)
            kpos = torch.tensor(seen)[:, None] + cs[None, :]
            for i in range(b):
                seen[i] += ind[i + 1] - ind[i]
            k = k_c[crow].float().transpose(1, 2)  # [B, H, n, D]
            v = v_c[crow].float().transpose(1, 2)
            allowed = cvalid[:, None, :].expand(b, max_q, n)
            if window is not None:
                allowed = allowed & (kpos[:, None, :] >= qpos[:, :, None] - window)
            if qstart is not None:
                allowed = allowed & (kpos[:, None, :] >= qstart[:, :, None])
            acc.update(k, v, allowed.to(dev), sm_scale)
        k = k_new[rows].float().transpose(1, 2)
        v = v_new[rows].float().transpose(1, 2)
        causal = slots[None, :, None] >= slots[None, None, :]
        if not c.causal:
            causal = torch.ones_like(causal)
        if window is not None:
            causal = causal & (slots[None, None, :] >= slots[None, :, None] - window)
        if qstart is not None:  # new key j sits at position prefix + j
            kpos_new = torch.tensor(prefix_lens)[:, None] + slots[None, :]
            causal = causal & (kpos_new[:, None, :] >= qstart[:, :, None])
        acc.update(k, v, causal.to(dev) & valid[:, None, :], sm_scale)
        out = acc.result(c.num_q_heads, sinks)[valid].to(q.dtype)
        if not return_lse:
            return out
        return out, acc.lse(c.num_q_heads, sinks)[valid]


def _empty(
    q: torch.Tensor, heads: int, dv: int, return_lse: bool, given: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The result of a batch of no requests (SGLang's IDLE forward)."""
    out = q.new_empty((0, heads, dv)) if given is None else given
    lse = torch.empty(0, heads, dtype=torch.float32, device=q.device)
    return (out, lse) if return_lse else out


def _blocks(
    counts: list[int],
    kv_lens: list[int],
    q_lens: list[int],
    max_q: int,
    q_block: int,
    ps: int,
    window: int | None,
    chunk: int | None,
    mask: torch.Tensor | None,
    dev: torch.device,
) -> tuple[tuple[torch.Tensor, int, torch.Tensor], ...]:
    """For each query block: the first page column each request's queries may see, how many
    columns to walk, and the first visible key position (host ints, made once per plan).

    The column count depends on the config and the table width only (never on the lengths),
    so a CUDA graph captured with one batch replays another of the same shape."""
    max_pages = max(max(counts, default=0), 1)
    out = []
    first_seen: list[list[int]] | None = None
    limited = window is not None or chunk is not None
    if limited and mask is not None and mask.device.type == "cpu":
        # A custom mask may hide prefix keys, so the last window_left + 1 keys a node sees can
        # start anywhere: the first key each row's (window-folded) mask allows, read on the
        # host. On a device mask that would be a sync: walk from key 0 there.
        big = mask.shape[2]
        first_seen = torch.where(
            mask.any(dim=-1), mask.int().argmax(dim=-1), torch.full((), big)
        ).tolist()
    for q0 in range(0, max_q, q_block):
        q1 = min(max_q, q0 + q_block)
        if not limited:
            zeros = torch.zeros(len(counts), dtype=torch.int64, device=dev)
            out.append((zeros, max_pages, zeros))
            continue
        # Visible positions of one request's block span at most window + (q1 - q0) keys, or
        # chunk - 1 + (q1 - q0). With a mask the visible keys of a row need not be
        # contiguous: walk every column from the first one.
        reach = min(x for x in (window, None if chunk is None else chunk - 1) if x is not None)
        width = reach + (q1 - q0)
        span = max_pages if mask is not None else min(max_pages, -(-width // ps) + 1)
        firsts, los = [], []
        for i, (count, kl, ql) in enumerate(zip(counts, kv_lens, q_lens, strict=True)):
            prefix = kl - ql
            if q0 >= ql:  # no query of this request in the block
                lo = kl
            elif mask is not None:
                # A draft node sees the last window_left + 1 keys its mask allows (the
                # module docstring), which a mask hiding prefix keys can push before
                # prefix - window_left.
                lo = 0 if first_seen is None else min(min(first_seen[i][q0 : min(q1, ql)]), kl)
            else:
                # Pages before the window or the chunk of the block's first query are
                # skipped, not masked (later queries see no earlier key).
                first_pos = prefix + q0
                lo = 0
                if window is not None:
                    lo = max(lo, first_pos - window)
                if chunk is not None:
                    lo = max(lo, first_pos - first_pos % chunk)
            firsts.append(min(lo // ps, count))
            los.append(lo)
        out.append(
            (
                torch.tensor(firsts, dtype=torch.int64, device=dev),
                span,
                torch.tensor(los, dtype=torch.int64, device=dev),
            )
        )
    return tuple(out)
