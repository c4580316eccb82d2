// Tile, shared-memory layouts, TMA types and pipelines of the warp-specialized Hopper backward
// (bwd_ws_kernel_sm90.h). One CTA per (key block of 128 -- 64 at head dim 256 --, kv head,
// batch): a producer warpgroup and two consumer warpgroups; the key block's K and V stay in
// shared memory, Q / dO of each query block (64 rows) stream through kStages-deep TMA pipelines.
// The products, split between the consumers as in the general Hopper backward (bwd_tile_sm90.h):
//   S = Q K^T, dP = dO V^T    (64 queries, 128 keys): consumer w takes keys [64 w, 64 w + 64)
//   dV += P^T dO, dK += dS^T Q (128 keys, D):        consumer w takes keys [64 w, 64 w + 64)
//   dQ = dS K                  (64 queries, D):       D = 128: consumer w takes columns
//                                                      [64 w, 64 w + 64); D = 64: one consumer
//                                                      takes every column, consumer t % 2 in
//                                                      query block t (a (64 x 32)-column slice
//                                                      of K^T is no whole 128-byte swizzle row);
//                                                      either way from both halves of dS (one
//                                                      barrier of the two consumers)
// so that dV and dK read only the consumer's own columns of P and dS. dQ leaves through shared
// memory (fp32, one 64 x 64 region per consumer in 128-byte swizzled 64 x 32 boxes) by TMA
// reduce-add into dq_accum.
// Head dim 256 (kBlockN = 64, plain scores): S and dP split along the keys (32 each), dV, dK and
// dQ along the head dim (128 columns each: dK and dV of 128 keys would need 256 accumulator
// registers a thread), so every product reads both consumers' halves of P and dS (two buffers of
// each, one barrier of both consumers). Q in two stages and dO in one (as FlashAttention-3 at
// this head dim: dO[t + 1] loads while S[t + 1] is computed and transformed), which leaves room
// for 32 KiB of fp32 staging, one consumer's dQ columns: the consumers take turns on it (consumer
// 0's columns, then consumer 1's, each read by the writer's TMA reduce-add before the next; the
// turns handed over by two mbarriers, dK issued before the dQ product).
// Every operand of a product comes from shared memory in wgmma's 128-byte-swizzled K-major
// layout; the transposed operands are composed views.
// The score policy (BwdWsScores):
//   kPlain:   scale * q k^T, the window / causal / tail test;
//   kKeyRows: per-key rows of the key block (key_rows_sm90.h): positions (gathered keys; else the
//             index), query bounds (key ends, a query-broadcast mask) and a query-broadcast bias,
//             whose gradient is the column sums of dS (dbias_colsum_sm90.h). Loaded per query
//             block (the bias and the mask change with the query head under GQA).
//   kFullBias: a 16-bit bias with one row per query, its (64, 128) tile of each query block
//             loaded by TMA into one buffer (128-byte swizzle, as the forward's); its gradient,
//             where every dS element has its own dbias element (kDbDirect), is the dS tile
//             itself, stored from shared memory by TMA.
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

#include "cuda/common/window_runs.h"
#include "cuda/sm90/bwd_mmas_sm90.h"
#include "cuda/sm90/gate_terms_sm90.h"

