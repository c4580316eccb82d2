// Host side of the warp-specialized Hopper backward (bwd_ws_kernel_sm90.h): which problems it
// takes, the TMA descriptors of q, dO, k, v and dQ's accumulator, and the launch.
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "cuda/common/bwd_args.h"
#include "cuda/common/cta_order.h"
#include "cuda/common/launch.h"
#include "cuda/sm90/bwd_ws_kernel_sm90.h"
#include "cuda/sm90/enabled.h"
#include "cuda/sm90/tma_views.h"
#include "cuda/common/stream_buffer.h"
#include "cuda/sm80/bwd_tile.h"

namespace dmattn::cuda::sm90 {

// The score policy of a problem the kernel takes: the bias tiles for a full bias, per-key rows
// for gathered keys / key ends, a query-broadcast bias or mask; windows with sinks (alone:
// bwd_ws_supports); plain scores without any of them (the gate alone included, with gate
// skipping or without: its plain-scores variants).
inline BwdWsScores bwd_ws_scores(const FwdArgs& f) {
  if (f.bias.ptr != nullptr && !f.bias.row_bcast) return BwdWsScores::kFullBias;
  if (f.windows != nullptr && f.gate.alpha == nullptr) return BwdWsScores::kWindows;
  return f.kpos.ptr != nullptr || f.bias.ptr != nullptr || f.mask.ptr != nullptr ? BwdWsScores::kKeyRows
                                                                                 : BwdWsScores::kPlain;
}

// A full bias's gradient the kernel stores by TMA from its dS tiles: one element per dS element
// (kDbDirect), contiguous keys, 16-byte multiples as strides and base (db_vec), and non-zero
// strides on the dims of more than one index.
inline bool bwd_ws_dbias_tiles_ok(const BwdArgs& a) {
  return a.dbias_mode == kDbDirect && a.db_vec && a.db_sq != 0 &&
         tma_strides_ok(a.db_sb, a.db_sh, a.f.batch, a.f.num_heads);
}

// The problems the warp-specialized backward takes (at "64" and "128" every head dim up to 128 on
// those instantiations, at "256" those above): dense or packed batches at 64 and 128 (and 256)
// with plain scores, or at 64 and 128 with per-key rows (a query-broadcast or
// key-side bias with its column-sum gradient or without one, a query-broadcast or key-side
// mask; dense batches also gathered keys and key ends), dense batches at 64 and 128 with a full
// 16-bit bias alone whose tiles TMA loads (tma_bias_tiles_ok), with its gradient where every dS element has its own
// (bwd_ws_dbias_tiles_ok) or without one; the gate at 64 and 128 alone or with key rows (no
// column-sum dbias beside it);
// the lse or the exact path's statistics (dQ then by the query-major kernel). The others (full masks, fp32 full biases, a full bias's gradient reduced
// over batch / heads, softcap, a dbias reduced by folding batch / heads into a CTA) run the
// general kernels; in deterministic mode also the problems whose dQ adds it cannot order
// (bwd_ws_orders_dq_adds). DMATTN_BWD_SM90_WS=0 switches it off.
inline bool bwd_ws_supports(const BwdArgs& a) {
  // (read on every call, so that one process can compare both kernels: the tests do)
  const FwdArgs& f = a.f;
  // (the instantiation a head dim runs on, the sm80-class kernels' bins: any multiple of 8 up to
  // it -- TMA fills Q, K, V and dO's columns past head_dim with zeros, gathered rows are
  // zero-filled alike, and dQ's TMA adds and dK / dV's stores stop at head_dim)
  const int hd = bwd_instantiated_head_dim(int(f.head_dim));
  if (env_switched_off("DMATTN_BWD_SM90_WS") || hd == 0 || f.softcap != 0.f) return false;
  if (hd == 256 && (bwd_ws_scores(f) != BwdWsScores::kPlain || f.gate.alpha != nullptr)) return false;
  if (a.fold_batch || a.fold_heads) return false;
  // (no query or no key: nothing for TMA to describe -- an empty tensor may even have a null
  // pointer; the general kernels write the zeros)
  if (f.seqlen_q <= 0 || f.seqlen_k <= 0 || f.batch <= 0) return false;
  if ((f.mask.ptr && !f.mask.row_bcast) || (f.kpos.ends && !f.kpos.ptr)) return false;
  // (the gate: key rows without a full bias or dbias column sums; windows with sinks: plain scores
  // besides them -- no gate, gathered keys, bias or mask --, one row for the query heads of a KV
  // head -- a CTA walks them all over one run of query blocks --, window_runs.h)
  if (f.windows != nullptr &&
      (f.gate.alpha != nullptr || f.kpos.ptr != nullptr || f.bias.ptr != nullptr || f.mask.ptr != nullptr ||
       (f.windows_hs != 0 && f.windows_head_div % f.group != 0)))
    return false;
  if (f.gate.alpha != nullptr &&
      (hd == 256 || bwd_ws_scores(f) == BwdWsScores::kFullBias ||
       (a.dbias != nullptr && a.dbias_mode == kDbColSum)))
    return false;
  const bool packed = f.cu_seqlens_q != nullptr;
  if (packed && (f.kpos.ptr != nullptr || f.q_rows <= 0 || f.k_rows <= 0)) return false;
  if (bwd_ws_scores(f) == BwdWsScores::kFullBias) {
    if (packed) return false;  // (a packed batch's biases are key-side)
    if (!tma_bias_tiles_ok(f.bias) || f.mask.ptr || f.kpos.ptr) return false;
    if (a.dbias != nullptr && !bwd_ws_dbias_tiles_ok(a)) return false;
  } else if (a.dbias != nullptr && a.dbias_mode != kDbColSum && a.dbias_mode != kDbNone) {
    return false;
  }
  const int heads_kv = f.num_heads / f.group;
  const int batch = packed ? 1 : f.batch;  // a packed batch is one sequence to TMA
  // (indexed keys: k and v are read by cp.async, not TMA)
  return tma_strides_ok(f.q_bs, f.q_hs, batch, f.num_heads) && tma_strides_ok(a.do_bs, a.do_hs, batch, f.num_heads) &&
         (f.kpos.rows != nullptr ||
          (tma_strides_ok(f.k_bs, f.k_hs, batch, heads_kv) && tma_strides_ok(f.v_bs, f.v_hs, batch, heads_kv)));
}

// Deterministic mode: the kernel adds each query block's dQ in key block order, which needs the
// key blocks that meet a query block to be consecutive: true of the query block range of a
// window (bwd_query_block_range), not of gathered keys' positions or of windows with sinks'
// bands.
inline bool bwd_ws_orders_dq_adds(const BwdArgs& a) { return a.f.kpos.ptr == nullptr && a.f.windows == nullptr; }

template <class Tile, bool kPacked>
void launch_bwd_ws_tile(const BwdArgs& a, dim3 grid, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Tile::Element;
  const FwdArgs& f = a.f;
  const int heads_kv = f.num_heads / f.group;
  // A packed batch is one sequence of all rows (batch 1); the kernel offsets each sequence's rows.
  const bool packed = f.cu_seqlens_q != nullptr;
  const int rows_q = packed ? int(f.q_rows) : f.seqlen_q, rows_k = packed ? int(f.k_rows) : f.seqlen_k;
  const int batch = packed ? 1 : f.batch;
  auto view = [&](const void* ptr, int rows, int heads, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_view(static_cast<const Element*>(ptr), rows, f.head_dim, heads, batch, rs, hs, bs);
  };
  const int64_t hd = f.head_dim;
  // dq_accum: (B, Sq, H, D) fp32, contiguous (packed: (total_q, H, D)). Without it (the exact
  // path: dQ from the query-major kernel), a descriptor that is never used, over any aligned
  // float buffer.
  auto dq_view = a.dq_accum != nullptr
                     ? tma_gmem_view(a.dq_accum, rows_q, f.head_dim, f.num_heads, batch, f.num_heads * hd, hd,
                                     rows_q * f.num_heads * hd)
                     : tma_gmem_view(a.delta, Tile::kBlockM, Tile::kDqBoxCols, 1, 1, Tile::kDqBoxCols, 0, 0);
  // Indexed keys: the producer warpgroup copies K and V by cp.async; descriptors over q stand in
  // for theirs (never used).
  const bool indexed = Tile::kKeyRows && f.kpos.rows != nullptr;
  const auto q_view = view(f.q, rows_q, f.num_heads, f.q_rs, f.q_hs, f.q_bs);
  // The bias (its head / batch extents 1 where it broadcasts) and dbias: with a full bias only.
  // Other policies pass empty descriptors, never read (no encoding on the host); a full bias
  // without a direct gradient, a dbias descriptor over q that is never used.
  const int bias_heads = f.bias.stride_h == 0 ? 1 : f.num_heads / f.bias.head_div;
  const int bias_batch = f.bias.stride_b == 0 ? 1 : f.batch;
  const bool dbias_tiles = Tile::kFullBias && a.dbias != nullptr && a.dbias_mode == kDbDirect;
  typename Tile::TmaBias tma_bias{};
  typename Tile::TmadBias tma_dbias{};
  if constexpr (Tile::kFullBias) {
    tma_bias = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view(reinterpret_cast<const Element*>(f.bias.ptr), f.seqlen_q, f.seqlen_k,
                                           bias_heads, bias_batch, f.bias.stride_q, f.bias.stride_h, f.bias.stride_b),
                             typename Tile::SmemLayoutP{});
    auto q_out = tma_gmem_view(const_cast<Element*>(static_cast<const Element*>(f.q)), rows_q, f.head_dim,
                               f.num_heads, batch, f.q_rs, f.q_hs, f.q_bs);
    tma_dbias = make_tma_copy(SM90_TMA_STORE{},
                              dbias_tiles ? tma_gmem_view(static_cast<Element*>(a.dbias), f.seqlen_q, f.seqlen_k,
                                                          f.num_heads, f.batch, a.db_sq, a.db_sh, a.db_sb)
                                          : q_out,
                              typename Tile::SmemLayoutP{});
  }
  BwdWsParams<Tile> p{
      a,
      make_tma_copy(SM90_TMA_LOAD{}, q_view, take<0, 2>(typename Tile::SmemLayoutQ{})),
      make_tma_copy(SM90_TMA_LOAD{}, view(a.dout, rows_q, f.num_heads, a.do_rs, a.do_hs, a.do_bs),
                    take<0, 2>(typename Tile::SmemLayoutQ{})),
      make_tma_copy(SM90_TMA_LOAD{}, indexed ? q_view : view(f.k, rows_k, heads_kv, f.k_rs, f.k_hs, f.k_bs),
                    typename Tile::SmemLayoutKV{}),
      make_tma_copy(SM90_TMA_LOAD{}, indexed ? q_view : view(f.v, rows_k, heads_kv, f.v_rs, f.v_hs, f.v_bs),
                    typename Tile::SmemLayoutKV{}),
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, dq_view, take<0, 2>(typename Tile::SmemLayoutdQBoxes{})),
      tma_bias,
      tma_dbias,
      bias_heads,
      bias_batch,
      rows_q,
      rows_k,
      batch,
  };
  auto kernel = bwd_ws_kernel_sm90<Tile, kPacked>;
  constexpr int smem = Tile::kSmemBytes;
  launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, p, "backward kernel launch (sm90, warp-specialized)");
}

