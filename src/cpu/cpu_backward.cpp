// Backward pass, deterministic and without atomics, in three parallel passes:
//   0. One task per (batch, head, query block): recomputes the row statistics of the softmax
//      (max m_i and sum l_i, online, exactly like the forward) and
//      Delta_i = sum_j P_ij dP_ij with dP = dO V^T, all in accumulator precision.
//   1. One task per (batch, kv head, key block): recomputes P = exp(S - m) / l and
//      dS = P * (dP - Delta) over every query head of the GQA group and every query block
//      that the window lets reach the key block, accumulating dV = P^T dO, dK = scale *
//      (dS * softcap')^T Q, and dbias. Dimensions along which the bias is broadcast would
//      make tasks write the same dbias element, so they are folded into one task (see
//      KeyTaskGrid). Each task sums dbias in the accumulator type and casts once.
//   2. One task per (batch, head, query block): recomputes dS and accumulates
//      dQ = scale * (dS * softcap') K.
// That is the bounded-memory form. Where the tiles fit in memory (score_cache.h), passes 0 and
// 2 run as one task that keeps its query block's S and dP (query_row_task), and with the tile
// store pass 1 reads P and dS instead of recomputing them.
// Every output element is owned by one task with a fixed summation order, so the result is
// bitwise identical for any number of threads.
//
// Why pass 0 instead of FlashAttention's P = exp(S - lse) and Delta = rowsum(dO * out):
//  - lse = m + log(l) loses log(l) when |m| is huge: a row whose allowed keys all carry a bias
//    of finfo.min has every score round to the same s, lse rounds to s, and exp(S - lse)
//    gives P = 1 instead of 1/n (n times too large gradients). Keeping m and l separate
//    reproduces the forward's P = 1/n; it is also more accurate whenever |lse| is large.
//  - the stored fp16/bf16 `out` carries a rounding error (~2^-9 |dO||O| sqrt(D)) that does
//    not cancel in dS: a bias broadcast over keys has dbias = sum_j dS_ij =
//    Delta_exact - Delta_used, i.e. pure rounding noise, far above PyTorch's own error.
// lse and out of the forward are therefore not read here, unless the caller asks for exactly
// that (BackwardParams::forward_stats: a call over a part of the keys of a softmax normalized
// over more keys, as in context parallelism): then pass 0 is replaced by m = lse, 1 / l = 1
// and Delta = rowsum(dO * out) (given_row_stats_task), and passes 1 and 2 run as above.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/element_types.h"
#include "cpu/gate.h"
#include "cpu/online_softmax.h"
#include "cpu/score_cache.h"
#include "cpu/score_mod.h"
#include "cpu/tile_math.h"
#include "cpu/vector_math.h"

namespace dmattn::cpu {
namespace {

// Per query row, from pass 0: softmax max m, 1 / sum l (0 for an empty row) and Delta.
// Each is a (B, H, Sq) array.
template <typename Acc>
struct RowStats {
  std::vector<Acc> max, inv_sum, delta;
  explicit RowStats(size_t rows) : max(rows), inv_sum(rows), delta(rows) {}
};

// Per-thread tile buffers, reused by all three passes.
template <typename Acc>
struct BackwardTiles {
  std::vector<Acc> q, dout, k, v;             // operand tiles
  std::vector<Acc> probs, dprobs, cap_grad;   // scores then P, dP then dS, softcap derivative
  std::vector<Acc> row_max, inv_sum, delta;   // RowStats of the current query block
  std::vector<OnlineSoftmaxRow<Acc>> online;  // pass 0's running statistics
  std::vector<Acc> grad_a, grad_b;            // dK and dV (pass 1) or dQ (pass 2)
  std::vector<Acc> dbias;                     // the dbias slab a pass-1 task owns
  std::vector<Acc> dalpha, ddelta;            // the gate's gradients of a query / key block
  explicit BackwardTiles(int64_t dim)
      : q(kBlockQ * dim), dout(kBlockQ * dim), k(kBlockK * dim), v(kBlockK * dim),
        probs(kBlockQ * kBlockK), dprobs(kBlockQ * kBlockK), cap_grad(kBlockQ * kBlockK),
        row_max(kBlockQ), inv_sum(kBlockQ), delta(kBlockQ), online(kBlockQ),
        grad_a(std::max(kBlockQ, kBlockK) * dim), grad_b(kBlockK * dim), dalpha(kBlockQ),
        ddelta(kBlockK) {}
};

// Everything a task needs besides its indices.
template <typename T, typename Acc, typename BiasT>
struct BackwardContext {
  const BackwardParams& p;
  const ForwardParams& f;
  ScoreMod<Acc, BiasT> mod;
  RowStats<Acc>& stats;  // written by pass 0 (disjoint rows per task), read by passes 1, 2
  bool softcap_on;

