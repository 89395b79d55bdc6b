// Planning one batch: the config and batch checks (every index the kernels will follow),
// cascade grouping of requests that share leading pages, and the split of the work into items
// and merges.
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "internal.h"

namespace {

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

int fail(NaError* err, int field, int request, int64_t a = 0, int64_t b = 0) {
  if (err) *err = NaError{field, request, a, b};
  return field;
}

// Every check the kernels rely on, in one pass over the host arrays; copies what it reads.
int validate(NaPlan& P, const int32_t* qo, const int32_t* kvp, const int32_t* idx,
             int64_t num_indices, const int32_t* lens, const uint8_t* mask, int64_t mask_len,
             int32_t decode, NaError* err) {
  const int B = P.num_requests;
  const int ps = P.cfg.page_size;
  if (qo[0] != 0) return fail(err, NA_E_QO_INDPTR, -1, qo[0]);
  if (kvp[0] != 0) return fail(err, NA_E_KV_INDPTR, -1, kvp[0]);
  int64_t mask_total = 0;
  for (int i = 0; i < B; ++i) {
    const int64_t q_len = int64_t(qo[i + 1]) - qo[i];
    if (q_len < 0) return fail(err, NA_E_QO_INDPTR, i, qo[i], qo[i + 1]);
    const int64_t n_pages = int64_t(kvp[i + 1]) - kvp[i];
    if (n_pages < 0) return fail(err, NA_E_KV_INDPTR, i, kvp[i], kvp[i + 1]);
    if (kvp[i + 1] > num_indices) return fail(err, NA_E_KV_INDPTR, i, kvp[i + 1], num_indices);
    const int64_t kv_len = lens[i];
    if (kv_len < q_len) return fail(err, NA_E_KV_LENS, i, kv_len, q_len);
    if ((kv_len + ps - 1) / ps > n_pages) return fail(err, NA_E_KV_LENS, i, kv_len, n_pages);
    if (decode && q_len != 1) return fail(err, NA_E_DECODE_QLEN, i, q_len);
    mask_total += q_len * kv_len;
    P.kv_keys += kv_len;
  }
  if (mask != nullptr && mask_total != mask_len) {
    return fail(err, NA_E_MASK, -1, mask_len, mask_total);
  }
  const int64_t used = B > 0 ? kvp[B] : 0;
  int32_t mx = -1;
  for (int i = 0; i < B; ++i) {
    for (int64_t j = kvp[i]; j < kvp[i + 1]; ++j) {
      if (idx[j] < 0) return fail(err, NA_E_KV_INDICES, i, idx[j], j);
      mx = std::max(mx, idx[j]);
    }
  }
  P.max_page = mx;
  P.num_tokens = B > 0 ? qo[B] : 0;
  P.qo.assign(qo, qo + B + 1);
  P.kvp.assign(kvp, kvp + B + 1);
  P.lens.assign(lens, lens + B);
  P.idx.assign(idx, idx + used);
  if (mask != nullptr) {
    P.causal = 0;
    P.mask.assign(mask, mask + mask_len);
    P.mask_indptr.resize(size_t(B) + 1);
    P.mask_indptr[0] = 0;
    for (int i = 0; i < B; ++i) {
      P.mask_indptr[i + 1] = P.mask_indptr[i] + int64_t(qo[i + 1] - qo[i]) * lens[i];
    }
    // A chunk on a custom (tree) mask: a query at sequence position p (its allowed keys - 1)
    // keeps the keys of its own chunk, the last p % chunk + 1 it allows (the reference's
    // chunk_tree_mask); folded in before the window, once per plan.
    const int64_t ck = P.cfg.chunk_size;
    if (ck > 0) {
      for (int i = 0; i < B; ++i) {
        const int64_t kl = lens[i];
        for (int64_t j = 0; j < int64_t(qo[i + 1] - qo[i]); ++j) {
          uint8_t* row = P.mask.data() + P.mask_indptr[i] + j * kl;
          int64_t count = 0;
          for (int64_t t = 0; t < kl; ++t) count += row[t] != 0;
          const int64_t keep = count > 0 ? (count - 1) % ck + 1 : 0;
          int64_t seen = 0;
          for (int64_t t = kl - 1; t >= 0; --t) {
            if (!row[t]) continue;
            if (++seen > keep) row[t] = 0;
          }
        }
      }
    }
    // A window on a custom (tree) mask: each query keeps the window_left + 1 most recent keys
    // its mask allows (the reference's window_tree_mask), folded in once per plan.
    const int64_t w = P.cfg.window_left;
    if (w >= 0) {
      for (int i = 0; i < B; ++i) {
        const int64_t kl = lens[i];
        for (int64_t j = 0; j < int64_t(qo[i + 1] - qo[i]); ++j) {
          uint8_t* row = P.mask.data() + P.mask_indptr[i] + j * kl;
          int64_t seen = 0;
          for (int64_t t = kl - 1; t >= 0; --t) {
            if (!row[t]) continue;
            if (++seen > w + 1) row[t] = 0;
          }
        }
      }
    }
  }
  return 0;
}

// The first key any query in [q0, q1) of request i may see: 0 without a window or chunk.
int first_key(const NaPlan& P, int i, int q0, int q1) {
  const int64_t w = P.cfg.window_left, ck = P.cfg.chunk_size;
  if (w < 0 && ck <= 0) return 0;
  const int q_len = P.qo[i + 1] - P.qo[i];
  const int kv_len = P.lens[i];
  if (P.causal) {
    // The block's first query has the earliest limit: its window or chunk start.
    const int64_t lim = int64_t(kv_len) - q_len + q0;
    int64_t lo = 0;
    if (w >= 0) lo = std::max(lo, lim - w);
    if (ck > 0) lo = std::max(lo, lim - lim % ck);
    return int(lo);
  }
  int first = kv_len;
  for (int j = q0; j < q1; ++j) {
    const uint8_t* row = P.mask.data() + P.mask_indptr[i] + int64_t(j) * kv_len;
    for (int t = 0; t < first; ++t) {
      if (row[t]) {
        first = t;
        break;
      }
    }
  }
  return first;
}

// How many leading keys every query of request i sees whatever its position: the keys a
// cascade tile may read for it without a per-row limit (0: none).
int64_t keys_all_rows_see(const NaPlan& P, int i) {
  const int q_len = P.qo[i + 1] - P.qo[i];
  const int64_t kv_len = P.lens[i];
  if (P.causal) return P.cfg.causal ? kv_len - q_len + 1 : kv_len;
  int64_t lo = kv_len;  // custom mask: the shortest run of allowed keys from 0 over its rows
  for (int j = 0; j < q_len; ++j) {
    const uint8_t* row = P.mask.data() + P.mask_indptr[i] + int64_t(j) * kv_len;
    int64_t t = 0;
    while (t < lo && row[t]) ++t;
    lo = t;
  }
  return lo;
}

// One group of requests whose page tables start with the same `pages` page ids.
struct Group {
  std::vector<int> members;
  int pages = 0;
  int ctok0 = 0, ntok = 0;  // its cascade tokens: ctoks[ctok0 .. ctok0 + ntok)
  int nsplit = 1, chunk = 0;
  int64_t base = 0;  // scratch row of split 0, token 0, head 0
};

// Cascade planning: requests with small tiles (decode, short verify) whose page tables start
// with the same whole pages, read by every query of each of them, form a group; the group's
// shared keys are then read once by tiles spanning all its queries, and each member's own
// keys as before, the two merged by log-sum-exp. Off with a window or a chunk (each row would
// need its own first key) and for long prefill tiles (which read each key for 32 rows already).
std::vector<Group> find_groups(NaPlan& P, int group_heads) {
  std::vector<Group> groups;
  const NaConfig& c = P.cfg;
  if (!c.cascade || c.window_left >= 0 || c.chunk_size > 0) return groups;
  const int ps = c.page_size;
  const int B = P.num_requests;
  std::vector<std::pair<int32_t, int>> firsts;  // (first page, request) of eligible requests
  std::vector<int> usable(size_t(B), 0);        // whole pages every query of i sees
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    if (q_len < 1 || group_heads * q_len > na::kMaxRows / 2) continue;
    const int64_t n_pages = P.kvp[i + 1] - P.kvp[i];
    usable[size_t(i)] = int(std::min<int64_t>(n_pages, keys_all_rows_see(P, i) / ps));
    if (usable[size_t(i)] > 0) firsts.emplace_back(P.idx[size_t(P.kvp[i])], i);
  }
  std::stable_sort(firsts.begin(), firsts.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<int, int>> lcp;  // (shared pages with the run's first request, request)
  for (size_t a = 0; a < firsts.size();) {
    size_t b = a;
    while (b < firsts.size() && firsts[b].first == firsts[a].first) ++b;
    if (b - a >= 2) {
      const int lead = firsts[a].second;
      const int32_t* lp = P.idx.data() + P.kvp[lead];
      lcp.clear();
      for (size_t m = a; m < b; ++m) {
        const int i = firsts[m].second;
        const int32_t* ip = P.idx.data() + P.kvp[i];
        const int most = std::min(usable[size_t(i)], usable[size_t(lead)]);
        int n = 0;
        while (n < most && ip[n] == lp[n]) ++n;
        lcp.emplace_back(n, i);
      }
      // The share length that saves the most key reads, (members - 1) x shared pages, among
      // those of at least kMinCascadeKeys keys (sorted longest first: the rest are shorter).
      std::stable_sort(lcp.begin(), lcp.end(),
                       [](const auto& x, const auto& y) { return x.first > y.first; });
      int64_t best = 0;
      size_t best_n = 0;
      for (size_t k = 1; k < lcp.size(); ++k) {
        if (int64_t(lcp[k].first) * ps < na::kMinCascadeKeys) break;
        const int64_t saved = int64_t(k) * lcp[k].first;
        if (saved > best) best = saved, best_n = k + 1;
      }
      if (best_n >= 2 && int64_t(lcp[best_n - 1].first) * ps >= na::kMinCascadeKeys) {
        Group g;
        g.pages = lcp[best_n - 1].first;
        for (size_t k = 0; k < best_n; ++k) g.members.push_back(lcp[k].second);
        std::sort(g.members.begin(), g.members.end());  // batch order: tokens stay in order
        groups.push_back(std::move(g));
      }
    }
    a = b;
  }
  return groups;
}

int make_items(NaPlan& P) {
  const NaConfig& c = P.cfg;
  const int B = P.num_requests;
  const int Hq = c.num_q_heads;
  // A tile is (request, kv head, head block, query block); its rows share every K/V row read.
  const int group = c.num_q_heads / c.num_kv_heads;
  const int n_hblocks = ceil_div(group, na::kMaxRows);
  const int hb = ceil_div(group, n_hblocks);
  const int qb = std::max(1, na::kMaxRows / hb);
  // Cascade tiles take up to kMaxCascadeRows rows per kv head (one head block): tokens per tile.
  const int cqb = n_hblocks == 1 ? std::max(1, na::kMaxCascadeRows / hb) : qb;
  // A tile whose rows of one kv head are few (decode, short verify) takes several kv heads:
  // each block of tokens is then read whole, in address order (a token's heads are adjacent
  // in the cache), instead of one head's 2 KB-strided rows per tile.
  auto heads_per_rows = [&](int rows) {
    if (n_hblocks != 1 || rows > na::kMaxRows / 2) return 1;
    return std::max(1, std::min(c.num_kv_heads, na::kMaxRows / rows));
  };
  // Wide tiles (kernels.h, kMaxWideRows): a request's tile of exactly 16 rows per kv head (the
  // many-row kernels' threshold) takes every kv head of its tokens, up to kMaxWideRows rows,
  // so each block is read as whole token rows; a short request (at most kWideTokens query
  // tokens: a speculative chain or tree, never a prompt) whose tiles hold kMaxRows rows per kv
  // head (a tree of 8 over GQA groups of 4, a 4-token chain over groups of 8) takes
  // kMaxWideRows / kMaxRows kv heads. `count`: the tiles the split decision counts; a wide
  // tile counts as the tiles of at most kMaxRows rows it stands for (heads_per_rows), so the
  // keys of a batch of GQA 32/8 verify-4 requests are split only below 8 requests. Counted as
  // one tile, a 128-row tile made 4 splits of 512 keys at B8 ctx 2048: each item's start and
  // merge cost ~30 us, and the new plans took 0.84-0.99x the time on 2 threads with
  // vdpbf16ps, 0.94-1.01x on the fp32 paths (1-8 requests; bench/native_notes.md).
  auto heads_per_tile = [&](int q_len, bool count = false) {
    if (n_hblocks == 1 && !count) {
      const int rows = std::min(q_len, qb) * hb;
      const bool wide16 = rows == na::kRowsMinBf16 && q_len <= qb;
      const bool wide32 = rows == na::kMaxRows && q_len <= na::kWideTokens;
      if (wide16 || wide32) return std::max(1, std::min(c.num_kv_heads, na::kMaxWideRows / rows));
    }
    return heads_per_rows(group * q_len);
  };
  std::vector<Group> groups = find_groups(P, group);
  std::vector<int> shared_keys(size_t(B), 0), member_group(size_t(B), -1);
  std::vector<int> member_tok(size_t(B), 0);
  int64_t tiles = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    g.ctok0 = int(P.ctoks.size() / 2);
    for (int i : g.members) {
      shared_keys[size_t(i)] = g.pages * c.page_size;
      member_group[size_t(i)] = int(gi);
      member_tok[size_t(i)] = g.ntok;
      for (int j = 0; j < P.qo[i + 1] - P.qo[i]; ++j) {
        P.ctoks.push_back(i);
        P.ctoks.push_back(j);
        ++g.ntok;
      }
    }
    // Counted as tiles of kMaxRows rows (the work of a wide cascade tile, and the split
    // decision of plans made before such tiles existed).
    const int rows = std::min(g.ntok, qb) * hb;
    tiles += int64_t(ceil_div(c.num_kv_heads, heads_per_rows(rows))) * n_hblocks *
             ceil_div(g.ntok, qb);
    P.cascade_keys += int64_t(g.pages) * c.page_size;
    P.cascade_requests += int64_t(g.members.size());
  }
  P.cascade_groups = int64_t(groups.size());
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    tiles += int64_t(ceil_div(c.num_kv_heads, heads_per_tile(q_len, true))) * n_hblocks *
             ceil_div(q_len, qb);
  }
  // Split the keys only when the tiles alone cannot keep every thread busy. The target is
  // chosen by the caller from a fixed floor, so small thread counts plan the same splits.
  const int64_t target = std::max(1, P.split_target);
  const int want = tiles > 0 && tiles < target ? ceil_div(target, tiles) : 1;
  // How a span of keys is cut: (splits, keys per split), splits 1 meaning whole.
  auto cut = [&](int span, int w) {
    int nsplit = std::max(1, std::min(w, ceil_div(span, na::kMinSplitKeys)));
    int chunk = span;
    if (nsplit > 1) {
      chunk = ceil_div(ceil_div(span, nsplit), na::kBlockKeys) * na::kBlockKeys;
      nsplit = ceil_div(span, chunk);
    }
    return std::make_pair(nsplit, chunk);
  };
  int64_t rows_used = 0;
  P.items.reserve(size_t(tiles) * size_t(want));
  // Cascade tiles first (the largest items: the pool takes items in order).
  for (Group& g : groups) {
    // A wide cascade tile stands for `wide` tiles of kMaxRows rows: when the keys are split,
    // it is split that many times more, so the group still makes about as many items.
    const int wide = ceil_div(ceil_div(g.ntok, qb), ceil_div(g.ntok, cqb));
    std::tie(g.nsplit, g.chunk) = cut(g.pages * c.page_size, want > 1 ? want * wide : 1);
    g.base = rows_used;
    rows_used += int64_t(g.nsplit) * g.ntok * Hq;
    if (rows_used > INT32_MAX) return NA_E_TOO_LARGE;
    const int span = g.pages * c.page_size;
    const int hpt = heads_per_rows(std::min(g.ntok, cqb) * hb);
    for (int kh = 0; kh < c.num_kv_heads; kh += hpt) {
      const int kh1 = std::min(c.num_kv_heads, kh + hpt);
      for (int h0 = 0; h0 < group; h0 += hb) {
        const int h1 = std::min(group, h0 + hb);
        for (int t0 = 0; t0 < g.ntok; t0 += cqb) {
          const int t1 = std::min(g.ntok, t0 + cqb);
          for (int s = 0; s < g.nsplit; ++s) {
            const int k0 = s * g.chunk, k1 = std::min(span, k0 + g.chunk);
            const int64_t slot = g.base + int64_t(s) * g.ntok * Hq;
            P.items.push_back(NaItem{g.members[0], kh, t0, t1, h0, h1, k0, k1, int32_t(slot),
                                     kh1, 1, g.ctok0});
          }
        }
      }
    }
  }
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    const int kv_len = P.lens[i];
    const int hpt = heads_per_tile(q_len);
    const int mg = member_group[size_t(i)];
    for (int g = 0; g < c.num_kv_heads; g += hpt) {
      const int g1 = std::min(c.num_kv_heads, g + hpt);
      for (int h0 = 0; h0 < group; h0 += hb) {
        const int h1 = std::min(group, h0 + hb);
        for (int q0 = 0; q0 < q_len; q0 += qb) {
          const int q1 = std::min(q_len, q0 + qb);
          const int rows = (g1 - g) * (h1 - h0) * (q1 - q0);
          // Causal: the tile's last query sees keys [0, kv_len - q_len + q1).
          const int kend = P.causal && P.cfg.causal
                               ? std::max(0, std::min(kv_len, kv_len - q_len + q1))
                               : kv_len;
          // Sliding window: keys before the first one any row of the tile may see are never
          // read (whole pages outside the window are skipped; decode reads window_left + 1).
          // A cascade member's shared keys were read by its group's tiles.
          const int kstart =
              std::min(kend, std::max(shared_keys[size_t(i)], first_key(P, i, q0, q1)));
          const int span = kend - kstart;
          int nsplit, chunk;
          std::tie(nsplit, chunk) = cut(span, want);
          if (mg < 0 && nsplit <= 1) {
            P.items.push_back(NaItem{i, g, q0, q1, h0, h1, kstart, kend, -1, g1, 0, 0});
            continue;
          }
          if (span == 0) nsplit = 0;  // a member whose every key is shared
          for (int s = 0; s < nsplit; ++s) {
            const int k0 = kstart + s * chunk, k1 = std::min(kend, k0 + chunk);
            P.items.push_back(NaItem{i, g, q0, q1, h0, h1, k0, k1,
                                     int32_t(rows_used + int64_t(s) * rows), g1, 0, 0});
          }
          NaMerge m{i, g, q0, q1, h0, h1, nsplit, int32_t(rows_used), g1, 0, 0, 0};
          if (mg >= 0) {
            const Group& gr = groups[size_t(mg)];
            m.nshared = gr.nsplit;
            m.shared0 = int32_t(gr.base + (int64_t(member_tok[size_t(i)]) + q0) * Hq);
            m.shared_stride = gr.ntok * Hq;
          }
          P.merges.push_back(m);
          rows_used += int64_t(nsplit) * rows;
          if (rows_used > INT32_MAX) return NA_E_TOO_LARGE;
        }
      }
    }
  }
  P.scratch_rows = rows_used;
  // Every output row is written by exactly one direct tile or merge: the handler hands back
  // an output it never filled otherwise. Checked once per plan (a planner bug, never input).
  int64_t covered = 0;
  for (const NaItem& it : P.items) {
    if (it.slot < 0) covered += int64_t(it.kv_head_end - it.kv_head) * (it.h1 - it.h0) * (it.q1 - it.q0);
  }
  for (const NaMerge& mg : P.merges) {
    covered += int64_t(mg.kv_head_end - mg.kv_head) * (mg.h1 - mg.h0) * (mg.q1 - mg.q0);
  }
  if (covered != P.num_tokens * Hq) return NA_E_INTERNAL;
  return 0;
}

}  // namespace