namespace dmattn::cuda::sm90 {

enum class BwdWsScores { kPlain, kKeyRows, kFullBias, kWindows };

template <typename Element_, int kHeadDim_, BwdWsScores kScores_, bool kColSum_ = false, bool kGate_ = false,
          bool kGateSkip_ = false>
struct BwdWsTile {
  using Element = Element_;
  static constexpr BwdWsScores kScores = kScores_;
  static constexpr bool kKeyRows = kScores == BwdWsScores::kKeyRows;
  // Windows with sinks on plain scores (window_runs.h: the key block's query blocks as a walk;
  // the row-statistics loader marks the tiles that need the element test).
  static constexpr bool kWindows = kScores == BwdWsScores::kWindows;
  static constexpr bool kFullBias = kScores == BwdWsScores::kFullBias;
  // Key rows with a query-broadcast dbias (kDbColSum): its column sums, by one more product
  // (TiledMmaColSum) for a 16-bit bias, from dS in fp32 for an fp32 one. A variant of its own: in
  // the kernel without a dbias, a run-time test around the product and its accumulator cost 4 %
  // (registers the loop had used otherwise).
  static constexpr bool kColSum = kColSum_;
  static constexpr int kColSumRows = 4;  // the shared rows of the column sums (SharedStorage::colsum)
  static_assert(!kColSum || kKeyRows, "column sums: key rows only");
  // Gated attention's gate (gate_sm90.h, gate_grads_sm90.h): each query block's alpha rows with
  // its statistics, the key block's delta rows with the key rows (kKeyRows: the gate beside
  // gathered keys, a key bias or mask, or with gate skipping's cells) or, on plain scores (the
  // gate alone), once per CTA into gate_delta; the gradients' column sums in shared memory. A
  // variant of its own, as kColSum (the key-row consumers have no registers to spare for a
  // run-time test around it). On plain scores the consumers keep the plain kernel's order (dP
  // issued before the score transform, which the gate's value then overlaps).
  static constexpr bool kGate = kGate_;
  static_assert(!kGate || ((kKeyRows || kScores == BwdWsScores::kPlain) && !kColSum),
                "the gate: key rows or plain scores, without column sums");
  // The gate with gate skipping's cells (a variant of its own: the exact kernel keeps its loop).
  // On key rows a skipped cell runs without the gate's value (its statistic +inf makes P and dS
  // 0); on plain scores (the gate alone) it runs no product: the consumers and the dQ writer pass
  // over the block in step (bwd_ws_kernel_sm90.h).
  static constexpr bool kGateSkip = kGateSkip_;
  static_assert(!kGateSkip || kGate, "gate skipping: with the gate");
  // Built with the gate's term warps (kGateTermWarps): its logarithm terms of each query block
  // come as bytes from the producer's warp 3 (gate_terms_sm90.h, GateTermBytes).
  static constexpr bool kGateTerms = kGate && kGateTermWarps;
  // The consumers read the CTA's query-block walk (its bounds, count and the key block's valid
  // columns) from shared memory and derive each block's head, query block and pipeline state from
  // its index, instead of holding them through the loop: the gate beside key rows, whose
  // consumers spilled holding them (20 B at head dim 64; at 128, with the walk's bounds
  // warp-uniform and the producer's roles reading them from shared memory, 16 B dense and 24 B
  // packed with gate skipping, none this way: ptxas -v). The other key-row variants hold them
  // (in shared memory they spilled more: 44 B against 0 dense).
  static constexpr bool kWalkInSmem = kGate && kKeyRows;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;
  using GateTerms = GateTermBytes<kBlockM, kBlockN>;
  static constexpr int kStages = 2;  // Q (and the row statistics; dO too but at head dim 256)
  static constexpr int kStagesDo = kHeadDim == 256 ? 1 : kStages;
  static constexpr int kConsumers = 2;
  static constexpr int kConsumerThreads = kConsumers * 128;
  static constexpr int kNThreads = kConsumerThreads + 128;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dims 64, 128 and 256");
  static_assert(kHeadDim != 256 || kScores == BwdWsScores::kPlain, "head dim 256: plain scores");
  // D = 64: one consumer's dQ product per query block, over all the block's keys, so one (64, 64)
  // tile to reduce into dq_accum. (Split by keys instead, each consumer its own keys' share of
  // every column, dQ would take two reduce-adds of the same elements per block: twice the L2
  // reduction traffic, which binds this kernel.)
  static constexpr bool kDqOneConsumer = kHeadDim == 64;
  // Whether consumer w computes dQ of query block t. The writer adds the staged tiles of exactly
  // these consumers (a mismatch would leave it waiting or drop a tile). D = 64: consumer t % 2.
  static CUTE_HOST_DEVICE constexpr bool computes_dq(int w, int t) { return !kDqOneConsumer || (t & 1) == w; }
  // The first consumer whose tile of block t the writer adds (deterministic mode's flag waits there).
  static CUTE_HOST_DEVICE constexpr int first_dq_adder(int t) { return kDqOneConsumer ? t & 1 : 0; }
  // Head dim 256: each consumer's 128 dQ columns take the whole staging buffer, so the consumers
  // take turns on it (consumer 0's columns, then consumer 1's, every query block).
  static constexpr bool kDqTurns = kHeadDim == 256;
  // dS is read across consumers (the dQ product) or stored as dbias's tile by the writer (a full
  // bias): two buffers, and one barrier of both consumers once both halves are written.
  static constexpr int kDsBuffers = 2;
  // setmaxnreg: 65536 / 384 = 168 at launch; the producer keeps 40 and the consumers take 232
  // (dK and dV hold 128 accumulator registers, S and dP 64, dQ 32). With 24 / 240 the producer's
  // TMA coordinates spilled (ptxas -v: 96 B in the plain kernel, none at 40 / 232). At D = 64
  // the consumers need far fewer (64 + 64 + 32): the key-row loader gets 56. D = 256 (dK and dV
  // 128, S and dP 32, dQ 64) needs the 232 too once both consumers stage dQ in turns (they
  // spilled at 224), and its TMA thread fits 40 when it steps the head and query block instead of
  // dividing the block index (24 B at 40 otherwise).
  static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
  static constexpr int kProducerRegs = kHeadDim == 64 ? 56 : 40;
  static constexpr int kConsumerRegs = kHeadDim == 64 ? 224 : 232;
  static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumerThreads,
                "the consumers' registers must come from the producer's");

