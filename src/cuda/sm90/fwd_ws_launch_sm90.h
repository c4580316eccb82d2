// Host side of the warp-specialized Hopper forward (fwd_ws_kernel_sm90.h): which problems it
// takes, the TMA descriptors of q, k and v, and the launch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include <cuda_runtime.h>

#include "dmattn/api.h"
#include "cuda/common/device_info.h"
#include "cuda/common/launch.h"
#include "cuda/common/fwd_args.h"
#include "cuda/sm90/enabled.h"
#include "cuda/sm90/fwd_ws_kernel_sm90.h"
#include "cuda/sm90/mask_tile_sm90.h"
#include "cuda/sm90/tma_views.h"

namespace dmattn::cuda::sm90 {

// The score policy a problem needs: the bias tiles for a full bias, with the mask tiles beside
// them for a full mask (and softcap), else with key rows beside them where gathered keys, a
// query-broadcast mask or softcap come with it; the mask tiles for a full mask, with key rows
// beside them where gathered keys, softcap or a query-broadcast bias come with it; per-key rows
// for everything else the kernel takes (gathered keys and key ends, query-broadcast biases and
// masks, softcap), their variant kKeyRowsGate with the gate (kGateOnly for the gate alone: its
// rows without the other key rows' terms); windows with sinks (kWindows: plain
// scores besides the windows; fwd_ws_supports); plain scores without any of them. (Under
// gathered keys a full bias's or mask's columns are the gathered rows, tiled by TMA like any
// other.)
inline FwdWsScores fwd_ws_scores(const FwdArgs& a) {
  const bool full_bias = a.bias.ptr != nullptr && !a.bias.row_bcast;
  const bool full_mask = a.mask.ptr != nullptr && !a.mask.row_bcast;
  if (full_bias && full_mask) return FwdWsScores::kFullBiasMask;
  if (full_bias)
    return a.mask.ptr != nullptr || a.softcap != 0.f || a.kpos.ptr != nullptr ? FwdWsScores::kFullBiasKeyRows
                                                                               : FwdWsScores::kFullBias;
  if (full_mask)
    return a.bias.ptr != nullptr || a.softcap != 0.f || a.kpos.ptr != nullptr ? FwdWsScores::kFullMaskKeyRows
                                                                               : FwdWsScores::kFullMask;
  // (past the full tiles: a bias or mask here is query-broadcast)
  const bool key_row_terms = a.kpos.ptr != nullptr || a.bias.ptr != nullptr || a.mask.ptr != nullptr || a.softcap != 0.f;
  if (a.gate.alpha != nullptr) {
    if (a.gate.keep != nullptr) return FwdWsScores::kKeyRowsGateSkip;
    return key_row_terms || a.windows != nullptr ? FwdWsScores::kKeyRowsGate : FwdWsScores::kGateOnly;
  }
  if (a.windows != nullptr) return FwdWsScores::kWindows;
  return key_row_terms ? FwdWsScores::kKeyRows : FwdWsScores::kPlain;
}

// How the kernel's TMA descriptors see q, k and v: a packed batch as one sequence of all its rows
// (batch 1; the kernel offsets each sequence's rows), and an operand that broadcasts over heads
// or batch (stride 0) through a view of one head / batch (TmaExtents).
struct FwdWsQkvViews {
  int64_t rows_q, rows_k;
  TmaExtents q, k, v;