  BackwardContext(const BackwardParams& params, RowStats<Acc>& row_stats)
      : p(params), f(params.fwd), mod(params.fwd), stats(row_stats),
        softcap_on(params.fwd.softcap > 0) {}

  int64_t stat_index(int64_t b, int64_t h, int64_t i) const {
    return (b * f.num_heads + h) * f.seqlen_q + i;
  }

  // Of query head h's block `query_block`: its kv head, first row i0 and number of rows.
  struct QueryRows {
    int64_t kv_head, i0, rows;
  };
  QueryRows query_rows(int64_t h, int64_t query_block) const {
    const int64_t i0 = query_block * kBlockQ;
    return {h / f.group_size(), i0, std::min(kBlockQ, f.seqlen_q - i0)};
  }

  // dQ = scale * dq (the accumulated dS K) into rows [i0, i0 + rows) of head h.
  void store_dq(int64_t b, int64_t h, int64_t i0, int64_t rows, const Acc* dq) const {
    T* dq_out = static_cast<T*>(p.dq) + p.dq_strides.offset(b, i0, h);
    store_rows(dq, rows, f.head_dim, mod.scale, dq_out, p.dq_strides.row_stride);
  }

  // Loads Q and dO of query rows [i0, i0 + rows) of head h.
  void load_query_side(int64_t b, int64_t h, int64_t i0, int64_t rows,
                       BackwardTiles<Acc>& t) const {
    const T* q = static_cast<const T*>(f.q) + f.q_strides.offset(b, i0, h);
    const T* dout = static_cast<const T*>(p.dout) + p.dout_strides.offset(b, i0, h);
    load_rows(q, f.q_strides.row_stride, rows, f.head_dim, t.q.data(), kBlockQ);
    load_rows(dout, p.dout_strides.row_stride, rows, f.head_dim, t.dout.data(), kBlockQ);
  }

  void load_row_stats(int64_t b, int64_t h, int64_t i0, int64_t rows,
                      BackwardTiles<Acc>& t) const {
    const int64_t first = stat_index(b, h, i0);
    std::copy_n(stats.max.begin() + first, rows, t.row_max.begin());
    std::copy_n(stats.inv_sum.begin() + first, rows, t.inv_sum.begin());
    std::copy_n(stats.delta.begin() + first, rows, t.delta.begin());
  }

  void store_row_stats(int64_t b, int64_t h, int64_t i0, int64_t rows,
                       const BackwardTiles<Acc>& t) const {
    const int64_t first = stat_index(b, h, i0);
    std::copy_n(t.row_max.begin(), rows, stats.max.begin() + first);
    std::copy_n(t.inv_sum.begin(), rows, stats.inv_sum.begin() + first);
    std::copy_n(t.delta.begin(), rows, stats.delta.begin() + first);
  }

  // Loads K and V of keys [j0, j0 + cols).
  void load_key_side(int64_t b, int64_t kv_head, int64_t j0, int64_t cols,
                     BackwardTiles<Acc>& t) const {
    const T* k = static_cast<const T*>(f.k) + f.k_strides.offset(b, j0, kv_head);
    const T* v = static_cast<const T*>(f.v) + f.v_strides.offset(b, j0, kv_head);
    load_rows(k, f.k_strides.row_stride, cols, f.head_dim, t.k.data(), kBlockK);
    load_rows(v, f.v_strides.row_stride, cols, f.head_dim, t.v.data(), kBlockK);
  }

  // From the loaded tiles: probs = final scores (-inf where disallowed), dprobs = dP = dO V^T,
  // cap_grad = softcap'.
  void compute_scores_and_dp(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                             int64_t cols, BackwardTiles<Acc>& t) const {
    const int64_t dim = f.head_dim;
    matmul_into_scores(t.q.data(), t.k.data(), dim, t.probs.data());
    mod.apply(b, h, i0, rows, j0, cols, t.probs.data(),
              softcap_on ? t.cap_grad.data() : nullptr);
    matmul_into_scores(t.dout.data(), t.v.data(), dim, t.dprobs.data());
  }