namespace na {

bool config_ok(const NaConfig& c) {
  auto dtype_ok = [](int d) { return d == NA_F32 || d == NA_BF16 || d == NA_F16; };
  if (c.kind != NA_MHA && c.kind != NA_MLA) return false;
  if (!dtype_ok(c.q_dtype)) return false;
  if (!dtype_ok(c.kv_dtype) && c.kv_dtype != NA_E4M3 && c.kv_dtype != NA_E5M2) return false;
  if (c.window_left < -1 || c.chunk_size < 0 || (c.causal != 0 && c.causal != 1)) return false;
  // A non-causal layer sees every key: no window or chunk (AttnConfig refuses them too).
  if (!c.causal && (c.window_left >= 0 || c.chunk_size > 0)) return false;
  if (!(c.logit_cap >= 0.0f && c.logit_cap <= 3.0e38f)) return false;  // also refuses NaN
  if (c.num_q_heads <= 0 || c.num_kv_heads <= 0 || c.num_q_heads % c.num_kv_heads) return false;
  if (c.head_dim <= 0 || c.head_dim > na::kMaxHeadDim || c.v_head_dim <= 0 ||
      c.v_head_dim > na::kMaxHeadDim || c.page_size <= 0) {
    return false;
  }
  return c.kind != NA_MLA || (c.num_kv_heads == 1 && c.v_head_dim <= c.head_dim);
}

int build_plan(NaPlan& P, const NaPlanArgs& a, NaError* err) {
  P.split_target = std::max(1, a.split_target);
  P.num_requests = a.num_requests;
  int rc = validate(P, a.qo_indptr, a.kv_indptr, a.kv_indices, a.num_indices, a.kv_lens, a.mask,
                    a.mask_len, a.decode, err);
  if (rc == 0) {
    rc = make_items(P);
    if (rc != 0) fail(err, rc, -1);
  }
  return rc;
}

}  // namespace na
