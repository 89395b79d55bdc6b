"""The reference backend's online softmax: running max, sum and output over key chunks.

The numbers every backend is tested against: fp32 accumulation, the logit cap on each
chunk's scores, sinks joining the normaliser at the end, and one rule for non-finite values
(docs/concepts/safety.md). The attention state (``lse``) is read off the same running sums.
"""

from __future__ import annotations

import math

import torch

__all__ = ["_OnlineSoftmax"]


class _OnlineSoftmax:
    """Running max/sum/accumulator over key chunks for padded queries ``[B, Hkv, G, Mq, D]``.

    Rows that have seen no visible key keep max = -inf and contribute exp(-inf) = 0, so fully
    masked padding never produces NaN. ``cap``: the logit soft-cap (None = off).

    Non-finite values follow one rule (docs/concepts/safety.md): a key a row does not see
    never reaches it, whatever it holds (its weight is exactly 0, and its value row is zeroed
    where it is not finite, since 0 * NaN is NaN); a row that sees a key whose score is not
    finite (NaN or inf in q or the key, or an overflow) or a value row holding NaN or inf
    gives NaN.
    """

    def __init__(self, q: torch.Tensor, dv: int, cap: float | None = None) -> None:
        self.q = q
        self.cap = cap
        # fp32 whatever torch's default dtype is (q is fp32: see _padded_q).
        self.m = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        self.l_sum = torch.zeros_like(self.m)
        self.acc = torch.zeros(*q.shape[:-1], dv, dtype=torch.float32, device=q.device)
        self.bad = torch.zeros(q.shape[:-1], dtype=torch.bool, device=q.device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sm_scale: float
    ) -> None:
        """``k``/``v``: ``[B, Hkv, N, D]``; ``allowed``: ``[B, Mq, N]``."""
        s = torch.einsum("bhgqd,bhnd->bhgqn", self.q, k) * sm_scale
        seen = allowed[:, None, None]  # [B, 1, 1, Mq, N]
        s_bad = ~torch.isfinite(s)
        v_fin = torch.isfinite(v)
        v_bad = ~v_fin.all(dim=-1)  # [B, Hkv, N]
        read_bad = (s_bad | v_bad[:, :, None, None, :]) & seen
        self.bad |= read_bad.any(dim=-1)
        s = s.masked_fill(s_bad, 0.0)
        if self.cap is not None:
            s = torch.tanh(s / self.cap) * self.cap
        s = s.masked_fill(~seen, -math.inf)
        m_new = torch.maximum(self.m, s.amax(dim=-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift[..., None])
        alpha = torch.exp(self.m - shift)
        self.l_sum = self.l_sum * alpha + p.sum(dim=-1)
        v = torch.where(v_fin, v, 0.0)  # rows that read such a value are marked bad above
        self.acc = self.acc * alpha[..., None] + torch.einsum("bhgqn,bhnd->bhgqd", p, v)
        self.m = m_new

    def result(self, heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, Mq, Hq, Dv]`` in fp32; ``sinks`` (``[Hq]``) join the normaliser:
        ``sum_j e^(s_j - M) v_j / (sum_j e^(s_j - M) + e^(sink - M))``. A NaN sink gives NaN
        rows, a +inf sink takes all the weight (rows of 0), a -inf sink is no sink."""
        bad = self.bad
        if sinks is None:
            res = self.acc / self.l_sum.clamp_min(1e-30)[..., None]
        else:
            hkv, g = self.m.shape[1], self.m.shape[2]
            sink = sinks.to(self.m.device, torch.float32).view(1, hkv, g, 1)
            big = torch.maximum(self.m, sink)
            big = torch.where(torch.isinf(big), torch.zeros_like(big), big)
            alpha = torch.exp(self.m - big)
            denom = (self.l_sum * alpha + torch.exp(sink - big)).clamp_min(1e-30)
            res = self.acc * (alpha / denom)[..., None]
            res = torch.where((sink == math.inf)[..., None], 0.0, res)
            bad = bad | torch.isnan(sink)
        res = torch.where(bad[..., None], math.nan, res)
        b, _, _, mq, dv = res.shape
        return res.permute(0, 3, 1, 2, 4).reshape(b, mq, heads, dv)

    def lse(self, heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, Mq, Hq]`` float32: ``log(sum_j e^(s_j) + e^(sink))`` over the keys each row
        saw (the scores after scale and cap; the sink counted once). A row that saw no key
        (and no sink, or a -inf one) gives -inf; a +inf sink gives +inf; a row whose output is
        NaN (it read a non-finite key or value, or a NaN sink) gives NaN."""
        m = torch.where(torch.isinf(self.m), torch.zeros_like(self.m), self.m)
        total = self.l_sum * torch.exp(self.m - m)  # sum_j e^(s_j - m), 0 for an empty row
        bad = self.bad
        if sinks is not None:
            hkv, g = self.m.shape[1], self.m.shape[2]
            sink = sinks.to(self.m.device, torch.float32).view(1, hkv, g, 1).expand_as(m)
            big = torch.maximum(self.m, sink)
            big = torch.where(torch.isinf(big), torch.zeros_like(big), big)
            total = total * torch.exp(m - big) + torch.exp(sink - big)
            m = big
            bad = bad | torch.isnan(sink)
            inf_sink = sink == math.inf
        lse = m + torch.log(total)  # log(0) = -inf: an empty row
        if sinks is not None:
            lse = torch.where(inf_sink, math.inf, lse)
        lse = torch.where(bad, math.nan, lse)
        b, _, _, mq = lse.shape
        return lse.permute(0, 3, 1, 2).reshape(b, mq, heads)