  // probs: scores -> P = exp(s - m) / l (tile of `rows` rows, leading dim kBlockK). Exactly 0
  // at disallowed positions and on empty rows (m = -inf); exp never sees -inf - (-inf).
  static void scores_to_probs(int64_t rows, int64_t cols, const Acc* row_max,
                              const Acc* inv_sum, Acc* probs) {
    constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      Acc* prob = probs + r * kBlockK;
      if (row_max[r] == kNegInf) {
        std::fill(prob, prob + cols, Acc(0));
        continue;
      }
      exp_shifted(prob, cols, row_max[r]);  // -inf -> exactly 0
      const Acc factor = inv_sum[r];
      for (int64_t c = 0; c < cols; ++c) prob[c] *= factor;
    }
  }

  // Recomputes P and dP of one (query block, key block) tile from the loaded tiles and stats.
  void compute_p_and_dp(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                        int64_t cols, BackwardTiles<Acc>& t) const {
    compute_scores_and_dp(b, h, i0, rows, j0, cols, t);
    scores_to_probs(rows, cols, t.row_max.data(), t.inv_sum.data(), t.probs.data());
  }

  // dprobs: dP -> dS = P * (dP - Delta), exactly 0 where P is 0.
  static void compute_ds(int64_t rows, int64_t cols, const Acc* probs, const Acc* delta,
                         Acc* dprobs) {
    for (int64_t r = 0; r < rows; ++r) {
      const Acc* prob = probs + r * kBlockK;
      Acc* ds = dprobs + r * kBlockK;
      const Acc delta_r = delta[r];
      for (int64_t c = 0; c < cols; ++c) {
        ds[c] = prob[c] == Acc(0) ? Acc(0) : prob[c] * (ds[c] - delta_r);
      }
    }
  }
  void compute_ds(int64_t rows, int64_t cols, BackwardTiles<Acc>& t) const {
    compute_ds(rows, cols, t.probs.data(), t.delta.data(), t.dprobs.data());
  }

  // dS * softcap' in place (the chain rule through s = softcap * tanh(x / softcap)).
  void apply_softcap_grad(int64_t rows, int64_t cols, const Acc* cap_grad, Acc* dprobs) const {
    if (!softcap_on) return;
    for (int64_t r = 0; r < rows; ++r) {
      Acc* ds = dprobs + r * kBlockK;
      const Acc* g = cap_grad + r * kBlockK;
      for (int64_t c = 0; c < cols; ++c) ds[c] *= g[c];
    }
  }
  void apply_softcap_grad(int64_t rows, int64_t cols, BackwardTiles<Acc>& t) const {
    apply_softcap_grad(rows, cols, t.cap_grad.data(), t.dprobs.data());
  }

  // The gate's share of one tile's gradient, from dS before softcap' (the gate is added after
  // the cap, like the bias): with G_ij = scale * g'(alpha_i delta_j) * dS_ij,
  // dalpha_i += G_ij delta_j (into dalpha[r], when given) and ddelta_j += G_ij alpha_i (into
  // ddelta[c], when given). Positions with dS = 0 (disallowed ones among them) add nothing.
  void accumulate_gate_grads(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                             const Acc* ds_tile, Acc* dalpha, Acc* ddelta) const {
    const GateTerm<Acc>& gate = mod.gate;
    Acc delta[kBlockK];
    for (int64_t c = 0; c < cols; ++c) delta[c] = gate.delta(b, j0 + c, h);
    for (int64_t r = 0; r < rows; ++r) {
      const Acc alpha = gate.alpha(b, i0 + r, h);
      const Acc* ds = ds_tile + r * kBlockK;
      Acc row_sum = 0;
      for (int64_t c = 0; c < cols; ++c) {
        if (ds[c] == Acc(0)) continue;
        const Acc g = mod.scale * gate.derivative(alpha * delta[c]) * ds[c];
        row_sum += g * delta[c];
        if (ddelta) ddelta[c] += g * alpha;
      }
      if (dalpha) dalpha[r] += row_sum;
    }
  }

