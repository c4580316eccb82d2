// Tile sizes and shared-memory layouts of the forward kernel: one traits struct per
// (element type, instantiated head dim), read by both the launcher and the kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace dmattn::cuda {

// Head dims that have an instantiation, smallest first. Any D <= 256 with D % 8 == 0 runs on the
// next one, with the extra columns zero-filled on load and never written.
inline constexpr int kFwdHeadDims[] = {64, 128, 256};
inline constexpr int fwd_instantiated_head_dim(int d) {
  for (int hd : kFwdHeadDims)
    if (d <= hd) return hd;
  return 0;  // unsupported
}

// Tile knobs (compile-time macros, so that one build can time variants):
//   hd64 / hd128: 4 warps x 32 query rows (each warp owns two m16 tiles, so every K / V fragment
//   read from shared memory feeds two MMAs; two CTAs per SM overlap one's softmax with the
//   other's MMAs), kBlockM = 128. hd256: 8 warps x 16 rows, kBlockM = 128, kBlockN = 64.
#ifndef DMATTN_FWD_WARPS_HD128
#define DMATTN_FWD_WARPS_HD128 4
#endif
#ifndef DMATTN_FWD_WARPS_HD64
#define DMATTN_FWD_WARPS_HD64 4
#endif
#ifndef DMATTN_FWD_BLOCKN_HD128
#define DMATTN_FWD_BLOCKN_HD128 64
#endif
#ifndef DMATTN_FWD_BLOCKN_HD64
#define DMATTN_FWD_BLOCKN_HD64 128
#endif
#ifndef DMATTN_FWD_BLOCKN_HD256
#define DMATTN_FWD_BLOCKN_HD256 64
#endif
#ifndef DMATTN_FWD_WARPS_HD256
#define DMATTN_FWD_WARPS_HD256 8
#endif
// Bias tile double buffering (the next block's bias streams in while this block computes):
// 0 never, 1 when it keeps the CTAs per SM (see run_fwd), 2 always when it fits.
#ifndef DMATTN_FWD_BIAS_DB
#define DMATTN_FWD_BIAS_DB 1
#endif

// The general kernel (mask / bias / softcap) holds more per score element (bias and mask reads,
// the softcap's tanh); its own knobs keep it free of register spills.
#ifndef DMATTN_FWD_GEN_WARPS_HD128
#define DMATTN_FWD_GEN_WARPS_HD128 8
#endif
#ifndef DMATTN_FWD_GEN_BLOCKN_HD128
#define DMATTN_FWD_GEN_BLOCKN_HD128 64
#endif
#ifndef DMATTN_FWD_GEN_BLOCKN_HD64
#define DMATTN_FWD_GEN_BLOCKN_HD64 64
#endif
#ifndef DMATTN_FWD_GEN_BLOCKN_HD256
#define DMATTN_FWD_GEN_BLOCKN_HD256 32
#endif

// The init kernel (mask / bias, no softcap; fwd_kernel<Tile, true, true>).
#ifndef DMATTN_FWD_INIT_WARPS_HD128
#define DMATTN_FWD_INIT_WARPS_HD128 8
#endif
#ifndef DMATTN_FWD_INIT_BLOCKN_HD128
#define DMATTN_FWD_INIT_BLOCKN_HD128 64
#endif
#ifndef DMATTN_FWD_INIT_BLOCKN_HD64
#define DMATTN_FWD_INIT_BLOCKN_HD64 64
#endif
#ifndef DMATTN_FWD_INIT_BLOCKN_HD256
#define DMATTN_FWD_INIT_BLOCKN_HD256 32
#endif

// Which kernel a tile serves (fwd_kernel.h): plain scores, the init kernel (mask / bias), the
// general kernel (softcap, with or without mask / bias), and the general kernel's variant with
// score terms (the gate and windows with sinks: kTerms).
enum FwdKind : int { kFwdPlain = 0, kFwdInit = 1, kFwdGeneral = 2, kFwdTerms = 3 };