// grid: the general Hopper kernel's (cta_order.h), one CTA per (key block of Tile::kBlockN, kv
// head, batch).
// ordered_dq (deterministic mode): dQ's adds in key block order, through a zeroed flag per
// (batch, head, query block) that lives for this launch.
template <typename Element, int kHeadDim>
void launch_bwd_ws(const BwdArgs& args, dim3 grid, bool ordered_dq, cudaStream_t stream) {
  BwdArgs a = args;
  std::optional<ZeroedStreamBuffer> order;
  if (ordered_dq) {
    constexpr int kBlockM = BwdWsTile<Element, kHeadDim, BwdWsScores::kPlain>::kBlockM;  // (every policy's)
    const FwdArgs& f = a.f;
    const int64_t flags = int64_t(f.batch) * f.num_heads * dq_order_blocks(f.seqlen_q, kBlockM);
    order.emplace(size_t(flags) * sizeof(int), stream, "cudaMallocAsync / cudaMemsetAsync(dQ order flags)");
    a.dq_order = static_cast<int*>(order->get());
  }
  // (packed batches: plain scores or key rows; bwd_ws_supports)
  const bool packed = a.f.cu_seqlens_q != nullptr;
  using Plain = BwdWsTile<Element, kHeadDim, BwdWsScores::kPlain>;
  if constexpr (kHeadDim == 256) {  // (plain scores only: bwd_ws_supports)
    packed ? launch_bwd_ws_tile<Plain, true>(a, grid, stream) : launch_bwd_ws_tile<Plain, false>(a, grid, stream);
  } else {
    using KeyRows = BwdWsTile<Element, kHeadDim, BwdWsScores::kKeyRows>;
    using KeyRowsColSum = BwdWsTile<Element, kHeadDim, BwdWsScores::kKeyRows, /*kColSum=*/true>;
    using KeyRowsGate = BwdWsTile<Element, kHeadDim, BwdWsScores::kKeyRows, /*kColSum=*/false, /*kGate=*/true>;
    using KeyRowsGateSkip = BwdWsTile<Element, kHeadDim, BwdWsScores::kKeyRows, false, true, /*kGateSkip=*/true>;
    switch (bwd_ws_scores(a.f)) {
      case BwdWsScores::kFullBias:
        launch_bwd_ws_tile<BwdWsTile<Element, kHeadDim, BwdWsScores::kFullBias>, false>(a, grid, stream);
        break;
      case BwdWsScores::kKeyRows:
        // (bwd_ws_supports: a key-row problem's dbias is its column sums, or none; none with
        // the gate)
        if (a.f.gate.alpha != nullptr && a.f.gate.keep != nullptr)
          packed ? launch_bwd_ws_tile<KeyRowsGateSkip, true>(a, grid, stream)
                 : launch_bwd_ws_tile<KeyRowsGateSkip, false>(a, grid, stream);
        else if (a.f.gate.alpha != nullptr)
          packed ? launch_bwd_ws_tile<KeyRowsGate, true>(a, grid, stream)
                 : launch_bwd_ws_tile<KeyRowsGate, false>(a, grid, stream);
        else if (a.dbias != nullptr && a.dbias_mode == kDbColSum)
          packed ? launch_bwd_ws_tile<KeyRowsColSum, true>(a, grid, stream)
                 : launch_bwd_ws_tile<KeyRowsColSum, false>(a, grid, stream);
        else
          packed ? launch_bwd_ws_tile<KeyRows, true>(a, grid, stream)
                 : launch_bwd_ws_tile<KeyRows, false>(a, grid, stream);
        break;
      case BwdWsScores::kWindows: {
        using Windows = BwdWsTile<Element, kHeadDim, BwdWsScores::kWindows>;
        packed ? launch_bwd_ws_tile<Windows, true>(a, grid, stream)
               : launch_bwd_ws_tile<Windows, false>(a, grid, stream);
        break;
      }
      case BwdWsScores::kPlain:
        if (a.f.gate.alpha != nullptr && a.f.gate.keep != nullptr) {  // (the gate alone, skipping)
          using PlainGateSkip = BwdWsTile<Element, kHeadDim, BwdWsScores::kPlain, false, true, /*kGateSkip=*/true>;
          packed ? launch_bwd_ws_tile<PlainGateSkip, true>(a, grid, stream)
                 : launch_bwd_ws_tile<PlainGateSkip, false>(a, grid, stream);
        } else if (a.f.gate.alpha != nullptr) {  // (the gate alone)
          using PlainGate = BwdWsTile<Element, kHeadDim, BwdWsScores::kPlain, /*kColSum=*/false, /*kGate=*/true>;
          packed ? launch_bwd_ws_tile<PlainGate, true>(a, grid, stream)
                 : launch_bwd_ws_tile<PlainGate, false>(a, grid, stream);
        } else {
          packed ? launch_bwd_ws_tile<Plain, true>(a, grid, stream) : launch_bwd_ws_tile<Plain, false>(a, grid, stream);
        }
        break;
    }
  }
}

}  // namespace dmattn::cuda::sm90