  // dalpha of rows [i0, i0 + rows) of head h, from the accumulator (when wanted).
  void store_dalpha(int64_t b, int64_t h, int64_t i0, int64_t rows, const Acc* dalpha) const {
    if (p.dalpha == nullptr) return;
    for (int64_t r = 0; r < rows; ++r) {
      store_scalar(p.dalpha, f.gate.alpha_dtype, p.dalpha_strides.offset(b, i0 + r, h), dalpha[r]);
    }
  }
};

// Pass 0: softmax statistics and Delta_i = sum_j P_ij dP_ij for the rows of one query block,
// accumulated online: Delta is summed with the running max and rescaled like the row sum.
template <typename T, typename Acc, typename BiasT>
void row_stats_task(const BackwardContext<T, Acc, BiasT>& ctx, int64_t b, int64_t h,
                    int64_t query_block, BackwardTiles<Acc>& t) {
  const ForwardParams& f = ctx.f;
  const auto [kv_head, i0, rows] = ctx.query_rows(h, query_block);
  ctx.load_query_side(b, h, i0, rows, t);
  std::fill_n(t.online.begin(), rows, OnlineSoftmaxRow<Acc>{});
  std::fill_n(t.delta.begin(), rows, Acc(0));  // unnormalized until the end
  const IndexRange keys = ctx.mod.keys.for_queries(b, h, {i0, i0 + rows});
  for (int64_t j0 = aligned_block_start(keys.begin, kBlockK); j0 < keys.end; j0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, f.seqlen_k - j0);
    ctx.load_key_side(b, kv_head, j0, cols, t);
    ctx.compute_scores_and_dp(b, h, i0, rows, j0, cols, t);
    for (int64_t r = 0; r < rows; ++r) {
      Acc* weight = t.probs.data() + r * kBlockK;  // becomes exp(s - running max)
      const Acc rescale = t.online[r].update(weight, cols);
      const Acc* dprob = t.dprobs.data() + r * kBlockK;
      t.delta[r] = t.delta[r] * rescale + row_dot(weight, dprob, cols);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const OnlineSoftmaxRow<Acc>& row = t.online[r];
    t.row_max[r] = row.max;  // -inf marks an empty row
    t.inv_sum[r] = row.empty() ? Acc(0) : Acc(1) / row.sum;
    t.delta[r] *= t.inv_sum[r];
  }
  ctx.store_row_stats(b, h, i0, rows, t);
}

// Pass 0 with BackwardParams::forward_stats: the statistics of the rows of one query block from
// the given lse and out (FlashAttention's P = exp(S - lse), Delta = rowsum(dO * out)): m = lse,
// 1 / l = 1, or 0 on an empty row (lse = -inf, which scores_to_probs turns into P = 0).
template <typename T, typename Acc, typename BiasT>
void given_row_stats_task(const BackwardContext<T, Acc, BiasT>& ctx, int64_t b, int64_t h,
                          int64_t query_block, BackwardTiles<Acc>& t) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const ForwardParams& f = ctx.f;
  const int64_t dim = f.head_dim;
  const auto [kv_head, i0, rows] = ctx.query_rows(h, query_block);
  const T* out = static_cast<const T*>(f.out) + f.out_strides.offset(b, i0, h);
  const T* dout = static_cast<const T*>(ctx.p.dout) + ctx.p.dout_strides.offset(b, i0, h);
  load_rows(out, f.out_strides.row_stride, rows, dim, t.q.data(), kBlockQ);  // (the q tile as scratch)
  load_rows(dout, ctx.p.dout_strides.row_stride, rows, dim, t.dout.data(), kBlockQ);
  const Acc* lse = static_cast<const Acc*>(f.lse) + b * f.lse_batch_stride + h * f.lse_head_stride + i0;
  for (int64_t r = 0; r < rows; ++r) {
    t.row_max[r] = lse[r];
    t.inv_sum[r] = lse[r] == kNegInf ? Acc(0) : Acc(1);
    t.delta[r] = row_dot(t.q.data() + r * dim, t.dout.data() + r * dim, dim);
  }
  ctx.store_row_stats(b, h, i0, rows, t);
}