  using Mmas = BwdMmas<Element, kHeadDim, kBlockM, kBlockN>;  // (bwd_mmas_sm90.h)
  // dK and dV split along the head dim: every consumer's dV product reads all of P (two
  // buffers, as dS); else each reads its own keys' half of the one buffer.
  static constexpr int kPBuffers = Mmas::kSplitDkvD ? 2 : 1;
  using TiledMmaSdP = typename Mmas::TiledMmaSdP;
  using TiledMmadKV = typename Mmas::TiledMmadKV;
  // D = 64: one warpgroup's product over all the key block's keys.
  using TiledMmadQ = std::conditional_t<
      kDqOneConsumer,
      typename Mmas::template SsMma<kBlockM, kHeadDim, kBlockN, cute::GMMA::Major::K, cute::GMMA::Major::MN,
                                    typename Mmas::OneWarpgroup>,
      typename Mmas::TiledMmadQ>;

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using Stage = cute::Int<kStages>;
  // Q / dO: (rows, D, stage), and their transposes (D, rows, stage) for dK / dV's B operand.
  template <int kS>
  using SmemLayoutRows = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kS>>{}));
  template <int kS>
  using SmemLayoutRowsT = decltype(cute::composition(
      SmemLayoutRows<kS>{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kS>>{},
                                              cute::Stride<cute::Int<kBlockM>, cute::_1, cute::Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutQ = SmemLayoutRows<kStages>;
  using SmemLayoutQt = SmemLayoutRowsT<kStages>;
  using SmemLayoutDo = SmemLayoutRows<kStagesDo>;
  using SmemLayoutDot = SmemLayoutRowsT<kStagesDo>;
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  // P (one buffer: read only by its own consumer's dV product; D = 256: two, as dS) and dS
  // (two: a dQ product of query block t reads the other consumer's half too, and may still read
  // it while block t + 1 is written).
  using SmemLayoutP = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPt = decltype(cute::composition(
      SmemLayoutP{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  static constexpr int kPElems = kBlockM * kBlockN;
  // The bias tile (kFullBias; one buffer: the shared memory holds no second) in P's layout.
  static constexpr int kBiasElems = kFullBias ? kPElems : 8;
  static constexpr int kBiasBytes = kPElems * int(sizeof(Element));

  // dQ's fp32 tile: 128-byte-swizzled (64, 32) boxes, the TMA reduce-add's unit; consumer w
  // writes the 64 columns [64 w, 64 w + 64) of a (64, 128) tile, boxes 2 w and 2 w + 1, which
  // the writer adds to dQ's columns [64 w, 64 w + 64) (D = 128) or [0, 64) (D = 64, the blocks
  // of consumer w's parity).
  using SmemAtomF32 = cute::GMMA::Layout_K_SW128_Atom<float>;
  static constexpr int kDqBoxCols = 32;
  static constexpr int kDqCols = 64 * kConsumers;
  static constexpr int kDqBoxes = kDqCols / kDqBoxCols;
  static constexpr int kDqHeadBoxes = kHeadDim / kDqBoxCols;  // boxes of one dQ row
  using SmemLayoutdQ = decltype(cute::tile_to_shape(SmemAtomF32{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kDqCols>>{}));
  using SmemLayoutdQBoxes = decltype(cute::tile_to_shape(
      SmemAtomF32{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kDqBoxCols>, cute::Int<kDqBoxes>>{}));
  // Head dim 256: a (64, 256) view over the buffer. Its atoms run down the rows first, so its
  // columns [0, 128) are the buffer's 32 KiB (box b its columns [32 b, 32 b + 32)): consumer 0's
  // partition of it, which both consumers store through in their turns.
  using SmemLayoutdQWide = decltype(cute::tile_to_shape(SmemAtomF32{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));

  // Global tensors as (rows, cols, heads, batch) (tma_views.h).
  using GmemLayout = cute::Layout<cute::Shape<int, int, int, int>, cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using GmemTensorF32 = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<float*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutQ{})));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{}));
  using TmadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensorF32{},
                                             cute::take<0, 2>(SmemLayoutdQBoxes{})));
  // The bias tile's load and dbias's store (of a dS buffer).
  using GmemTensorOut = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}));
  using TmaBias = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutP{}));
  using TmadBias = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutP{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineDo = cutlass::PipelineTmaAsync<kStagesDo>;
  using RowPipeline = cutlass::PipelineAsync<kStages>;
  using BiasPipeline = cutlass::PipelineTmaAsync<1>;
  // What the loader warp writes per query block: the rows' statistics and, with key rows, the
  // key block's per-key operands (field names as load_key_rows expects them).
  struct KeyRows {
    int32_t pos[kBlockN];  // position (-1: a padding row past the keys)
    int32_t end[kBlockN];  // queries i < end may see the key (INT_MAX: no bound; 0: none)
    float bias[kBlockN];
    alignas(16) float delta[kGate ? kBlockN : 1];  // the gate's delta rows
    alignas(16) int32_t end_min;  // the smallest of end[] (16-byte aligned: the next stage's rows are read as float2)
  };
  static constexpr int kKeyRowEndDelta = kBlockN;  // end[] behind pos[] (PositionTest::end_delta)
  struct NoKeyRows {};
  struct RowStage {
    float m[kBlockM];      // lse (or the exact path's m); rows past the sequence unwritten
    float log2l[kBlockM];  // exact path only
    float delta[kBlockM];
    float alpha[kGate ? kBlockM : 1];  // the gate's alpha rows (0 past the sequence)
    int32_t seq_len[2];  // packed batches: the sequence's query and key counts
    int32_t window_on;  // windows with sinks: the window hides part of the tile (the test)
    int32_t gate_skip;  // gate skipping: the tile's cell is skipped (its pairs count as masked)
    std::conditional_t<kKeyRows, KeyRows, NoKeyRows> keys;
  };
  // kColSum: the column sums as one more product (bwd_mmas_sm90.h), one per consumer.
  using TiledMmaColSum = typename Mmas::TiledMmaColSum;
  using SmemLayoutOnes = typename Mmas::SmemLayoutOnes;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutDo>, 1024> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    alignas(1024) cute::array_aligned<Element, kPBuffers * kPElems, 1024> p;
    alignas(1024) cute::array_aligned<Element, kDsBuffers * kPElems, 1024> ds;
    alignas(1024) cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>, 1024> dq;
    // (unused buffers below: a few bytes, without the swizzle's alignment)
    alignas(kFullBias ? 1024 : 16) cute::array_aligned<Element, kBiasElems, kFullBias ? 1024 : 16> bias;
    RowStage rows[kStages];
    // dbias's column sums: row 0 the product's, rows 0-3 an fp32 bias's (one a warp of a
    // consumer, the consumers' key halves side by side), summed by the flush.
    cute::array_aligned<float, kColSum ? kColSumRows * kBlockN : 4, 16> colsum;
    // The gate's column sums of G alpha: one row per warp of a consumer (its 16 query rows),
    // the consumers' key halves side by side (gate_grads_sm90).
    cute::array_aligned<float, kGate ? 4 * kBlockN : 4, 16> gate_col;
    // The key block's delta rows (the gate on plain scores; 0 past the keys).
    cute::array_aligned<float, kGate && !kKeyRows ? kBlockN : 4, 16> gate_delta;
    // The gate's terms of a query block (kGateTerms), and their one-slot pipeline.
    alignas(16) cute::array_aligned<uint8_t, kGateTerms ? GateTerms::kBytes : 16, 16> gate_terms;
    typename GateTerms::Pipeline::SharedStorage pipe_gate_terms;
    alignas(kColSum ? 1024 : 16)
        cute::array_aligned<Element, kColSum ? cute::cosize_v<SmemLayoutOnes> : 8, kColSum ? 1024 : 16> ones;
    cute::array_aligned<int32_t, kKeyRows ? kBlockN : 4, 16> pos;  // the CTA's positions (query range)
    int32_t end_max[kNThreads / 32];  // key_block_end_max's per-warp maxima
    // The CTA's query-block walk, read by the consumers where they need it (kWalkInSmem).
    int32_t walk_m_lo, walk_m_hi, walk_n_m, walk_n_iter, walk_cols_valid;
    int32_t cta_b, cta_kvh;  // the CTA's batch and kv head (read by the consumers after their loop)
    BlockWalk m_walk;  // the query blocks' walk (windows with sinks; else the identity)
    SinkWindowTest window;  // windows with sinks: the KV head's element test
    ClearQueryBlocks window_clear;  // and the query blocks that need it not
    typename Pipeline::SharedStorage pipe_q;
    typename PipelineDo::SharedStorage pipe_do;
    typename RowPipeline::SharedStorage pipe_rows;
    typename BiasPipeline::SharedStorage pipe_bias;
    alignas(8) cutlass::arch::ClusterTransactionBarrier::ValueType kv_full;
    // Head dim 256: consumer w's turn on the dQ staging buffer (the other consumer's 128 arrivals
    // after its store, and the writer's one after its TMA has read that store).
    alignas(8) cutlass::arch::ClusterBarrier::ValueType dq_turn[kConsumers];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);
  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
};

}  // namespace dmattn::cuda::sm90
