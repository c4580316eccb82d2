// Tile, shared-memory layouts, TMA types and pipelines of the warp-specialized Hopper forward
// (fwd_ws_kernel_sm90.h).
// One producer warpgroup (TMA loads) and kConsumers consumer warpgroups of 64 query rows each
// (kBlockM = 64 * kConsumers). Q, K and V use wgmma's 128-byte-swizzled K-major layout, which
// TMA writes directly; V is read transposed (MN-major B operand of O += P V) through a composed
// view, without a copy. K and V each have kStages pipeline stages.
// The score policy (FwdWsScores):
//   kPlain:    scale * q k^T, the window / causal / tail test;
//   kFullBias: a 16-bit bias with one row per query, (kBlockM, kBlockN) tiles loaded by TMA with
//              K into stages of its own (kOperandStages: kStages, one beside the mask tiles at
//              head dim 256), in the same 128-byte swizzle (chunk c of a 64-key half-row at
//              c ^ (row % 8): the accumulator-layout reads of a warp hit 8 different bank groups);
//   kFullMask: a boolean mask with one row per query (one byte an element), (kBlockM, kBlockN)
//              tiles loaded by TMA with K as the bias tiles are, in the 8-bit 128-byte swizzle
//              (chunk c of a row at c ^ (row % 8)); a false element gives a -inf score, the
//              softmax then on raw scores as kPlain's (mask_tile_sm90.h);
//   kKeyRows:  per-key operands, one kBlockN row of each per key block: the key's position
//              (gathered keys; else its index), its query bound (key ends; else none), its
//              bias (a query-broadcast bias in any of its dtypes, converted to fp32; else 0).
//              A producer warp loads them into kStages KeyRowStage buffers (a PipelineAsync);
//              the test runs on positions (key_positions.h);
//   kKeyRowsGate: kKeyRows with gated attention's gate (gate_sm90.h): the stages also carry the
//              block's delta rows and the tile's alpha rows (a variant of its own: the gate's
//              code in the key-row kernel cost it spills); built with the gate's term warps,
//              its logarithm terms come in a ring of fp16 tiles that the producer's warps 2
//              and 3 fill (gate_terms_sm90.h);
//   kGateOnly: the gate alone (no key bias, mask, positions, softcap or windows): the stages of
//              kKeyRowsGate with the delta and alpha rows only, final scores (scale q k^T plus
//              scale g, the backward's to the bit) and kPlain's window / tail test;
//   kFullBiasKeyRows: both, for a full bias with a query-broadcast mask (a key padding mask)
//              and / or softcap: the bias tiles as kFullBias's, the key rows as kKeyRows's
//              without their bias (the mask's rows give the query bounds);
//   kFullMaskKeyRows: a full mask with softcap and / or a query-broadcast bias: the mask tiles
//              as kFullMask's, the key rows as kKeyRows's (their bias; no query bounds but the
//              keys' end), the mask applied to the final scores;
//   kFullBiasMask: a full bias with a full mask (and softcap): both tile streams, each
//              through a pipeline of its own, the mask applied to the final scores.
//   kWindows:  windows with sinks (window_runs.h) on plain scores: the tile's key blocks as a
//              walk over the runs of its sinks and bands, which the scheduler warp hands over
//              with the head's element test and the blocks the window shows whole; the
//              consumers test the others.
// A full bias in fp32 (kBiasBytes = 4: a learnable bias kept in fp32 beside 16-bit q, k, v) comes
// as fp32 tiles in the 128-byte swizzle of 4-byte elements (32-key column blocks).
// Mask tiles of a 64-key block are 64-byte rows in the 64-byte swizzle (chunk c of row r at
// c ^ ((r / 2) % 4)).
// Under plain scores the query heads of a KV head may be packed into the rows (kPackGqa,
// pack_gqa_sm90.h): Q then comes by the producer's warp 1 (cp.async), not TMA.
// Per head dim (FwdWsConfig): 64: 192 x 128 (three consumers); 128: 128 x 128; 256: 128 x 80 (the
// largest key block whose Q, two K and two V stages fit in 227 KB), 128 x 64 with a bias, a mask
// or key rows. 128 x 64 at 128 where two tile streams or fp32 bias tiles would not fit beside
// 128-key K and V stages.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/common/key_positions.h"
#include "cuda/common/window_runs.h"
#include "cuda/sm90/gate_terms_sm90.h"