// Passes 0 and 2 of one query block as one task, with the block's tiles of every key block
// it reaches kept in `tiles_of` (RowTiles, or the TileStore's tiles for pass 1 to reuse): S and
// dP are multiplied out once for both the statistics and dQ, and the row max is known before
// any exp, so no online rescaling is needed.
template <typename T, typename Acc, typename BiasT, typename TileOf>
void query_row_task(const BackwardContext<T, Acc, BiasT>& ctx, int64_t b, int64_t h,
                    int64_t query_block, TileOf&& tiles_of, BackwardTiles<Acc>& t) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const ForwardParams& f = ctx.f;
  const int64_t dim = f.head_dim;
  const auto [kv_head, i0, rows] = ctx.query_rows(h, query_block);
  ctx.load_query_side(b, h, i0, rows, t);
  const IndexRange keys = ctx.mod.keys.for_queries(b, h, {i0, i0 + rows});
  const int64_t first_block = keys.begin / kBlockK;
  const int64_t end_block = keys.empty() ? first_block : ceil_div(keys.end, kBlockK);
  auto key_cols = [&](int64_t kb) { return std::min(kBlockK, f.seqlen_k - kb * kBlockK); };

  // Final scores (P's tile) and dP of every reachable key block; the row max.
  std::fill_n(t.row_max.begin(), rows, kNegInf);
  for (int64_t kb = first_block; kb < end_block; ++kb) {
    const int64_t j0 = kb * kBlockK, cols = key_cols(kb);
    const TilePointers<Acc> tile = tiles_of(kb);
    ctx.load_key_side(b, kv_head, j0, cols, t);
    matmul_into_scores(t.q.data(), t.k.data(), dim, tile.probs);
    ctx.mod.apply(b, h, i0, rows, j0, cols, tile.probs,
                  ctx.softcap_on ? tile.cap_grad : nullptr);
    matmul_into_scores(t.dout.data(), t.v.data(), dim, tile.dprobs);
    for (int64_t r = 0; r < rows; ++r) {
      t.row_max[r] = max_keep_nan(t.row_max[r], row_max(tile.probs + r * kBlockK, cols));
    }
  }
  // exp(s - m) in place; the row sums l and Delta = sum_j P_ij dP_ij.
  std::fill_n(t.inv_sum.begin(), rows, Acc(0));  // the sum l until the end of this loop
  std::fill_n(t.delta.begin(), rows, Acc(0));
  for (int64_t kb = first_block; kb < end_block; ++kb) {
    const int64_t cols = key_cols(kb);
    const TilePointers<Acc> tile = tiles_of(kb);
    for (int64_t r = 0; r < rows; ++r) {
      Acc* weight = tile.probs + r * kBlockK;
      if (t.row_max[r] == kNegInf) {  // empty row: P = 0, exp never sees -inf - (-inf)
        std::fill(weight, weight + cols, Acc(0));
        continue;
      }
      exp_shifted(weight, cols, t.row_max[r]);
      t.inv_sum[r] += row_dot(weight, static_cast<const Acc*>(nullptr), cols);
      t.delta[r] += row_dot(weight, tile.dprobs + r * kBlockK, cols);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    t.inv_sum[r] = t.row_max[r] == kNegInf ? Acc(0) : Acc(1) / t.inv_sum[r];
    t.delta[r] *= t.inv_sum[r];
  }
  ctx.store_row_stats(b, h, i0, rows, t);

  // P, dS, dQ = scale * (dS * softcap') K and the gate's dalpha.
  Acc* dq = t.grad_a.data();
  std::fill(dq, dq + kBlockQ * dim, Acc(0));
  const bool want_dalpha = ctx.p.dalpha != nullptr;
  std::fill(t.dalpha.begin(), t.dalpha.end(), Acc(0));
  for (int64_t kb = first_block; kb < end_block; ++kb) {
    const int64_t j0 = kb * kBlockK, cols = key_cols(kb);
    const TilePointers<Acc> tile = tiles_of(kb);
    for (int64_t r = 0; r < rows; ++r) {
      Acc* prob = tile.probs + r * kBlockK;
      const Acc factor = t.inv_sum[r];
      for (int64_t c = 0; c < cols; ++c) prob[c] *= factor;
    }
    ctx.compute_ds(rows, cols, tile.probs, t.delta.data(), tile.dprobs);
    if (want_dalpha) ctx.accumulate_gate_grads(b, h, i0, rows, j0, cols, tile.dprobs, t.dalpha.data(), nullptr);
    ctx.apply_softcap_grad(rows, cols, tile.cap_grad, tile.dprobs);
    const T* k = static_cast<const T*>(f.k) + f.k_strides.offset(b, j0, kv_head);
    load_rows(k, f.k_strides.row_stride, cols, dim, t.k.data(), kBlockK);
    accumulate_product(tile.dprobs, t.k.data(), dim, dq);
  }
  ctx.store_dq(b, h, i0, rows, dq);
  ctx.store_dalpha(b, h, i0, rows, t.dalpha.data());
}

// How pass-1 tasks are laid out. A task covers a range of batches, kv heads and key blocks:
// a single one normally, all of them along a dimension over which dbias is broadcast (bias
// batch size 1, bias head size 1, bias key size 1), so no two tasks write the same element.
// Each task then owns exactly one dbias "slab": a fixed bias batch index, the bias heads of
// its kv head(s), every bias query index, and the bias keys of its key block(s).
struct KeyTaskGrid {
  int64_t batch_tasks, head_tasks, key_tasks, key_blocks;
  bool fold_batch, fold_heads, fold_keys;