// kHopper: the configuration compiled for sm_90a, where these kernels are the fallback at head
// dims up to 128 (the Hopper kernels serve those: fwd_launch.h). ptxas for sm_90a needs more
// registers than for sm_80 on the same source: the plain kernel at head dim 128 spilled there on
// 4 warps x 32 rows (20 B; 24-36 with the measures below), so the sm_90a code runs it on 8 warps x
// 16 rows; so does the general kernel's score-terms variant at head dim 64 (1208 B of spills on 4
// warps; the general kernel itself keeps 4 there, where 8 ran slower: docs/design.md). Each
// configuration has a body only in its own device code (fwd_tile_compiled_here); the launcher
// picks by the device (fwd_launch.h).
template <typename Element_, int kHeadDim_, int kKind = kFwdPlain, bool kHopper_ = false>
struct FwdTile {
  using Element = Element_;
  static constexpr bool kHopper = kHopper_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kGeneral = kKind == kFwdGeneral || kKind == kFwdTerms;  // (the terms variant's tile)
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN =
      kGeneral ? (kHeadDim <= 64 ? DMATTN_FWD_GEN_BLOCKN_HD64
                  : kHeadDim <= 128 ? DMATTN_FWD_GEN_BLOCKN_HD128 : DMATTN_FWD_GEN_BLOCKN_HD256)
      : kKind == kFwdInit ? (kHeadDim <= 64 ? DMATTN_FWD_INIT_BLOCKN_HD64
                             : kHeadDim <= 128 ? DMATTN_FWD_INIT_BLOCKN_HD128 : DMATTN_FWD_INIT_BLOCKN_HD256)
                          : (kHeadDim <= 64 ? DMATTN_FWD_BLOCKN_HD64
                             : kHeadDim <= 128 ? DMATTN_FWD_BLOCKN_HD128 : DMATTN_FWD_BLOCKN_HD256);
  static constexpr int kNWarps =
      kHopper && (kHeadDim == 128 || (kHeadDim <= 64 && kKind == kFwdTerms)) ? 8
      : kHeadDim <= 64 ? DMATTN_FWD_WARPS_HD64
      : kHeadDim <= 128 ? (kGeneral ? DMATTN_FWD_GEN_WARPS_HD128
                           : kKind == kFwdInit ? DMATTN_FWD_INIT_WARPS_HD128 : DMATTN_FWD_WARPS_HD128)
                        : DMATTN_FWD_WARPS_HD256;
  static constexpr int kNThreads = kNWarps * 32;
  // Measures that keep the kernels below the register limit (ptxas -v: 0 spills; fwd_kernel.h,
  // docs/design.md): the key loop's shared-memory fragment addresses derived at each block from
  // an opaque thread index (not for the plain kernel above head dim 64: there it spilled instead,
  // 24 B at 128); the next k16 slice's fragments loaded before this slice's MMAs except in the
  // plain kernel at head dim 64 (128 scores and 64 output elements a thread: 48 B spilled).
  static constexpr bool kOpaqueLoopAddresses = kKind != kFwdPlain || kHeadDim <= 64;
  static constexpr bool kGemmPrefetch = kKind != kFwdPlain || kHeadDim > 64;
  // CTAs per SM the register budget allows (255 registers per thread at most).
  static constexpr int kCtasPerSm = kNThreads <= 128 ? 2 : 1;
  static_assert(kHeadDim % 32 == 0 && kBlockN % 32 == 0 && kBlockM % (16 * kNWarps) == 0);

  // mma.sync m16n8k16, fp32 accumulate; warps stacked along M.
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32F16F16F32_TN>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // Swizzled (rows, D) tiles: 8-element chunks stay contiguous, ldmatrix is conflict free.
  static constexpr int kSmemRowK = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowK == 64 ? 3 : 2;
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRowK>>, cute::Stride<cute::Int<kSmemRowK>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V viewed as (D, N) for the B operand of P V.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));

  using LdsmCopy = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LdsmCopyT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  // Mask / bias tiles (kBlockM, kBlockN) in shared memory, padded rows (conflict-free reads in
  // the accumulator layout; 16-byte aligned rows for cp.async).
  static constexpr int kBiasPitch = kBlockN + 8;   // elements of 2 or 4 bytes
  static constexpr int kMaskPitch = kBlockN + 16;  // bytes

  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kBiasBytes = kBlockM * kBiasPitch * 4;  // one fp32 tile (the largest)
  static constexpr int kMaskBytes = kBlockM * kMaskPitch;
  static constexpr int kOffK = kQBytes, kOffV = kOffK + kKVBytes, kOffBias = kOffV + kKVBytes;
  static constexpr int kOffMask = kOffBias + kBiasBytes;
  // Layout before the mask tiles existed in pairs (kept for reference; run_fwd sizes the
  // mask / bias buffers from the actual operands, see fwd_smem_layout()).
  static constexpr int smem_bytes(bool mask_or_bias) {
    return mask_or_bias ? kOffMask + kMaskBytes : kOffBias;
  }
};

// Whether this compilation pass holds Tile's kernel body: the kHopper configuration in the sm_90a
// code of a build with it (the launcher then picks it on compute capability 9.0:
// sm90::device_runs_sm90_kernels), the other one in every other device code. The host pass
// keeps both kernels' stubs.
#ifndef DMATTN_HAS_SM90A
#define DMATTN_HAS_SM90A 0
#endif
template <class Tile>
__host__ __device__ constexpr bool fwd_tile_compiled_here() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && DMATTN_HAS_SM90A
  return Tile::kHopper;
#elif defined(__CUDA_ARCH__)
  return !Tile::kHopper;
#else
  return true;
#endif
}

}  // namespace dmattn::cuda
