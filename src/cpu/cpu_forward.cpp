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
#include "cpu/online_softmax.h"
#include "cpu/score_mod.h"
#include "cpu/tile_math.h"

namespace dmattn::cpu {
namespace {

// Per-thread tile buffers.
template <typename Acc>
struct ForwardTiles {
  std::vector<Acc> q, k, v, scores, out_acc;
  std::vector<OnlineSoftmaxRow<Acc>> row_stats;
  explicit ForwardTiles(int64_t dim)
      : q(kBlockQ * dim), k(kBlockK * dim), v(kBlockK * dim), scores(kBlockQ * kBlockK),
        out_acc(kBlockQ * dim), row_stats(kBlockQ) {}
};

template <typename T, typename Acc, typename BiasT>
void forward_query_block(const ForwardParams& p, const ScoreMod<Acc, BiasT>& mod, int64_t b,
                         int64_t h, int64_t query_block, ForwardTiles<Acc>& tiles) {
  const int64_t dim = p.head_dim;
  const int64_t kv_head = h / p.group_size();
  const int64_t i0 = query_block * kBlockQ;
  const int64_t rows = std::min(kBlockQ, p.seqlen_q - i0);

  const T* q = static_cast<const T*>(p.q) + p.q_strides.offset(b, i0, h);
  load_rows(q, p.q_strides.row_stride, rows, dim, tiles.q.data(), kBlockQ);
  std::fill(tiles.out_acc.begin(), tiles.out_acc.end(), Acc(0));
  std::fill(tiles.row_stats.begin(), tiles.row_stats.end(), OnlineSoftmaxRow<Acc>{});

  // Key blocks that causal/window exclude for every row of this query block are skipped.
  const IndexRange keys = mod.keys.for_queries(b, h, {i0, i0 + rows});
  for (int64_t j0 = aligned_block_start(keys.begin, kBlockK); j0 < keys.end; j0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, p.seqlen_k - j0);
    const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, j0, kv_head);
    const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, j0, kv_head);
    load_rows(k, p.k_strides.row_stride, cols, dim, tiles.k.data(), kBlockK);
    load_rows(v, p.v_strides.row_stride, cols, dim, tiles.v.data(), kBlockK);

    matmul_into_scores(tiles.q.data(), tiles.k.data(), dim, tiles.scores.data());
    mod.apply(b, h, i0, rows, j0, cols, tiles.scores.data(), nullptr);
    for (int64_t r = 0; r < rows; ++r) {
      const Acc rescale = tiles.row_stats[r].update(tiles.scores.data() + r * kBlockK, cols);
      if (rescale != Acc(1)) {
        Acc* out_row = tiles.out_acc.data() + r * dim;
        for (int64_t d = 0; d < dim; ++d) out_row[d] *= rescale;
      }
    }
    accumulate_product(tiles.scores.data(), tiles.v.data(), dim, tiles.out_acc.data());
  }

  // Normalize and write. An empty row (m = -inf, l = 0) gets out = 0 and lse = -inf.
  T* out = static_cast<T*>(p.out) + p.out_strides.offset(b, i0, h);
  Acc* lse = static_cast<Acc*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + i0;
  for (int64_t r = 0; r < rows; ++r) {
    const OnlineSoftmaxRow<Acc>& stats = tiles.row_stats[r];
    const bool empty = stats.empty();
    const Acc inv_sum = empty ? Acc(0) : Acc(1) / stats.sum;
    T* out_row = out + r * p.out_strides.row_stride;
    const Acc* acc_row = tiles.out_acc.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) store_saturating(out_row + d, acc_row[d] * inv_sum);
    lse[r] = empty ? -std::numeric_limits<Acc>::infinity() : stats.max + std::log(stats.sum);
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
  use_single_threaded_blas();
  const DType bias_dtype = p.bias.present() ? p.bias.dtype : p.dtype;
  dispatch_element_types(p.dtype, bias_dtype, [&](auto element, auto bias_element) {
    forward_typed<typename decltype(element)::type, typename decltype(bias_element)::type>(p);
  });
}

}  // namespace dmattn::cpu