  explicit KeyTaskGrid(const BackwardParams& p) {
    const ForwardParams& f = p.fwd;
    const bool has_dbias = p.dbias != nullptr;
    key_blocks = ceil_div(f.seqlen_k, kBlockK);
    fold_batch = has_dbias && f.bias.size_b == 1;
    fold_heads = has_dbias && f.bias.size_h == 1;
    fold_keys = has_dbias && f.bias.size_k == 1;
    // A folded dimension is one task even if it is empty, so a size-1 dbias is still zeroed.
    batch_tasks = fold_batch ? 1 : f.batch;
    head_tasks = fold_heads ? 1 : f.num_heads_kv;
    key_tasks = fold_keys ? 1 : key_blocks;
  }
  int64_t tasks() const { return batch_tasks * head_tasks * key_tasks; }
};

// The dbias elements owned by one pass-1 task, in a contiguous (heads, size_q, keys) buffer.
struct DbiasSlab {
  int64_t bias_batch = 0;               // bias batch index (0 when broadcast)
  int64_t first_head = 0, heads = 1;    // bias head indices first_head .. + heads
  int64_t first_key = 0, keys = 1;      // bias key indices first_key .. + keys
  int64_t queries = 1;                  // bias query size (1 or Sq)

  int64_t size() const { return heads * queries * keys; }
  int64_t index(int64_t bias_head, int64_t bias_query, int64_t bias_key) const {
    return ((bias_head - first_head) * queries + bias_query) * keys + (bias_key - first_key);
  }
};