namespace dmattn::cuda::sm90 {

enum class FwdWsScores {
  kPlain,
  kFullBias,
  kKeyRows,
  kFullMask,
  kFullBiasKeyRows,
  kFullMaskKeyRows,
  kFullBiasMask,
  kKeyRowsGate,
  kWindows,
  kKeyRowsGateSkip,
  kGateOnly
};

// The gate's policies: exact (beside the key rows' other terms, or alone), and with gate
// skipping's cells.
constexpr bool is_gate_scores(FwdWsScores s) {
  return s == FwdWsScores::kKeyRowsGate || s == FwdWsScores::kKeyRowsGateSkip || s == FwdWsScores::kGateOnly;
}

// Gate skipping's walk: the most key blocks of a sequence (of kGateCell keys) a tile's slot holds.
inline constexpr int kFwdWsSkipWalkBlocks = 2048;

// One tile of the forward (a query block of one head and batch) as the scheduler warp hands it
// to the other roles: the key blocks [n_min, n_max) it reads (empty: its rows see no key), and
// how many key blocks the CTA's earlier tiles read (where the K / V / bias / key-row pipelines
// stand when it starts). m_block < 0: no tile left.
struct FwdWsTileInfo {
  int m_block, h, b, n_min, n_max;  // (windows with sinks: [n_min, n_max) virtual blocks of walk)
  uint32_t blocks_before;
};

// Windows with sinks (the kWindows variant): a tile's walk over its key blocks, its head's
// element test and the blocks that need it not, in a slot beside the tile's (FwdWsTileInfo keeps
// its size in the other variants: grown, it cost their scheduler and loader warps registers).
struct FwdWsTileWindows {
  BlockWalk walk;
  SinkWindowTest window;
  ClearKeyBlocks clear;
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, FwdWsScores kScores_,
          int kProducerRegs_, int kConsumerRegs_, bool kPackGqa_ = false, int kBiasBytes_ = 2,
          int kOperandStages_ = kStages_>
struct FwdWsTile {
  static constexpr FwdWsScores kScores = kScores_;
  // The query heads of a KV head packed into the tile's rows (pack_gqa_sm90.h): plain scores
  // only (a bias, mask or key rows would differ between the rows' heads).
  static constexpr bool kPackGqa = kPackGqa_;
  static_assert(!kPackGqa || kScores == FwdWsScores::kPlain);
  // The same tile with the heads packed or not.
  template <bool kPack>
  using WithPackGqa = FwdWsTile<Element_, kHeadDim_, kBlockM_, kBlockN_, kStages_, kScores_, kProducerRegs_,
                                kConsumerRegs_, kPack, kBiasBytes_, kOperandStages_>;
  // the (kBlockM, kBlockN) bias tiles
  static constexpr bool kBias = kScores == FwdWsScores::kFullBias || kScores == FwdWsScores::kFullBiasKeyRows ||
                                kScores == FwdWsScores::kFullBiasMask;
  // the per-key rows
  static constexpr bool kKeyRows = kScores == FwdWsScores::kKeyRows || kScores == FwdWsScores::kFullBiasKeyRows ||
                                   kScores == FwdWsScores::kFullMaskKeyRows || is_gate_scores(kScores);
  // gated attention's gate (gate_sm90.h), with key rows alone; kKeyRowsGateSkip with gate
  // skipping's cells (a variant of its own: the exact kernel keeps its loop as it was)
  static constexpr bool kGate = is_gate_scores(kScores);
  static constexpr bool kGateSkip = kScores == FwdWsScores::kKeyRowsGateSkip;
  // The gate alone (no key bias, mask, positions or softcap): the key-row stages carry alpha and
  // delta only, and the scores take the plain window / tail test. They are final scores, as the
  // key rows' (not raw q k^T with the scale in the exponent, as plain scores'): the backward
  // recomputes them to the bit, and the softmax takes the safe subtraction where a row's maximum
  // is large (a linear gate's product reaches fp32's largest value).
  static constexpr bool kGateOnly = kScores == FwdWsScores::kGateOnly;
  // Gate skipping: each tile's kept key blocks (int16 block indices, ascending; walked from the
  // last down, as every tile's blocks) in a slot beside the tile's, so that every role walks the kept
  // blocks alone and no branch sits around the consumers' products (a skipped block's products
  // behind a branch made ptxas serialize every wgmma of the kernel, C7520: the skipping forward
  // took 1.36x the exact one where nothing was skipped). Sequences of more key blocks than a slot
  // holds take the sm80-class kernels (fwd_ws_supports).
  static constexpr int kSkipWalkMax = kGateSkip ? kFwdWsSkipWalkBlocks : 1;
  // The gate's logarithm terms, computed by the producer's warps 2 and 3 into a ring of their own
  // (gate_terms_sm90.h; where built with them, kGateTermWarps).
  static constexpr bool kGateTerms = kGate && !kGateOnly && kGateTermWarps;
  using GateTerms = GateTermRing<kBlockN_, kBlockM_ / 64>;
  // windows with sinks (window_runs.h: the tile's key blocks as a walk), a variant of plain scores:
  // the tile's element test and the blocks that need it come from the scheduler's slot, so no
  // loader warp or key-row stage stands between the consumers' products
  static constexpr bool kWindows = kScores == FwdWsScores::kWindows;
  // the (kBlockM, kBlockN) mask tiles
  static constexpr bool kMask = kScores == FwdWsScores::kFullMask || kScores == FwdWsScores::kFullMaskKeyRows ||
                                kScores == FwdWsScores::kFullBiasMask;
  // Softcap on the scores (the policies whose problems may carry it; plain scores and a lone
  // bias or mask never do: fwd_ws_scores).
  static constexpr bool kSoftcap = (kKeyRows && !kGateOnly) || kScores == FwdWsScores::kFullBiasMask;
  // Final scores (scale and bias applied before the softmax, scale 1 there) or raw q k^T with
  // the scale folded into the softmax's exponent.
  static constexpr bool kScaledScores = kBias || kKeyRows;
  using Element = Element_;
  // The bias tiles' element: q's 16-bit type, or fp32.
  static constexpr int kBiasBytes = kBiasBytes_;
  static_assert(kBiasBytes == 2 || (kBiasBytes == 4 && kBias));
  using BiasElement = std::conditional_t<kBiasBytes == 4, float, Element>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static_assert(!kMask || kBlockN == 128 || kBlockN == 64, "mask tiles: one 128- or 64-byte swizzle atom a row");
  static constexpr int kStages = kStages_;
  // The bias and mask tiles' stages: K's and V's, or one where both streams would not fit beside
  // them otherwise (the producer then issues block n's tiles after V[n + 1], fwd_ws_kernel_sm90.h).
  static constexpr int kOperandStages = kOperandStages_;
  static_assert(kOperandStages >= 1 && kOperandStages <= kStages);
  static constexpr int kConsumers = kBlockM / 64;  // consumer warpgroups
  static constexpr int kConsumerThreads = kConsumers * 128;
  static constexpr int kNThreads = kConsumerThreads + 128;  // + the producer warpgroup
  static_assert(kBlockM % 64 == 0 && kConsumers >= 2 && kConsumers <= 3);
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256 && kBlockN % 16 == 0 && kBlockN <= 256);
  // setmaxnreg budgets (multiples of 8): the launch gives every thread kLaunchRegs (64 K
  // registers per SM over kNThreads); the producer gives back what its address arithmetic does
  // not need and the consumers take it. setmaxnreg.inc waits until the registers are free, so a
  // budget the producer does not release hangs the CTA: checked here.
  static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
  static constexpr int kProducerRegs = kProducerRegs_;
  static constexpr int kConsumerRegs = kConsumerRegs_;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256);
  static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumerThreads,
                "the consumers' registers must come from the producer's");

  using ConsumerLayout = cute::Layout<cute::Shape<cute::Int<kConsumers>, cute::_1, cute::_1>>;
  // S = Q K^T: both operands from shared memory, K-major.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      ConsumerLayout{}));
  // O += P V: P from registers (K-major A), V^T from shared memory (MN-major B).
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      ConsumerLayout{}));

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // V (keys, D, stage) viewed as (D, keys, stage).
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{},
      cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                        cute::Stride<cute::Int<kBlockN>, cute::_1, cute::Int<kBlockN * kHeadDim>>{})));

  // Global q / k / v as (rows, head dim, heads, batch); the row, head and batch strides are the
  // tensor's (16-byte multiples: launch_fwd_ws checks).
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemLayout = cute::Layout<cute::Shape<int, int, int, int>, GmemStride>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                             cute::take<0, 2>(SmemLayoutKV{})));

  // (without a bias, a placeholder tile of 64 keys: kBlockN need not be a multiple of the atom's)
  static constexpr int kBiasN = kBias ? kBlockN : 64;
  using SmemLayoutBias = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<BiasElement>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBiasN>, cute::Int<kOperandStages>>{}));
  using GmemTensorBias =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const BiasElement*>(nullptr)), GmemLayout{}));
  using TmaBias = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorBias{},
                                               cute::take<0, 2>(SmemLayoutBias{})));
  // The mask as bytes, one swizzle atom a row (without a mask, a placeholder of 8 x 128).
  static constexpr int kMaskM = kMask ? kBlockM : 8;
  static constexpr int kMaskN = kMask ? kBlockN : 128;
  using MaskAtom = std::conditional_t<kMaskN == 128, cute::GMMA::Layout_K_SW128_Atom<uint8_t>,
                                      cute::GMMA::Layout_K_SW64_Atom<uint8_t>>;
  using SmemLayoutMask = decltype(cute::tile_to_shape(
      MaskAtom{}, cute::Shape<cute::Int<kMaskM>, cute::Int<kMaskN>, cute::Int<kOperandStages>>{}));
  using GmemTensorMask =
      decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const uint8_t*>(nullptr)), GmemLayout{}));
  using TmaMask = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorMask{},
                                               cute::take<0, 2>(SmemLayoutMask{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using OperandPipeline = cutlass::PipelineTmaAsync<kOperandStages>;
  // Per-key rows of one key block (kKeyRows): written by the loader warp's plain stores. Beside
  // the bias tiles no key bias (one placeholder entry: at head dim 128 the two stages of the
  // bias tiles leave no room for it).
  // (kGate: the block's delta rows and the tile's alpha rows)
  struct KeyRowStage {
    int32_t pos[kBlockN];  // position of the key (-1: a padding row past the keys)
    int32_t end[kBlockN];  // queries i < end may see it (INT_MAX: no bound; 0 past the keys)
    float bias[kBias ? 1 : kBlockN];
    alignas(16) float delta[kGate ? kBlockN : 1];
    float alpha[kGate ? kBlockM : 1];
    alignas(16) int32_t end_min;  // the smallest of end[] (16-byte aligned: the next stage's rows are read as float2)
    int32_t needs_test;           // whether the block's scores need the per-element test (the loader decides)
  };
  static constexpr int kKeyRowEndDelta = kBlockN;  // end[] behind pos[] (PositionTest::end_delta)
  using KeyRowPipeline = cutlass::PipelineAsync<kStages>;
  // The tiles of a persistent CTA, handed from the scheduler warp to the other roles (two slots:
  // the next tile is known while the current one runs).
  static constexpr int kTileSlots = 2;
  using TilePipeline = cutlass::PipelineAsync<kTileSlots>;
  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVStageBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kBiasStageBytes = kBlockM * kBiasN * kBiasBytes;
  static constexpr int kMaskStageBytes = kMaskM * kMaskN;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;  // O in the epilogue
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    // The bias's tiles (kBiasStageBytes a stage) and the mask's (kMaskStageBytes), as bytes.
    alignas(kBias ? 1024 : 16) cute::array_aligned<uint8_t, kBias ? kOperandStages * kBiasStageBytes : 16, 16> bias_tiles;
    alignas(kMask ? 1024 : 16) cute::array_aligned<uint8_t, kMask ? kOperandStages * kMaskStageBytes : 16, 16> mask_tiles;
    cute::array_aligned<KeyRowStage, kKeyRows ? kStages : 1, 16> key_rows;
    alignas(16) cute::array_aligned<uint8_t, kGateTerms ? GateTerms::kBytes : 16, 16> gate_terms;
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    typename OperandPipeline::SharedStorage pipe_bias, pipe_mask;
    typename KeyRowPipeline::SharedStorage pipe_key_rows;
    typename GateTerms::Pipeline::SharedStorage pipe_gate_terms;
    typename TilePipeline::SharedStorage pipe_tile;
    FwdWsTileInfo tiles[kTileSlots];
    FwdWsTileWindows tile_windows[kWindows ? kTileSlots : 1];
    int16_t skip_walk[kGateSkip ? kTileSlots : 1][kSkipWalkMax];  // (kGateSkip: the tile's kept key blocks)
    alignas(8) cutlass::arch::ClusterTransactionBarrier::ValueType q_full;
    alignas(8) cutlass::arch::ClusterBarrier::ValueType q_empty;  // the consumers are done with Q's buffer
    int32_t first_alive[kNThreads / 32];  // per warp: the first row a query of the block may keep
    uint32_t sched_tiles, sched_blocks;   // the scheduler's counters (fwd_ws_kernel_sm90.h)
    int32_t sched_next;                   // and its next step
    // The key rows' loader's summary of its tile's window (fwd_ws_kernel_sm90.h).
    QueryBlockWindow key_rows_window;
  };
  static_assert(!kBias || cute::cosize_v<SmemLayoutBias> * kBiasBytes == kOperandStages * kBiasStageBytes);
  static_assert(!kGateSkip || (!kBias && !kMask), "gate skipping's walk maps K and V, not bias or mask tiles");
  static_assert(!kMask || cute::cosize_v<SmemLayoutMask> == kOperandStages * kMaskStageBytes);
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "beyond the shared memory of one CTA");
};

