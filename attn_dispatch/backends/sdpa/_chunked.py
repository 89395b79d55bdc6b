"""The decompressed, chunked-prefix form of MLA layers (``AttnForm.MHA_CHUNKED``) on sdpa.

``run(q, k_new, v_new, batch, sm_scale, prefix)``: the new tokens against themselves first
(every row sees itself, so each state starts non-empty), then each prefix chunk as a part
merged by its LSE; rows that see no key of a chunk (a window or chunk boundary) merge an
empty state. Sinks are folded into the LSE at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from attn_dispatch.backends.sdpa._fused import MaskCache
from attn_dispatch.backends.sdpa._fused import Part
from attn_dispatch.backends.sdpa._fused import fused
from attn_dispatch.backends.sdpa._fused import merge
from attn_dispatch.backends.sdpa._fused import widen
from attn_dispatch.backends.sdpa._fused import with_sinks

if TYPE_CHECKING:
    from attn_dispatch import AttnBatch
    from attn_dispatch.backends.sdpa.backend import SdpaBackend

__all__ = ["run_chunked"]


def run_chunked(
    be: SdpaBackend,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    batch: AttnBatch,
    sm_scale: float,
    prefix: Iterable[tuple[torch.Tensor, torch.Tensor, Sequence[int]]] | None,
    sinks: torch.Tensor | None,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # The form's call checks, every backend's (attn_dispatch.backend.TensorChecks): the
    # keywords, prefix, causal batch, scale, and the new tokens' rows.
    snap, scale = be.checks.check_chunked(
        q, k_new, v_new, batch, sm_scale, prefix, sinks=sinks, return_lse=return_lse
    )
    t = snap.num_tokens
    b = snap.num_requests
    hq, dv, e = be.hq, be.dv, be.e
    out = torch.empty(t, hq, dv, dtype=be.q_dtype, device=q.device)
    # The attention state is float32 whatever torch's default dtype is.
    lse_out = torch.empty(t, hq, dtype=torch.float32, device=q.device) if return_lse else None
    if b == 0:
        return (out, lse_out) if lse_out is not None else out
    qo = snap.qo_indptr_host.tolist()
    lens = snap.kv_lens_host.tolist()
    first = [lens[i] - (qo[i + 1] - qo[i]) for i in range(b)]
    masks = MaskCache(be.dtype, q.device)
    qc = widen(q, be.d, e, be.dtype)
    kc = widen(k_new, be.d, e, be.dtype)
    vc = widen(v_new, be.dv, e, be.dtype)
    dev_type, grouped = be.device_type, be.hq != be.hkv
    state: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(b):
        q0, q1 = qo[i], qo[i + 1]
        qv = qc[q0:q1].transpose(0, 1).unsqueeze(0)
        kv = kc[q0:q1].transpose(0, 1).unsqueeze(0)
        vv = vc[q0:q1].transpose(0, 1).unsqueeze(0)
        part = be.planner.new_part(first[i], lens[i], masks)
        o, lse = fused(dev_type, grouped, qv, kv, vv, part, scale, True)
        assert lse is not None
        state.append((o.float(), lse))
    seen = [0] * b
    for k_c, v_c, ind in be.checks.prefix_chunks(prefix, snap, q):  # each one checked
        kcw = widen(k_c, be.d, e, be.dtype)
        vcw = widen(v_c, be.dv, e, be.dtype)
        for i in range(b):
            r0, r1 = ind[i], ind[i + 1]
            if r1 <= r0:
                continue
            k0 = seen[i]
            seen[i] += r1 - r0  # within the prefix: prefix_chunks refuses a chunk past it
            q0, q1 = qo[i], qo[i + 1]
            los = [be.planner.lo(p) for p in range(first[i], lens[i])]
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
            empty = None if row_any is None else ~row_any
            part = Part(k0, seen[i], mask=mask, empty=empty)
            o, lse = fused(dev_type, grouped, qv, kv, vv, part, scale, True)
            assert lse is not None
            state[i] = merge(state[i][0], state[i][1], o, lse)
    for i in range(b):
        o, lse = state[i]
        if sinks is not None:
            o, lse = with_sinks(o, lse, sinks)
        n = qo[i + 1] - qo[i]
        out[qo[i] : qo[i + 1]].copy_(o[0].transpose(0, 1)[..., :dv])
        if lse_out is not None:
            lse_out[qo[i] : qo[i + 1]].copy_(lse[0].transpose(0, 1).reshape(n, hq))
    return (out, lse_out) if lse_out is not None else out