template <typename T, typename Acc, typename BiasT>
void key_block_task(const BackwardContext<T, Acc, BiasT>& ctx, const KeyTaskGrid& grid,
                    const TileStore<Acc>& store, int64_t task, BackwardTiles<Acc>& t) {
  const ForwardParams& f = ctx.f;
  const BackwardParams& p = ctx.p;
  const BroadcastOperand& bias = f.bias;
  const int64_t dim = f.head_dim, group = f.group_size();

  const int64_t key_task = task % grid.key_tasks;
  const int64_t head_task = (task / grid.key_tasks) % grid.head_tasks;
  const int64_t batch_task = task / (grid.key_tasks * grid.head_tasks);
  auto one_or_all = [](bool fold, int64_t index, int64_t count) {
    return fold ? IndexRange{0, count} : IndexRange{index, index + 1};
  };
  const IndexRange batches = one_or_all(grid.fold_batch, batch_task, f.batch);
  const IndexRange kv_heads = one_or_all(grid.fold_heads, head_task, f.num_heads_kv);
  const IndexRange key_blocks = one_or_all(grid.fold_keys, key_task, grid.key_blocks);

  const bool want_dbias = p.dbias != nullptr;
  DbiasSlab slab;
  if (want_dbias) {
    slab.bias_batch = bias.size_b == 1 ? 0 : batch_task;
    if (bias.size_h == 1) {
      slab.first_head = 0, slab.heads = 1;
    } else if (bias.head_div > 1) {  // one bias head per GQA group
      slab.first_head = head_task, slab.heads = 1;
    } else {  // one bias head per query head
      slab.first_head = head_task * group, slab.heads = group;
    }
    slab.queries = bias.size_q;
    if (bias.size_k != 1) {
      slab.first_key = key_task * kBlockK;
      slab.keys = std::min(kBlockK, f.seqlen_k - slab.first_key);
    }
    t.dbias.assign(static_cast<size_t>(slab.size()), Acc(0));
  }

  for (int64_t b = batches.begin; b < batches.end; ++b) {
    for (int64_t kv_head = kv_heads.begin; kv_head < kv_heads.end; ++kv_head) {
      for (int64_t kb = key_blocks.begin; kb < key_blocks.end; ++kb) {
        const int64_t j0 = kb * kBlockK;
        const int64_t cols = std::min(kBlockK, f.seqlen_k - j0);
        if (!store.enabled()) ctx.load_key_side(b, kv_head, j0, cols, t);
        Acc* dk = t.grad_a.data();
        Acc* dv = t.grad_b.data();
        std::fill(dk, dk + kBlockK * dim, Acc(0));
        std::fill(dv, dv + kBlockK * dim, Acc(0));
        const bool want_ddelta = p.ddelta != nullptr;
        std::fill(t.ddelta.begin(), t.ddelta.end(), Acc(0));

        for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
          // Per query head: with gathered keys each head may read the rows as other positions.
          const IndexRange queries = ctx.mod.keys.queries_for(b, h, {j0, j0 + cols});
          for (int64_t i0 = aligned_block_start(queries.begin, kBlockQ); i0 < queries.end;
               i0 += kBlockQ) {
            const int64_t rows = std::min(kBlockQ, f.seqlen_q - i0);
            const Acc* probs = t.probs.data();
            Acc* ds_tile = t.dprobs.data();
            if (store.enabled()) {  // P and dS from the query pass (no softcap: dS is final)
              if (!store.computed(b, h, i0 / kBlockQ, kb)) continue;  // P = 0 throughout
              const TilePointers<Acc> tile = store.tile(b, h, i0 / kBlockQ, kb);
              probs = tile.probs, ds_tile = tile.dprobs;
            }
            ctx.load_query_side(b, h, i0, rows, t);
            if (!store.enabled()) {
              ctx.load_row_stats(b, h, i0, rows, t);
              ctx.compute_p_and_dp(b, h, i0, rows, j0, cols, t);
              ctx.compute_ds(rows, cols, t);
            }
            accumulate_transposed_product(probs, t.dout.data(), dim, dv);
            if (want_dbias) {
              // dbias takes dS itself: the bias is added after scale and softcap.
              const int64_t bias_head = bias.size_h == 1 ? 0 : h / bias.head_div;
              for (int64_t r = 0; r < rows; ++r) {
                const int64_t bias_query = bias.size_q == 1 ? 0 : i0 + r;
                const Acc* ds = ds_tile + r * kBlockK;
                Acc* out = t.dbias.data() + slab.index(bias_head, bias_query, slab.first_key);
                if (bias.size_k == 1) {
                  Acc row_sum = 0;
                  for (int64_t c = 0; c < cols; ++c) row_sum += ds[c];
                  out[0] += row_sum;
                } else {
                  for (int64_t c = 0; c < cols; ++c) out[c] += ds[c];
                }
              }
            }
            if (want_ddelta) ctx.accumulate_gate_grads(b, h, i0, rows, j0, cols, ds_tile, nullptr, t.ddelta.data());
            if (!store.enabled()) ctx.apply_softcap_grad(rows, cols, t);
            accumulate_transposed_product(ds_tile, t.q.data(), dim, dk);
          }
        }
        T* dk_out = static_cast<T*>(p.dk) + p.dk_strides.offset(b, j0, kv_head);
        T* dv_out = static_cast<T*>(p.dv) + p.dv_strides.offset(b, j0, kv_head);
        store_rows(dk, cols, dim, ctx.mod.scale, dk_out, p.dk_strides.row_stride);
        store_rows(dv, cols, dim, Acc(1), dv_out, p.dv_strides.row_stride);
        if (want_ddelta) {  // every key of the block, 0 where nothing reached it
          for (int64_t c = 0; c < cols; ++c) {
            store_scalar(p.ddelta, f.gate.delta_dtype, p.ddelta_strides.offset(b, j0 + c, kv_head), t.ddelta[c]);
          }
        }
      }
    }
  }

  if (want_dbias) {  // cast once; elements nothing reached (disallowed) are written as 0
    auto* dbias = static_cast<BiasT*>(p.dbias);
    for (int64_t hb = slab.first_head; hb < slab.first_head + slab.heads; ++hb) {
      for (int64_t iq = 0; iq < slab.queries; ++iq) {
        for (int64_t jk = slab.first_key; jk < slab.first_key + slab.keys; ++jk) {
          store_saturating(dbias + p.dbias_offset(slab.bias_batch, hb, iq, jk),
                           t.dbias[slab.index(hb, iq, jk)]);
        }
      }
    }
  }
}

template <typename T, typename Acc, typename BiasT>
void query_block_task(const BackwardContext<T, Acc, BiasT>& ctx, int64_t b, int64_t h,
                      int64_t query_block, BackwardTiles<Acc>& t) {
  const ForwardParams& f = ctx.f;
  const int64_t dim = f.head_dim;
  const auto [kv_head, i0, rows] = ctx.query_rows(h, query_block);
  ctx.load_query_side(b, h, i0, rows, t);
  ctx.load_row_stats(b, h, i0, rows, t);
  Acc* dq = t.grad_a.data();
  std::fill(dq, dq + kBlockQ * dim, Acc(0));

  const bool want_dalpha = ctx.p.dalpha != nullptr;
  std::fill(t.dalpha.begin(), t.dalpha.end(), Acc(0));
  const IndexRange keys = ctx.mod.keys.for_queries(b, h, {i0, i0 + rows});
  for (int64_t j0 = aligned_block_start(keys.begin, kBlockK); j0 < keys.end; j0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, f.seqlen_k - j0);
    ctx.load_key_side(b, kv_head, j0, cols, t);
    ctx.compute_p_and_dp(b, h, i0, rows, j0, cols, t);
    ctx.compute_ds(rows, cols, t);
    if (want_dalpha) ctx.accumulate_gate_grads(b, h, i0, rows, j0, cols, t.dprobs.data(), t.dalpha.data(), nullptr);
    ctx.apply_softcap_grad(rows, cols, t);
    accumulate_product(t.dprobs.data(), t.k.data(), dim, dq);
  }
  ctx.store_dq(b, h, i0, rows, dq);
  ctx.store_dalpha(b, h, i0, rows, t.dalpha.data());
}