  static FwdWsQkvViews of(const FwdArgs& a) {
    const bool packed = a.cu_seqlens_q != nullptr;
    const int batch = packed ? 1 : a.batch, heads_kv = a.num_heads / a.group;
    return {packed ? a.q_rows : a.seqlen_q, packed ? a.k_rows : a.seqlen_k,
            TmaExtents::of(a.q_hs, a.num_heads, a.q_bs, batch), TmaExtents::of(a.k_hs, heads_kv, a.k_bs, batch),
            TmaExtents::of(a.v_hs, heads_kv, a.v_bs, batch)};
  }
};

// The problems the warp-specialized kernel takes, at every head dim: dense or packed batches with
// plain scores, softcap, a query-broadcast bias (any dtype) or mask, gathered keys with key ends,
// the gate (without bias or mask tiles, at head dims 64 and 128), windows with sinks (plain
// scores besides them, at head dims 64 and 128: the key blocks of the sinks and bands,
// window_runs.h); dense batches with a full bias
// (tma_bias_tiles_ok: 16-bit or fp32) or a full mask (tma_mask_tiles_ok), each alone or with any of
// those; dense batches with a full bias and a full mask (and softcap; at head dim 256 a 16-bit
// bias). Operands that broadcast over heads or batch (stride 0; k and v alike) are read through
// views of one head / batch (TmaExtents). The others (a full bias with a full mask with gathered
// keys, or at 256 in fp32; rows of stride 0, k and v broadcast differently, bias / mask rows TMA
// cannot tile; the gate and windows with sinks elsewhere) run the sm80-class kernels.
template <int kHeadDim>
bool fwd_ws_supports(const FwdArgs& a) {
  if (a.kpos.ends && !a.kpos.ptr) return false;
  // (the gate comes with key rows alone, windows with sinks with plain scores alone, each in a
  // variant of its own, at head dims 64 and 128: the gate beside bias or mask tiles, at 256 --
  // where its code spilled the consumers --, the two together, and windows beside a bias, a
  // mask, softcap or gathered keys, the sm80-class kernel's score terms)
  const FwdWsScores scores = fwd_ws_scores(a);
  if (a.gate.alpha != nullptr && (kHeadDim == 256 || !is_gate_scores(scores) || a.windows != nullptr))
    return false;
  // (gate skipping: a tile's kept key blocks fit its slot, FwdWsTile::kSkipWalkMax)
  if (a.gate.keep != nullptr && (a.seqlen_k + kGateCell - 1) / kGateCell > kFwdWsSkipWalkBlocks) return false;
  // (with the gate's term warps, warps 2 and 3 compute its terms, not indexed keys' gathers: those
  // keys come as a gathered copy, run_fwd)
  if (kGateTermWarps && a.gate.alpha != nullptr && a.kpos.rows != nullptr) return false;
  if (a.windows != nullptr && (kHeadDim == 256 || a.kpos.ptr != nullptr || a.bias.ptr != nullptr ||
                               a.mask.ptr != nullptr || a.softcap != 0.f))
    return false;
  // (a stride of 0 along the rows, every query or key the same row: no TMA view of it)
  const FwdWsQkvViews views = FwdWsQkvViews::of(a);
  if ((views.rows_q > 1 && a.q_rs == 0) || (a.kpos.rows == nullptr && views.rows_k > 1 && (a.k_rs == 0 || a.v_rs == 0)))
    return false;
  // (k and v share one head / batch coordinate: the producer's registers; alike in practice)
  if (a.kpos.rows == nullptr && (views.k.heads != views.v.heads || views.k.batch != views.v.batch)) return false;
  // (the bias or mask tiles: no key, nothing for their TMA descriptor to describe)
  switch (fwd_ws_scores(a)) {
    case FwdWsScores::kPlain:
    case FwdWsScores::kKeyRows:
    case FwdWsScores::kKeyRowsGate:
    case FwdWsScores::kKeyRowsGateSkip:
    case FwdWsScores::kGateOnly:
    case FwdWsScores::kWindows:
      return true;
    case FwdWsScores::kFullBias:
    case FwdWsScores::kFullBiasKeyRows:
      return tma_bias_tiles_ok(a.bias, true) && a.seqlen_k > 0;
    case FwdWsScores::kFullBiasMask:  // (at head dim 256 a 16-bit bias: FwdWsConfig)
      return (kHeadDim <= 128 || a.bias.esize == 2) && a.kpos.ptr == nullptr && tma_bias_tiles_ok(a.bias, true) &&
             tma_mask_tiles_ok(a.mask) && a.cu_seqlens_q == nullptr && a.seqlen_k > 0;
    case FwdWsScores::kFullMask:
    case FwdWsScores::kFullMaskKeyRows:
      return tma_mask_tiles_ok(a.mask) && a.cu_seqlens_q == nullptr && a.seqlen_k > 0;
  }
  return false;
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
  const FwdWsQkvViews views = FwdWsQkvViews::of(a);
  const int rows_q = int(views.rows_q), rows_k = int(views.rows_k);
  const TmaExtents q_ext = views.q;
  const auto q = gmem(a.q, rows_q, a.head_dim, q_ext.heads, q_ext.batch, a.q_rs, a.q_hs, a.q_bs);
  // Indexed keys: the producer's warps gather K and V by cp.async; descriptors over q stand in
  // for theirs (never used). (k and v broadcast alike: fwd_ws_supports)
  const bool indexed = Tile::kKeyRows && a.kpos.rows != nullptr;
  const TmaExtents kv_ext = indexed ? q_ext : views.k;
  const auto k = indexed ? q : gmem(a.k, rows_k, a.head_dim, kv_ext.heads, kv_ext.batch, a.k_rs, a.k_hs, a.k_bs);
  const auto v = indexed ? q : gmem(a.v, rows_k, a.head_dim, kv_ext.heads, kv_ext.batch, a.v_rs, a.v_hs, a.v_bs);
  const TmaExtents bias_ext = TmaExtents::of(a.bias.stride_h, a.num_heads / a.bias.head_div, a.bias.stride_b, a.batch);
  const TmaExtents mask_ext = TmaExtents::of(a.mask.stride_h, a.num_heads / a.mask.head_div, a.mask.stride_b, a.batch);
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
                                           a.seqlen_k, bias_ext.heads, bias_ext.batch, a.bias.stride_q, a.bias.stride_h,
                                           a.bias.stride_b),
                             take<0, 2>(typename Tile::SmemLayoutBias{}));
  // The mask tiles' likewise.
  typename Tile::TmaMask tma_mask{};
  if constexpr (Tile::kMask)
    tma_mask = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view(reinterpret_cast<const uint8_t*>(a.mask.ptr), a.seqlen_q, a.seqlen_k,
                                           mask_ext.heads, mask_ext.batch, a.mask.stride_q, a.mask.stride_h,
                                           a.mask.stride_b),
                             take<0, 2>(typename Tile::SmemLayoutMask{}));
  FwdWsParams<Tile> p{
      a,
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Tile::SmemLayoutQ{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Tile::SmemLayoutKV{})),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Tile::SmemLayoutKV{})),
      tma_bias,
      tma_mask,
      q_ext,
      kv_ext,
      bias_ext,
      mask_ext,
      rows_q,
      rows_k,
      FwdWsTiles{num_m_blocks, num_hb, tile_heads, paired, units},
  };
  auto kernel = fwd_ws_kernel_sm90<Tile>;
  constexpr int smem = Tile::kSmemBytes;
  int ctas = sms;
  if (mode != nullptr) {
    const char* const cap_env = std::getenv("DMATTN_FWD_PERSISTENT_CTAS");
    const int cap = cap_env != nullptr ? std::atoi(cap_env) : 0;
    if (cap > 0) ctas = std::min(ctas, cap);
  }
  const int grid = persistent && ctas < units ? ctas : units;
  if (grid == 0) return;
  launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, p, "forward kernel launch (sm90, warp-specialized)");
}

}  // namespace dmattn::cuda::sm90
