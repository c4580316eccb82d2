// Host side of the warp-specialized Hopper forward (fwd_ws_kernel_sm90.h): which problems it
// takes, the TMA descriptors of q, k and v, and the launch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include <cuda_runtime.h>

#include "dmattn/api.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "cuda/fwd_args.h"
#include "cuda/sm90/enabled.h"
#include "cuda/sm90/fwd_ws_kernel_sm90.h"
#include "cuda/sm90/mask_tile_sm90.h"
#include "cuda/sm90/tma_views.h"

namespace dmattn::cuda::sm90 {

// The score policy a problem needs: the bias tiles for a full bias alone, with the mask tiles
// beside them for a full mask (and softcap), with key rows beside them where a query-broadcast
// mask or softcap comes with it; the mask tiles for a full mask alone, with key rows beside them
// where softcap or a query-broadcast bias comes with it; per-key rows for everything else the
// kernel takes (gathered keys and key ends, query-broadcast biases and masks, softcap); plain
// scores without any of them.
inline FwdWsScores fwd_ws_scores(const FwdArgs& a) {
  const bool full_mask = a.mask.ptr != nullptr && !a.mask.row_bcast;
  if (a.bias.ptr != nullptr && !a.bias.row_bcast) {
    if (full_mask && a.kpos.ptr == nullptr && a.kpos.ends == nullptr) return FwdWsScores::kFullBiasMask;
    return a.mask.ptr != nullptr || a.softcap != 0.f || a.kpos.ptr != nullptr ? FwdWsScores::kFullBiasKeyRows
                                                                               : FwdWsScores::kFullBias;
  }
  if (a.mask.ptr != nullptr && !a.mask.row_bcast && a.kpos.ptr == nullptr && a.kpos.ends == nullptr)
    return a.bias.ptr != nullptr || a.softcap != 0.f ? FwdWsScores::kFullMaskKeyRows : FwdWsScores::kFullMask;
  if (a.kpos.ptr != nullptr || a.bias.ptr != nullptr || a.mask.ptr != nullptr || a.softcap != 0.f)
    return FwdWsScores::kKeyRows;
  return FwdWsScores::kPlain;
}

// The problems the warp-specialized kernel takes, at every head dim: dense or packed batches
// with plain scores, softcap, a query-broadcast bias (any dtype) or mask, and gathered keys with
// key ends; dense batches with a full bias (tma_bias_tiles_ok: 16-bit or fp32), alone or with a
// query-broadcast mask and / or softcap; dense batches with a full mask
// (tma_mask_tiles_ok), alone or with a query-broadcast bias and / or softcap; up to head dim
// 128, dense batches with a full bias and a full mask (and softcap). The others (a full bias or
// mask with gathered keys or key ends, a full bias and mask at 256, operands whose strides TMA
// cannot take; packed batches take key-side masks and biases only) run the sm90 kernel of
// fwd_kernel_sm90.h up to head dim 128, the sm80-class general kernel above.
template <int kHeadDim>
bool fwd_ws_supports(const FwdArgs& a) {
  static const bool off = env_switched_off("DMATTN_FWD_SM90_WS");  // (comparisons)
  if (off) return false;
  if (a.kpos.ends && !a.kpos.ptr) return false;
  const bool full_mask = a.mask.ptr && !a.mask.row_bcast;
  // (the bias or mask tiles: no key, nothing for their TMA descriptor to describe)
  switch (fwd_ws_scores(a)) {
    case FwdWsScores::kKeyRows:
      if (full_mask) return false;
      break;
    case FwdWsScores::kFullBias:
      if (!tma_bias_tiles_ok(a.bias, true) || a.seqlen_k == 0) return false;
      break;
    case FwdWsScores::kFullBiasKeyRows:
      if (!tma_bias_tiles_ok(a.bias, true) || full_mask || a.kpos.ptr || a.seqlen_k == 0) return false;
      break;
    case FwdWsScores::kFullBiasMask:
      if (kHeadDim > 128 || !tma_bias_tiles_ok(a.bias, true) || !tma_mask_tiles_ok(a.mask) || a.cu_seqlens_q != nullptr ||
          a.seqlen_k == 0)
        return false;
      break;
    case FwdWsScores::kFullMask:
    case FwdWsScores::kFullMaskKeyRows:
      if (!tma_mask_tiles_ok(a.mask) || a.cu_seqlens_q != nullptr || a.seqlen_k == 0) return false;
      break;
    case FwdWsScores::kPlain:
      break;
  }
  const int heads_kv = a.num_heads / a.group;
  const int batch = a.cu_seqlens_q ? 1 : a.batch;  // a packed batch is one sequence to TMA
  // (indexed keys: k and v are read by cp.async, not TMA)
  return tma_strides_ok(a.q_bs, a.q_hs, batch, a.num_heads) &&
         (a.kpos.rows != nullptr ||
          (tma_strides_ok(a.k_bs, a.k_hs, batch, heads_kv) && tma_strides_ok(a.v_bs, a.v_hs, batch, heads_kv)));
}

// Whether a forward of plain scores packs the query heads of each KV head into its tiles
// (pack_gqa_sm90.h): where the launch then needs fewer rounds of tiles over the
// multiprocessors. A tile reads the same key blocks packed or not, so a launch's time goes with
// its rounds; with short query sequences (a tile of one head mostly rows past the sequence) the
// group's rows fill group-fold fewer tiles. Where the rounds are as many, the unpacked launch
// was the faster (more CTAs streaming K and V: H200, B=1 against 32k keys, 5-10 %), and a
// launch of fewer tiles than multiprocessors stays unpacked (split-KV is the decode kernels').
// Packed batches count their longest sequence. The results are the same either way.
// DMATTN_FWD_PACK_GQA=0 / =1: never / wherever there is a group (read at each launch; tests and
// comparisons).
inline bool fwd_ws_packs_gqa(const FwdArgs& a, int block_m) {
  if (a.group <= 1 || fwd_ws_scores(a) != FwdWsScores::kPlain) return false;
  if (const char* mode = std::getenv("DMATTN_FWD_PACK_GQA")) return mode[0] != '0';
  const int sms = current_multiprocessor_count();
  if (sms <= 0) return false;
  auto rounds = [&](int64_t rows, int heads) {
    const int64_t tiles = int64_t(a.batch) * heads * ((rows + block_m - 1) / block_m);
    return (tiles + sms - 1) / sms;
  };
  return rounds(int64_t(a.seqlen_q) * a.group, a.num_heads / a.group) < rounds(a.seqlen_q, a.num_heads);
}

template <class Tile>
void launch_fwd_ws(const FwdArgs& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Tile::Element;
  const int heads_kv = a.num_heads / a.group;
  auto gmem = [&](const void* ptr, int rows, int cols, int heads, int batch, int64_t rs, int64_t hs, int64_t bs) {
    return tma_gmem_view(static_cast<const Element*>(ptr), rows, cols, heads, batch, rs, hs, bs);
  };
  // A packed batch is one sequence of all rows (batch 1); the kernel offsets each sequence's rows.
  const bool packed = a.cu_seqlens_q != nullptr;
  const int rows_q = packed ? int(a.q_rows) : a.seqlen_q, rows_k = packed ? int(a.k_rows) : a.seqlen_k;
  const int batch = packed ? 1 : a.batch;
  const auto q = gmem(a.q, rows_q, a.head_dim, a.num_heads, batch, a.q_rs, a.q_hs, a.q_bs);
  // Indexed keys: the producer's warps gather K and V by cp.async; descriptors over q stand in
  // for theirs (never used).
  const bool indexed = Tile::kKeyRows && a.kpos.rows != nullptr;
  const auto k = indexed ? q : gmem(a.k, rows_k, a.head_dim, heads_kv, batch, a.k_rs, a.k_hs, a.k_bs);
  const auto v = indexed ? q : gmem(a.v, rows_k, a.head_dim, heads_kv, batch, a.v_rs, a.v_hs, a.v_bs);
  // The bias's head and batch extents: 1 where it broadcasts (stride 0), else its own.
  const int bias_heads = a.bias.stride_h == 0 ? 1 : a.num_heads / a.bias.head_div;
  const int bias_batch = a.bias.stride_b == 0 ? 1 : a.batch;
  const int mask_heads = a.mask.stride_h == 0 ? 1 : a.num_heads / a.mask.head_div;
  const int mask_batch = a.mask.stride_b == 0 ? 1 : a.batch;
  // Packed query heads (Tile::kPackGqa): a tile per KV head, over seqlen_q * group rows.
  const int tile_heads = Tile::kPackGqa ? heads_kv : a.num_heads;
  const int64_t tile_rows = int64_t(a.seqlen_q) * (Tile::kPackGqa ? a.group : 1);
  const int num_m_blocks = int((tile_rows + Tile::kBlockM - 1) / Tile::kBlockM);
  const int num_hb = tile_heads * a.batch;
  const int num_tiles = num_m_blocks * num_hb;
  // Persistent: one CTA an SM (the launch bounds and shared memory allow no second), each taking
  // units of work in fixed rounds (the kernel's scheduler warp): the next tile's loads overlap
  // this one's last products and epilogue. Under a causal / window sweep a unit pairs a costly
  // tile with a cheap one (fwd_ws_tile_coords), and the rounds must come out nearly whole: else
  // one tile a CTA, which the hardware's dynamic CTA scheduling balances better (H100, causal
  // D=64 at 5.3 rounds: docs/design.md). Key ends take one tile a CTA too (the kernel's
  // block-wide search for their first live row). DMATTN_FWD_PERSISTENT=0 / =1: never / wherever
  // key ends allow, for comparisons (read at each launch:
  // benchmarks/profiling/fwd_schedule_timing.py alternates them). With DMATTN_FWD_PERSISTENT set,
  // DMATTN_FWD_PERSISTENT_CTAS=n caps a persistent grid at n CTAs, so that small problems hand
  // each CTA many tiles (tests; not read otherwise, off the launch's usual path). Otherwise a
  // caller may rule persistence out for its thread's calls (dmattn::set_persistent_kernels: a
  // context-parallel ring step, whose NCCL transfers need multiprocessors while it computes).
  const bool sweep = a.window_left >= 0 || a.window_right >= 0;
  const int sms = current_multiprocessor_count();
  const int pair_units = num_hb * ((num_m_blocks + 1) / 2);
  const double rounds = sms > 0 ? double(pair_units) / sms : 0.0;
  const bool whole_rounds = rounds >= 1.0 && std::ceil(rounds) <= rounds * 1.06;
  const char* const mode = std::getenv("DMATTN_FWD_PERSISTENT");
  const bool persistent = a.kpos.ends == nullptr && sms > 0 &&
                          (mode != nullptr ? mode[0] != '0'
                                           : dmattn::persistent_kernels_allowed() && (!sweep || whole_rounds));
  const bool paired = persistent && sweep;
  const int units = paired ? pair_units : num_tiles;
  // The bias tiles' descriptor; without a bias an empty one, never read (no encoding on the host).
  typename Tile::TmaBias tma_bias{};
  if constexpr (Tile::kBias)
    tma_bias = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view(reinterpret_cast<const typename Tile::BiasElement*>(a.bias.ptr), a.seqlen_q,
                                           a.seqlen_k, bias_heads, bias_batch, a.bias.stride_q, a.bias.stride_h,
                                           a.bias.stride_b),
                             take<0, 2>(typename Tile::SmemLayoutBias{}));
  // The mask tiles' likewise.
  typename Tile::TmaMask tma_mask{};
  if constexpr (Tile::kMask)
    tma_mask = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view(reinterpret_cast<const uint8_t*>(a.mask.ptr), a.seqlen_q, a.seqlen_k,
                                           mask_heads, mask_batch, a.mask.stride_q, a.mask.stride_h, a.mask.stride_b),
                             take<0, 2>(typename Tile::SmemLayoutMask{}));
  FwdWsParams<Tile> p{
      a,
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Tile::SmemLayoutQ{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Tile::SmemLayoutKV{})),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Tile::SmemLayoutKV{})),
      tma_bias,
      tma_mask,
      bias_heads,
      bias_batch,
      mask_heads,
      mask_batch,
      rows_q,
      rows_k,
      batch,
      FwdWsTiles{num_m_blocks, num_hb, tile_heads, paired, units},
  };
  auto kernel = fwd_ws_kernel_sm90<Tile>;
  constexpr int smem = Tile::kSmemBytes;
  allow_dynamic_shared_memory(kernel, smem, "cudaFuncSetAttribute(forward smem)");
  int ctas = sms;
  if (mode != nullptr) {
    const char* const cap_env = std::getenv("DMATTN_FWD_PERSISTENT_CTAS");
    const int cap = cap_env != nullptr ? std::atoi(cap_env) : 0;
    if (cap > 0) ctas = std::min(ctas, cap);
  }
  const int grid = persistent && ctas < units ? ctas : units;
  if (grid == 0) return;
  kernel<<<grid, Tile::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "forward kernel launch");
}

}  // namespace dmattn::cuda::sm90