template <typename T, typename BiasT>
void backward_typed(const BackwardParams& p) {
  using Acc = AccumulatorOf<T>;
  const ForwardParams& f = p.fwd;
  RowStats<Acc> stats(static_cast<size_t>(f.batch * f.num_heads * f.seqlen_q));
  const BackwardContext<T, Acc, BiasT> ctx(p, stats);

  const KeyTaskGrid grid(p);
  const int64_t key_tasks = grid.tasks();
  const int64_t query_blocks = ceil_div(f.seqlen_q, kBlockQ);
  const int64_t query_tasks = f.batch * f.num_heads * query_blocks;

  // The cache levels of score_cache.h that fit. The store holds dS without softcap', which the
  // key pass would need separately, so softcap uses the row tiles only.
  // With the given statistics (forward_stats) the bounded form runs: pass 0 reads lse and out.
  const BackwardCacheLimits limits = backward_cache_limits();
  const bool given_stats = p.forward_stats;
  TileStore<Acc> store(f.batch, f.num_heads, query_blocks, ctx.softcap_on ? 0 : grid.key_blocks,
                       given_stats ? 0 : limits.store_bytes);
  const bool rows_fit = !given_stats && (store.enabled() ||
      RowTiles<Acc>::bytes(grid.key_blocks, ctx.softcap_on) <= limits.row_bytes);

  auto query_task = [&](int64_t task, auto&& run) {
    const int64_t query_block = task % query_blocks;
    const int64_t h = (task / query_blocks) % f.num_heads;
    const int64_t b = task / (query_blocks * f.num_heads);
    run(b, h, query_block);
  };

#pragma omp parallel
  {
    BackwardTiles<Acc> tiles(f.head_dim);
    RowTiles<Acc> row(rows_fit && !store.enabled() ? grid.key_blocks : 0, ctx.softcap_on);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < query_tasks; ++task) {
      query_task(task, [&](int64_t b, int64_t h, int64_t query_block) {
        if (store.enabled()) {
          query_row_task(ctx, b, h, query_block, [&](int64_t kb) {
            store.mark_computed(b, h, query_block, kb);
            return store.tile(b, h, query_block, kb);
          }, tiles);
        } else if (rows_fit) {
          query_row_task(ctx, b, h, query_block, [&](int64_t kb) { return row.tile(kb); }, tiles);
        } else if (given_stats) {
          given_row_stats_task(ctx, b, h, query_block, tiles);
        } else {
          row_stats_task(ctx, b, h, query_block, tiles);
        }
      });
    }
    // (implicit barrier: the key pass reads the statistics, or the stored tiles, of every row)
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < key_tasks; ++task) {
      key_block_task(ctx, grid, store, task, tiles);
    }
    if (!rows_fit) {  // dQ still to do: the query pass only computed the statistics
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < query_tasks; ++task) {
        query_task(task, [&](int64_t b, int64_t h, int64_t query_block) {
          query_block_task(ctx, b, h, query_block, tiles);
        });
      }
    }
  }
}

}  // namespace

namespace {
std::atomic<int64_t> store_limit_bytes{int64_t{256} << 20};
std::atomic<int64_t> row_limit_bytes{int64_t{16} << 20};
}  // namespace

BackwardCacheLimits backward_cache_limits() { return {store_limit_bytes, row_limit_bytes}; }

void set_backward_cache_limits(int64_t store_bytes, int64_t row_bytes) {
  store_limit_bytes = store_bytes;
  row_limit_bytes = row_bytes;
}

void backward(const BackwardParams& p) {
  use_single_threaded_blas();
  const ForwardParams& f = p.fwd;
  const DType bias_dtype = f.bias.present() ? f.bias.dtype : f.dtype;
  dispatch_element_types(f.dtype, bias_dtype, [&](auto element, auto bias_element) {
    backward_typed<typename decltype(element)::type, typename decltype(bias_element)::type>(p);
  });
}

}  // namespace dmattn::cpu