// The tile of each head dim (a dim below it runs zero-filled by TMA: 96 on 128), with the register
// budgets that keep both roles free of spills (ptxas -v). Two consumers: the producer at 40 and the
// consumers at 232 (24 / 240 spilled the producer's TMA coordinates and descriptors; at D = 256 the
// consumers fit 232 only with the GEMM descriptors rebuilt per issue, fwd_ws_kernel_sm90.h). At 256
// with a bias, a mask or key rows, a key block of 64: the bias or mask stages fit beside Q, K and V
// (those of 80 take the whole shared memory), and the gather warps take whole groups of 32 rows.
// With a bias, key rows or windows with sinks at 64, two consumers (three spilled at 160
// registers); with the gate 56 / 224 (its rows' loads spilled the loader at 40). At 128 every
// policy but plain scores and windows with sinks (plain scores' budget): 48 / 224 (56 / 224
// with the gate, whose rows' loads spilled the key-row loader at 48; at 40 the producer's TMA
// issue of K and the bias or mask tile spilled a register, and for key rows the scheduler
// warp's scan of a key mask for its first and last true key, mask_tile_sm90.h); a key block of 64
// for both tile streams (Q, K and V of 128 keys take 160 KB, the bias's two stages 64 KB) and for
// fp32 bias tiles; at 64 too for fp32 bias tiles beside mask tiles (128 keys: 240 KB). kBiasBytes:
// the bias tiles' element size (4: fp32). At 256 fp32 bias tiles take key blocks of 32 (one swizzle
// atom of floats a row; Q, two K and two V stages and two bias stages 160 KB; 64 keys would need
// 256 KB). A full bias (16-bit) with a full mask at 256: key blocks of 64 with one stage of each
// tile stream (two stages of both do not fit beside Q, K and V: 240 KB; one, 216 KB), 48 / 224 as
// the mask alone. A full mask alone at 256: 48 / 224 (at 40 the producer's issue of K and the mask
// tile spilled 68 bytes).
template <typename Element, int kHeadDim, FwdWsScores kScores, int kBiasBytes = 2> struct FwdWsConfig;
template <typename Element> struct FwdWsConfig<Element, 64, FwdWsScores::kPlain, 2> {
  using Tile = FwdWsTile<Element, 64, 192, 128, 2, FwdWsScores::kPlain, 32, 160>;
};
template <typename Element, FwdWsScores kScores, int kBiasBytes> struct FwdWsConfig<Element, 64, kScores, kBiasBytes> {
  static constexpr int kBlockN = kBiasBytes == 4 && kScores == FwdWsScores::kFullBiasMask ? 64 : 128;
  static constexpr bool kGate = is_gate_scores(kScores);
  static constexpr int kProducerRegs = kGate ? 56 : 40;
  using Tile = FwdWsTile<Element, 64, 128, kBlockN, 2, kScores, kProducerRegs, kGate ? 224 : 232, false,
                         kBiasBytes>;
};
template <typename Element, FwdWsScores kScores, int kBiasBytes> struct FwdWsConfig<Element, 128, kScores, kBiasBytes> {
  // (plain scores' budget: plain scores and windows with sinks, whose producer has no loader warp)
  static constexpr bool kPlainBudget = kScores == FwdWsScores::kPlain || kScores == FwdWsScores::kWindows;
  static constexpr int kBlockN = kBiasBytes == 4 || kScores == FwdWsScores::kFullBiasMask ? 64 : 128;
  static constexpr int kProducerRegs = kPlainBudget ? 40 : is_gate_scores(kScores) ? 56 : 48;
  using Tile =
      FwdWsTile<Element, 128, 128, kBlockN, 2, kScores, kProducerRegs, kPlainBudget ? 232 : 224, false, kBiasBytes>;
};
template <typename Element, FwdWsScores kScores> struct FwdWsConfig<Element, 256, kScores, 2> {
  static constexpr bool kBothStreams = kScores == FwdWsScores::kFullBiasMask;
  static constexpr bool kMaskTiles = kScores == FwdWsScores::kFullMask || kBothStreams;
  using Tile = FwdWsTile<Element, 256, 128, 64, 2, kScores, kMaskTiles ? 48 : 40, kMaskTiles ? 224 : 232, false, 2,
                         kBothStreams ? 1 : 2>;
};
template <typename Element, FwdWsScores kScores> struct FwdWsConfig<Element, 256, kScores, 4> {
  static_assert(kScores == FwdWsScores::kFullBias || kScores == FwdWsScores::kFullBiasKeyRows,
                "fp32 bias tiles at head dim 256: alone or beside key rows");
  using Tile = FwdWsTile<Element, 256, 128, 32, 2, kScores, 40, 232, false, 4>;
};
template <typename Element> struct FwdWsConfig<Element, 256, FwdWsScores::kPlain, 2> {
  using Tile = FwdWsTile<Element, 256, 128, 80, 2, FwdWsScores::kPlain, 40, 232>;
};

}  // namespace dmattn::cuda::sm90
