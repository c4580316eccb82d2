// Launcher of the forward kernel for one (element type, instantiated head dim); explicitly
// instantiated once per pair in src/cuda/inst/fwd_<dtype>_hd<D>.cu, its Hopper part in
// src/cuda/inst/fwd_ws_<dtype>_hd<D>.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/device_info.h"
#include "cuda/common/launch.h"
#include "cuda/common/fwd_args.h"

namespace dmattn::cuda {

template <typename Element, int kHeadDim>
void run_fwd(const FwdArgs& a, cudaStream_t stream);

}  // namespace dmattn::cuda

#ifdef DMATTN_FWD_LAUNCH_IMPL
#include <algorithm>
#include <cstdlib>

#include "cuda/sm80/fwd_kernel.h"
#include "cuda/indexed/indexed_rows.h"
#include "cuda/sm90/enabled.h"
#include "cuda/sm90/fwd_ws_launch_sm90.h"
#include "dmattn/error.h"

namespace dmattn::cuda {

inline int fwd_round_up(int x, int a) { return (x + a - 1) / a * a; }

// CTAs per SM that `smem` bytes of dynamic shared memory per CTA allow (1 KB reserved per CTA).
inline int fwd_ctas_by_smem(int smem, int smem_per_sm) { return smem_per_sm / (smem + 1024); }

// One launch of `kernel` (an sm80-class forward kernel built on Tile) with the mask / bias
// buffers placed for Tile. kInit: the init kernel's buffers (three mask tiles: its look-ahead is
// decided a block earlier; a double-buffered bias always: it loads the next block's bias before
// this block's products, so a size beyond the device's limit is then an error); the others keep
// two mask tiles (current and look-ahead) and double buffer the bias where the fit test says so.
template <class Tile, bool kInit, class Kernel>
void launch_fwd_kernel(const FwdArgs& args, cudaStream_t stream, Kernel kernel) {
  constexpr int kMaskTiles = kInit ? 3 : 2;
  FwdArgs a = args;
  const int dev = current_device();
  const int max_smem = max_shared_memory_optin(dev), smem_per_sm = shared_memory_per_multiprocessor(dev);

  // Shared memory: Q, K, V, then kMaskTiles mask tiles (look-ahead for block skipping), then one
  // or two bias tiles, then the positions tile. A query-broadcast operand needs one row per tile.
  // Behind the positions tile, a key ends tile (key_positions.h: at kBlockN entries from it).
  const int kpos_bytes = a.kpos.ptr ? 2 * Tile::kBlockN * 4 : 0;
  int smem = Tile::kOffBias;
  if (a.mask.ptr) {
    const int bytes = fwd_round_up((a.mask.row_bcast ? 1 : Tile::kBlockM) * Tile::kMaskPitch, 128);
    a.smem_mask_off = smem;
    a.smem_mask_stride = bytes;
    smem += kMaskTiles * bytes;
  }
  a.bias_db = false;
  if (a.bias.ptr) {
    const int bytes = fwd_round_up((a.bias.row_bcast ? 1 : Tile::kBlockM) * Tile::kBiasPitch * a.bias.esize, 128);
    a.smem_bias_off = smem;
    a.smem_bias_stride = bytes;
    // (the positions tiles, placed after the bias, count toward the fit)
    const int single = smem + bytes + kpos_bytes, dbl = smem + 2 * bytes + kpos_bytes;
    const int ctas_single = std::min(Tile::kCtasPerSm, fwd_ctas_by_smem(single, smem_per_sm));
    const int ctas_dbl = std::min(Tile::kCtasPerSm, fwd_ctas_by_smem(dbl, smem_per_sm));
    const int mode = DMATTN_FWD_BIAS_DB;
    a.bias_db = kInit || (dbl <= max_smem && (mode == 2 || (mode == 1 && ctas_dbl >= ctas_single)));
    smem += (a.bias_db ? 2 : 1) * bytes;
  }
  if (a.kpos.ptr) {  // gathered keys: the key block's positions (kBlockN int32 per tile)
    a.smem_kpos_off = smem;
    smem += kpos_bytes;
  }
  if (smem > max_smem)
    fail(ErrorKind::kValue, "CUDA backend: the forward kernel for head_dim <= ", Tile::kHeadDim, " with this mask/bias needs ",
         smem, " bytes of shared memory per block, the device allows ", max_smem);

  // Query blocks run in reverse order (fwd_kernel): blockIdx.x = 0 is the last query block.
  const dim3 grid((a.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM, a.num_heads, a.batch);
  launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, a, "forward kernel launch");
}

// kTerms: the general kernel's variant with the gate and windows with sinks (score_terms.h), the
// only one that reads them: a problem with them reaching another variant would lose them, so the
// launch checks that they match.
template <class Tile, bool kMaskBias, bool kInit, bool kTerms = false>
void launch_fwd(const FwdArgs& args, cudaStream_t stream) {
  check((args.gate.alpha != nullptr || args.windows != nullptr) == kTerms, ErrorKind::kRuntime,
        "CUDA backend: the gate / windows went to a forward kernel variant that does not match them");
  launch_fwd_kernel<Tile, kInit>(args, stream, fwd_kernel<Tile, kMaskBias, kInit, kTerms>);
}

// An sm80-class kernel in the configuration of the device's code (FwdTile's kHopper: the sm_90a
// one on compute capability 9.0 when the build has sm_90a code). The score-terms variant is the
// tile kind kFwdTerms.
template <typename Element, int kHeadDim, int kKind, bool kMaskBias, bool kInit>
void launch_fwd_for_device(const FwdArgs& a, cudaStream_t stream) {
  constexpr bool kTerms = kKind == kFwdTerms;
  if (sm90::device_runs_sm90_kernels())
    launch_fwd<FwdTile<Element, kHeadDim, kKind, true>, kMaskBias, kInit, kTerms>(a, stream);
  else
    launch_fwd<FwdTile<Element, kHeadDim, kKind, false>, kMaskBias, kInit, kTerms>(a, stream);
}

// The warp-specialized Hopper kernel (sm90/fwd_ws_kernel_sm90.h, every head dim) is the forward
// on compute capability 9.0 for what fwd_ws_supports takes: every option, but for a few
// combinations and layouts it lists (a full bias with a full mask with gathered keys, among
// them), which run the sm80-class kernels in their configuration for the device.
// DMATTN_FWD_SM90=0 turns it off: the sm80-class kernels, which run everywhere (comparisons, a
// fallback).
// (sm90/enabled.h: never in a build without sm_90a code)
inline bool fwd_sm90_enabled() {
  static const bool off = sm90::env_switched_off("DMATTN_FWD_SM90");
  return !off && sm90::device_runs_sm90_kernels();
}

// The init kernel (mask / bias folded into the QK^T accumulator's initial value): measured on the
// H100 10-15 % faster than the general kernel on bias rows, but its lse is wrong for rows whose
// every allowed key carries a finfo.min bias (docs/design.md), so it stays off
// (-DDMATTN_FWD_INIT_KERNEL=1 builds it). Off: a mask or bias goes to the general kernel.
#ifndef DMATTN_FWD_INIT_KERNEL
#define DMATTN_FWD_INIT_KERNEL 0
#endif

// The warp-specialized kernel of a bias-tile policy, its tiles in the bias's dtype (fp32 or q's).
template <typename Element, int kHeadDim, sm90::FwdWsScores kScores>
void launch_fwd_ws_bias_tiles(const FwdArgs& a, cudaStream_t stream) {
  if (a.bias.esize == 4)
    sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, kScores, 4>::Tile>(a, stream);
  else
    sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, kScores>::Tile>(a, stream);
}

// The gate's variant (head dims 64 and 128) in translation units of its own
// (inst/fwd_ws_gate_<dtype>.cu, DMATTN_INSTANTIATE_FWD_WS_GATE): its score code is the part of
// the Hopper forward that changes most, rebuilt alone.
// (Scores: kKeyRowsGate, kGateOnly for the gate alone, or kKeyRowsGateSkip with gate skipping's
// cells.)
#define DMATTN_FWD_WS_GATE_LAUNCH(Element, HD, Scores)                                                  \
  void dmattn::cuda::sm90::launch_fwd_ws<                                                             \
      dmattn::cuda::sm90::FwdWsConfig<Element, HD, dmattn::cuda::sm90::FwdWsScores::Scores>::Tile>( \
      const dmattn::cuda::FwdArgs&, cudaStream_t)
}  // namespace dmattn::cuda
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 64, kKeyRowsGate);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 128, kKeyRowsGate);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, kKeyRowsGate);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, kKeyRowsGate);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 64, kKeyRowsGateSkip);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 128, kKeyRowsGateSkip);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, kKeyRowsGateSkip);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, kKeyRowsGateSkip);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 64, kGateOnly);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::half_t, 128, kGateOnly);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, kGateOnly);
extern template DMATTN_FWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, kGateOnly);
namespace dmattn::cuda {

// The warp-specialized kernel of the problem's score policy (fwd_ws_scores); plain scores with
// the query heads of each KV head packed into the tiles where fwd_ws_packs_gqa says so.
template <typename Element, int kHeadDim>
void run_fwd_ws(const FwdArgs& a, cudaStream_t stream) {
  using sm90::FwdWsScores;
  switch (sm90::fwd_ws_scores(a)) {
    case FwdWsScores::kKeyRows:
      sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kKeyRows>::Tile>(a, stream);
      return;
    case FwdWsScores::kKeyRowsGate:  // (head dims 64 and 128: fwd_ws_supports)
      if constexpr (kHeadDim != 256)
        sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kKeyRowsGate>::Tile>(a, stream);
      return;
    case FwdWsScores::kGateOnly:
      if constexpr (kHeadDim != 256)
        sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kGateOnly>::Tile>(a, stream);
      return;
    case FwdWsScores::kKeyRowsGateSkip:
      if constexpr (kHeadDim != 256)
        sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kKeyRowsGateSkip>::Tile>(a,
                                                                                                               stream);
      return;
    case FwdWsScores::kWindows:  // (head dims 64 and 128: fwd_ws_supports)
      if constexpr (kHeadDim != 256)
        sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kWindows>::Tile>(a, stream);
      return;
    case FwdWsScores::kFullBias:
      launch_fwd_ws_bias_tiles<Element, kHeadDim, FwdWsScores::kFullBias>(a, stream);
      return;
    case FwdWsScores::kFullBiasKeyRows:
      launch_fwd_ws_bias_tiles<Element, kHeadDim, FwdWsScores::kFullBiasKeyRows>(a, stream);
      return;
    case FwdWsScores::kFullBiasMask:  // (at head dim 256 a 16-bit bias only, fwd_ws_supports)
      if constexpr (kHeadDim <= 128)
        launch_fwd_ws_bias_tiles<Element, kHeadDim, FwdWsScores::kFullBiasMask>(a, stream);
      else
        sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kFullBiasMask>::Tile>(a, stream);
      return;
    case FwdWsScores::kFullMask:
      sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kFullMask>::Tile>(a, stream);
      return;
    case FwdWsScores::kFullMaskKeyRows:
      sm90::launch_fwd_ws<typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kFullMaskKeyRows>::Tile>(a, stream);
      return;
    case FwdWsScores::kPlain: {
      using PlainTile = typename sm90::FwdWsConfig<Element, kHeadDim, FwdWsScores::kPlain>::Tile;
      if (sm90::fwd_ws_packs_gqa(a, PlainTile::kBlockM))
        sm90::launch_fwd_ws<typename PlainTile::template WithPackGqa<true>>(a, stream);
      else
        sm90::launch_fwd_ws<PlainTile>(a, stream);
      return;
    }
  }
}

// The Hopper forward's variants are compiled in translation units of their own
// (inst/fwd_ws_<dtype>_hd<D>.cu, DMATTN_INSTANTIATE_FWD_WS), beside the sm80-class kernels'
// rather than after them in one: the longest units of the build, split in two.
extern template void run_fwd_ws<cutlass::half_t, 64>(const FwdArgs&, cudaStream_t);
extern template void run_fwd_ws<cutlass::half_t, 128>(const FwdArgs&, cudaStream_t);
extern template void run_fwd_ws<cutlass::half_t, 256>(const FwdArgs&, cudaStream_t);
extern template void run_fwd_ws<cutlass::bfloat16_t, 64>(const FwdArgs&, cudaStream_t);
extern template void run_fwd_ws<cutlass::bfloat16_t, 128>(const FwdArgs&, cudaStream_t);
extern template void run_fwd_ws<cutlass::bfloat16_t, 256>(const FwdArgs&, cudaStream_t);

// The Hopper kernel where it takes the problem; otherwise plain scores go to the lean kernel, a
// mask / bias without softcap to the init kernel (when enabled), everything else to the general
// one.
template <typename Element, int kHeadDim>
void run_fwd(const FwdArgs& a, cudaStream_t stream) {
  // The gate and windows with sinks (score_terms.h): on the general kernel, and on the Hopper
  // kernel the gate with key rows, windows with plain scores (fwd_ws_supports).
  const bool terms = a.gate.alpha != nullptr || a.windows != nullptr;
  const bool hopper = fwd_sm90_enabled() && sm90::fwd_ws_supports<kHeadDim>(a);
  // Indexed keys: read in place by the warp-specialized kernel, gathered into a copy for the others.
  if (a.kpos.rows != nullptr && !hopper) {
    FwdArgs gathered = a;
    const GatheredRowsCopy rows(gathered, int(sizeof(Element)), stream);
    run_fwd<Element, kHeadDim>(gathered, stream);
    return;
  }
  if (hopper) {
    run_fwd_ws<Element, kHeadDim>(a, stream);
    return;
  }
  // Key ends are tested only by the mask / bias kernels (score_mask.h).
  const bool mask_or_bias = a.mask.ptr != nullptr || a.bias.ptr != nullptr || a.kpos.ends != nullptr;
#if DMATTN_FWD_INIT_KERNEL  // (not instantiated at all when off: compile time)
  if (mask_or_bias && a.softcap == 0.f && !a.kpos.ptr && !terms)  // no key positions in the init kernel
    launch_fwd_for_device<Element, kHeadDim, kFwdInit, true, true>(a, stream);
  else
#endif
  if (terms)
    launch_fwd_for_device<Element, kHeadDim, kFwdTerms, true, false>(a, stream);
  else if (mask_or_bias || a.softcap != 0.f)
    launch_fwd_for_device<Element, kHeadDim, kFwdGeneral, true, false>(a, stream);
  else
    launch_fwd_for_device<Element, kHeadDim, kFwdPlain, false, false>(a, stream);
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_FWD(Element, HD) \
  template void dmattn::cuda::run_fwd<Element, HD>(const dmattn::cuda::FwdArgs&, cudaStream_t);
#define DMATTN_INSTANTIATE_FWD_WS(Element, HD) \
  template void dmattn::cuda::run_fwd_ws<Element, HD>(const dmattn::cuda::FwdArgs&, cudaStream_t);
#define DMATTN_INSTANTIATE_FWD_WS_GATE(Element)                  \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 64, kKeyRowsGate);      \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 128, kKeyRowsGate);     \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 64, kKeyRowsGateSkip);  \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 64, kGateOnly);         \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 128, kGateOnly);        \
  template DMATTN_FWD_WS_GATE_LAUNCH(Element, 128, kKeyRowsGateSkip);
#endif
