// Forward pass: FlashAttention-style online softmax over (query block x key block) tiles.
//
// One task = one (batch, head, query block). It keeps a running row max m, row sum l and an
// unnormalized output accumulator O; each key block rescales them by exp(m_old - m_new).
// Nothing of size Sq x Sk is ever allocated.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/element_types.h"
#include "cpu/score_mod.h"
#include "cpu/tile_math.h"

namespace dmattn::cpu {
namespace {

// Per-thread tile buffers.
template <typename Acc>
struct ForwardTiles {
  std::vector<Acc> q, k_t, v, scores, out_acc, row_max, row_sum;
  explicit ForwardTiles(int64_t dim)
      : q(kBlockQ * dim), k_t(dim * kBlockK), v(kBlockK * dim), scores(kBlockQ * kBlockK),
        out_acc(kBlockQ * dim), row_max(kBlockQ), row_sum(kBlockQ) {}
};

// Online-softmax update of one row with a new block of scores (turned into p in place).
// Rows that have seen no allowed key yet keep m = -inf and l = 0; exp is never evaluated on
// -inf - (-inf).
template <typename Acc>
inline void online_softmax_row(Acc* scores, int64_t cols, int64_t dim, Acc& row_max,
                               Acc& row_sum, Acc* out_row) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  Acc block_max = kNegInf;
  for (int64_t c = 0; c < cols; ++c) block_max = std::max(block_max, scores[c]);
  const Acc new_max = std::max(row_max, block_max);
  if (new_max == kNegInf) {  // nothing allowed so far: p = 0 for this block
    for (int64_t c = 0; c < cols; ++c) scores[c] = Acc(0);
    return;
  }
  Acc block_sum = 0;
  for (int64_t c = 0; c < cols; ++c) {
    // scores[c] == -inf gives exp(-inf) = 0, with new_max finite.
    scores[c] = std::exp(scores[c] - new_max);
    block_sum += scores[c];
  }
  if (row_max != new_max) {
    const Acc rescale = row_max == kNegInf ? Acc(0) : std::exp(row_max - new_max);
    row_sum *= rescale;
    for (int64_t d = 0; d < dim; ++d) out_row[d] *= rescale;
  }
  row_sum += block_sum;
  row_max = new_max;
}

template <typename T, typename Acc, typename BiasT>
void forward_query_block(const ForwardParams& p, const ScoreMod<Acc, BiasT>& mod, int64_t b,
                         int64_t h, int64_t query_block, ForwardTiles<Acc>& tiles) {
  const int64_t dim = p.head_dim;
  const int64_t kv_head = h / p.group_size();
  const int64_t i0 = query_block * kBlockQ;
  const int64_t rows = std::min(kBlockQ, p.seqlen_q - i0);

  const T* q = static_cast<const T*>(p.q) + p.q_strides.offset(b, i0, h);
  load_rows(q, p.q_strides.row_stride, rows, dim, tiles.q.data());
  std::fill(tiles.out_acc.begin(), tiles.out_acc.end(), Acc(0));
  std::fill(tiles.row_max.begin(), tiles.row_max.end(), -std::numeric_limits<Acc>::infinity());
  std::fill(tiles.row_sum.begin(), tiles.row_sum.end(), Acc(0));

  // Key blocks that causal/window exclude for every row of this query block are skipped.
  const IndexRange keys = mod.window.keys_for_queries({i0, i0 + rows});
  for (int64_t j0 = aligned_block_start(keys.begin, kBlockK); j0 < keys.end; j0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, p.seqlen_k - j0);
    const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, j0, kv_head);
    const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, j0, kv_head);
    load_rows_transposed(k, p.k_strides.row_stride, cols, dim, tiles.k_t.data());
    load_rows(v, p.v_strides.row_stride, cols, dim, tiles.v.data());

    matmul_into_scores(tiles.q.data(), tiles.k_t.data(), rows, cols, dim, tiles.scores.data());
    mod.apply(b, h, i0, rows, j0, cols, tiles.scores.data(), nullptr);
    for (int64_t r = 0; r < rows; ++r) {
      online_softmax_row(tiles.scores.data() + r * kBlockK, cols, dim, tiles.row_max[r],
                         tiles.row_sum[r], tiles.out_acc.data() + r * dim);
    }
    accumulate_product(tiles.scores.data(), tiles.v.data(), rows, cols, dim,
                       tiles.out_acc.data());
  }

  // Normalize and write. An empty row (m = -inf, l = 0) gets out = 0 and lse = -inf.
  T* out = static_cast<T*>(p.out) + p.out_strides.offset(b, i0, h);
  Acc* lse = static_cast<Acc*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q + i0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool empty = tiles.row_max[r] == -std::numeric_limits<Acc>::infinity();
    const Acc inv_sum = empty ? Acc(0) : Acc(1) / tiles.row_sum[r];
    T* out_row = out + r * p.out_strides.row_stride;
    const Acc* acc_row = tiles.out_acc.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) store_saturating(out_row + d, acc_row[d] * inv_sum);
    lse[r] = empty ? -std::numeric_limits<Acc>::infinity()
                   : tiles.row_max[r] + std::log(tiles.row_sum[r]);
  }
}

template <typename T, typename BiasT>
void forward_typed(const ForwardParams& p) {
  using Acc = AccumulatorOf<T>;  // also lse's element type (float32, or float64 for fp64)
  const ScoreMod<Acc, BiasT> mod(p);
  const int64_t query_blocks = ceil_div(p.seqlen_q, kBlockQ);
  const int64_t tasks = p.batch * p.num_heads * query_blocks;
  if (tasks == 0) return;

#pragma omp parallel
  {
    ForwardTiles<Acc> tiles(p.head_dim);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t query_block = task % query_blocks;
      const int64_t h = (task / query_blocks) % p.num_heads;
      const int64_t b = task / (query_blocks * p.num_heads);
      forward_query_block<T, Acc, BiasT>(p, mod, b, h, query_block, tiles);
    }
  }
}

}  // namespace

void forward(const ForwardParams& p) {
  const DType bias_dtype = p.bias.present() ? p.bias.dtype : p.dtype;
  dispatch_element_types(p.dtype, bias_dtype, [&](auto element, auto bias_element) {
    forward_typed<typename decltype(element)::type, typename decltype(bias_element)::type>(p);
  });
}

}  // namespace dmattn::cpu
