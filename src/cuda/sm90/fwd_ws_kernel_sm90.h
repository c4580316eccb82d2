// The warp-specialized Hopper forward (sm_90a), FlashAttention-3's structure: persistent CTAs,
// one an SM, each taking tiles (query block, head, batch) in rounds (launch_fwd_ws; key ends: one
// tile a CTA), with
//   - a producer warpgroup (registers given back with setmaxnreg) whose warp 0 is the scheduler:
//     all its lanes find a tile's key blocks, lane 0 hands the tile to the other roles through a
//     two-slot PipelineAsync (the next tile is known while this one runs) and issues every load
//     by TMA: Q (its own transaction barrier, once the consumers are done with the previous
//     tile's Q buffer, which stages their output), then K[n] and V[n] for each key block, from
//     the last to the first, through two kStages-deep PipelineTmaAsync pipelines (K[n - 1] is
//     issued before V[n], so that the next S product never waits behind a V load). The
//     pipelines run on across tiles: the next tile's loads overlap this one's last products and
//     its epilogue;
//   - kConsumers consumer warpgroups of 64 query rows each (registers raised), which run
//     S = Q K^T and O += P V on wgmma and the online softmax:
//       first block:  S = Q K[n]^T; softmax; P
//       block n:      issue S = Q K[n]^T, issue O += P V[n + 1]; wait S; release K[n];
//                     softmax of S (the rescale of O deferred); wait O; release V[n + 1];
//                     rescale O; P = S
//       last:         O += P V[n_min]
//     (intra-warpgroup overlap: the softmax of block n runs while P V of block n + 1 does).
//     Across warpgroups, named barriers hand the tensor cores round-robin from one consumer's
//     GEMM pair to the next (pingpong: one warpgroup's softmax overlaps another's GEMMs).
// Scores: the scale folded into the softmax's exponent, the window /
// causal / tail test only on the key blocks that need it (mask.h). With a bias (Tile::kBias),
// its tile of block n is loaded with K[n] and s = scale * qk + bias before the test, the softmax
// then on final scores (scale 1; the safe subtraction, under which a finfo.min bias stays
// finite, only in warps with a row max beyond OnlineSoftmax::kFmaMaxAbs; O's rescale skipped
// when no row's max moved). A 16-bit tile reaches the accumulators by ldmatrix, an fp32 one by
// 8-byte shared loads. With a full mask (Tile::kMask), its byte tile of block n comes the same
// way through a pipeline of its own, a false element makes the score -inf before the test
// (mask_tile_sm90.h; after the bias where both come), and the softmax is the plain one on raw
// scores, the biased one beside a bias. (Both tile streams at head dim 256 have one stage each,
// Tile::kOperandStages: block n's tiles then follow V[n + 1].) Rows past
// the sequence and columns past head_dim or the keys arrive as zeros (TMA's out-of-bounds fill:
// a mask of false there).
// With per-key rows (Tile::kKeyRows: gathered keys, key ends, a query-broadcast bias or mask,
// softcap; beside a full bias's tiles, gathered keys, a query-broadcast mask and softcap; beside
// a full mask's tiles, gathered keys, a query-broadcast bias and softcap, the mask then applied
// to the final scores; with indexed keys, warps 2 and 3 gather K and V by cp.async while warp 0
// issues Q and the bias / mask tiles), warp 1
// of the producer warpgroup loads block n's positions, query bounds and bias (load_key_rows)
// into a stage of their own pipeline (the gate's variant, Tile::kGate: also block n's delta rows
// and the tile's alpha rows, gate_sm90.h); s = scale * qk + bias (softcap: softcap * tanh(scale * qk
// / softcap) + bias; then + scale * g(alpha delta)), then on the blocks that need it (the loader
// marks them in the stage)
// the test on positions and bounds (score_mask.h), the softmax on final scores. With gate
// skipping (Tile::kGateSkip) every role walks the tile's kept key blocks alone, which the
// scheduler warp lists in the tile's slot (gate_skip_walk): a skipped cell's block is neither
// loaded nor computed, and the consumers' loop is the exact kernel's. Gathered keys
// take the key-block range of their positions (KeyPositionRow): blocks of padding rows only,
// or of positions no query of the block sees, are never loaded.
// Epilogue: each consumer writes its 64 output rows through its own rows of the Q buffer
// (fwd_epilogue's saturating conversion) and the lse of its rows, then releases the buffer to
// the next tile's Q.
// Registers: both roles are at their budgets, so values that live across tiles are kept out of
// them where they would be held through the key loop (counters in shared memory or recomputed,
// thread indices made opaque per phase); ptxas reports no spills.
// Compiled for every target, with a body only for sm_90a.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <climits>

#include "cuda/common/copy.h"
#include "cuda/common/fwd_args.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/mask.h"
#include "cuda/common/score_mask.h"
#include "cuda/common/seq_bounds.h"
#include "cuda/common/softmax.h"
#include "cuda/sm90/bias_tile_sm90.h"
#include "cuda/sm90/fwd_ws_tile_sm90.h"
#include "cuda/sm90/gate_sm90.h"
#include "cuda/sm90/gate_terms_sm90.h"
#include "cuda/sm90/gmma.h"
#include "cuda/sm90/key_rows_sm90.h"
#include "cuda/sm90/mask_tile_sm90.h"
#include "cuda/sm90/pack_gqa_sm90.h"
#include "cuda/sm90/pipeline_params_sm90.h"
#include "cuda/sm90/tma_views.h"
#include "cuda/sm80/fwd_kernel.h"

namespace dmattn::cuda::sm90 {

// The work of a launch (fwd_ws_tile_coords): query blocks of a sequence, (head, batch) pairs,
// the heads of a batch (KV heads where the query heads are packed), whether a unit of work
// pairs two tiles, and the number of units.
struct FwdWsTiles {
  int num_m_blocks, num_hb, heads;
  bool paired;
  int units;
};

template <class Tile>
struct FwdWsParams {
  FwdArgs a;
  typename Tile::TmaQ tma_q;
  typename Tile::TmaKV tma_k, tma_v;
  typename Tile::TmaBias tma_bias;  // (Tile::kBias only)
  typename Tile::TmaMask tma_mask;  // (Tile::kMask only)
  // The operands' head / batch extents as their TMA views have them (1: broadcast), and the
  // rows of q and k (packed: all rows, batch 1).
  TmaExtents q_ext, kv_ext, bias_ext, mask_ext;  // (k and v: alike, fwd_ws_supports)
  int rows_q, rows_k;
  FwdWsTiles schedule;              // the launch's tiles (fwd_ws_tile_coords)
};

// Named barriers of the consumers (ids after CUTLASS's reserved ones): kSchedBarrier + w is
// consumer w's turn on the tensor cores; kEpilogueBarrier + w orders its output staging.
// A turn is passed between two warpgroups: 256 threads per scheduling barrier.
constexpr int kSchedBarrier = 0;
constexpr int kSchedThreads = 256;
constexpr int kEpilogueBarrier = 4;
constexpr int kTailBarrier = 7;  // all consumers: packed batches' V tail (clear_v_tail)

// The gather warps' loads of one tile (indexed keys): warp 2 copies K[n] and warp 3 V[n] (`pipe`,
// `stages`, the rows of `base` from `off` on) of every key block, from the last to the first,
// each stage by cp.async from the rows that the block's indices name, completed on the stage's
// full barrier (cpasync_barrier_arrive_noinc: 32 arrivals). The next block's indices are loaded
// while this one's copies are issued (one block ahead: the copies never wait for an index
// load). One pipeline a warp keeps the producer within 40 registers.
template <class Tile, class Pipeline, class State>
__device__ __forceinline__ void gather_kv_blocks(const FwdArgs& a, int b, int h, int count, int n_min, int n_max,
                                                 Pipeline& pipe, State write, const typename Tile::Element* stages,
                                                 const void* base, int64_t off, int64_t row_stride) {
  using namespace cute;
  using Element = typename Tile::Element;
  using Indices = GatherRowIndices<Tile::kBlockN, 1>;
  constexpr int kBlockN = Tile::kBlockN;
  const int lane = threadIdx.x % 32;
  const int32_t* rows = rows_row(a.kpos, b, h);
  static_assert(is_sw128_layout<typename Tile::SmemLayoutKV, kBlockN, Tile::kHeadDim>(),
                "the gather's addresses follow the K / V tiles' layout");
  const uint32_t s_stages = cute::cast_smem_ptr_to_uint(stages);
  const Element* src = static_cast<const Element*>(base) + off;
  Indices ix, ix_next;
  ix.load(rows + (n_max - 1) * kBlockN, count - (n_max - 1) * kBlockN, 0, lane);
  for (int n = n_max - 1; n >= n_min; --n) {
    if (n > n_min) ix_next.load(rows + (n - 1) * kBlockN, count - (n - 1) * kBlockN, 0, lane);
    pipe.producer_acquire(write);
    gather_rows_sw128<kBlockN, Tile::kHeadDim, 1>(s_stages + write.index() * Tile::kKVStageBytes, src, row_stride, ix,
                                                  a.kpos.rows_source_len, a.head_dim, 0, lane);
    pipe.producer_commit(write, cutlass::arch::cpasync_barrier_arrive_noinc);
    ++write;
    ix = ix_next;
  }
}

// Tile `half` (0 or 1) of unit u of a launch; false where the unit has no such tile. (Head,
// batch) pairs go heads fastest (the query heads of one KV head together), then batches; the
// units of a pair are its query blocks from the last to the first (the longest causal rows
// first), or, paired, query blocks nm - 1 - i and i together: under a causal sweep every pair
// of tiles reads about as many key blocks, so that units handed out in fixed rounds balance.
__device__ __forceinline__ bool fwd_ws_tile_coords(int u, int half, const FwdWsTiles& w, int& m_block, int& h,
                                                   int& b) {
  const int per_hb = w.paired ? (w.num_m_blocks + 1) / 2 : w.num_m_blocks;
  const int hb = u / per_hb, i = u - hb * per_hb;
  m_block = w.num_m_blocks - 1 - i;
  if (half == 1) {
    if (!w.paired || i == m_block) return false;
    m_block = i;
  }
  h = hb % w.heads;
  b = hb / w.heads;
  return true;
}

// The key blocks a tile of queries [q_first, q_first + q_count) reads (warp-cooperative: every
// lane of the warp calls it, every warp finds the same range): those of its gathered keys'
// range, else of its window, narrowed to the first and last true key of a query-broadcast mask;
// in the variant of windows with sinks the runs of its sinks and bands, as virtual blocks
// [n_min, n_max) of windows.walk, with the head's element test and the blocks that need it not.
template <class Tile>
__device__ __forceinline__ void fwd_ws_key_range(const FwdArgs& a, const SeqBounds& seq, int b, int h, int q_first,
                                                 int q_count, int& n_min, int& n_max, FwdWsTileWindows& windows) {
  if constexpr (Tile::kWindows) {  // (the variant of windows with sinks alone: fwd_ws_scores)
    const SinkWindow w = SinkWindow::of(a, h, seq.len_q(), seq.len_k());
    windows.walk = w.key_blocks(q_first, q_count, Tile::kBlockN, n_min, n_max);
    windows.window = SinkWindowTest::of(w);
    windows.clear = w.clear_key_blocks(q_first, q_count, Tile::kBlockN);
    return;
  }
  if (Tile::kKeyRows && a.kpos.ptr != nullptr) {
    KeyPositionRow(a, b, h).key_block_range(q_first, q_count, Tile::kBlockN, n_min, n_max);
    return;
  }
  seq.window().key_block_range(q_first, q_count, Tile::kBlockN, n_min, n_max);
  if (Tile::kKeyRows && !Tile::kMask && a.mask.ptr != nullptr) {  // (a query-broadcast mask: fwd_ws_supports)
    const KeyRowSources src = key_row_sources(a, b, h, seq.k0());
    key_mask_block_range<Tile::kBlockN>(src.mask, src.mask_step, seq.len_k(), n_min, n_max);
  }
}

// The next tile from the scheduler's slots, for a role that took `taken` tiles before (every
// thread of the role calls it). The slot is released at once, unless kHold: a role that reads
// more of the slot later (gate skipping's walk) releases it itself once done with it
// (release_fwd_ws_tile); the end marker's slot is released here either way.
template <int kSlots, bool kHold = false, class Pipeline>
__device__ __forceinline__ FwdWsTileInfo next_fwd_ws_tile(Pipeline& pipe, uint32_t& taken, const FwdWsTileInfo* slots) {
  const auto read = pipeline_state_at<kSlots>(taken++, false);
  pipe.consumer_wait(read);
  asm volatile("" ::: "memory");  // (the slot is read after the wait)
  const FwdWsTileInfo tile = slots[read.index()];
  if (!kHold || tile.m_block < 0) pipe.consumer_release(read);
  return tile;
}

// The slot of the last tile taken, released by a role that held it (next_fwd_ws_tile's kHold).
template <int kSlots, class Pipeline>
__device__ __forceinline__ void release_fwd_ws_tile(Pipeline& pipe, uint32_t taken) {
  asm volatile("" ::: "memory");  // (after the role's last read of the slot)
  pipe.consumer_release(pipeline_state_at<kSlots>(taken - 1, false));
}

// Key block nb of the tile in slot `slot`: the walk the scheduler wrote there (windows with
// sinks, gate skipping), else nb itself. Read from shared memory at each use (volatile), so that
// no role holds the walk in registers.
template <class Tile, class Storage>
__device__ __forceinline__ int walk_key_block(Storage& ss, int slot, int nb) {
  if constexpr (Tile::kWindows)
    return const_cast<const volatile BlockWalk&>(ss.tile_windows[slot].walk).at(nb);
  else if constexpr (Tile::kGateSkip)
    return int(const_cast<const volatile int16_t*>(ss.skip_walk[slot])[nb]);
  else
    return nb;
}

// Gate skipping: the kept key blocks of [n_min, n_max) in a query block's keep row, ascending,
// into walk (every lane of the warp calls it); returns their count.
__device__ __forceinline__ int gate_skip_walk(const uint8_t* keep_row, int n_min, int n_max, int16_t* walk) {
  const int lane = int(threadIdx.x) & 31;
  int count = 0;
  for (int base = n_min; base < n_max; base += 32) {
    const int nb = base + lane;
    const bool keep = nb < n_max && gate_keeps(keep_row, nb);
    const uint32_t vote = __ballot_sync(0xffffffffu, keep);
    if (keep) walk[count + __popc(vote & ((1u << lane) - 1u))] = int16_t(nb);
    count += __popc(vote);
  }
  return count;
}

template <class Tile>
__global__ void __launch_bounds__(Tile::kNThreads, 1) fwd_ws_kernel_sm90(const __grid_constant__ FwdWsParams<Tile> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Tile::Element;
  using Pipeline = typename Tile::Pipeline;
  using PipelineState = typename cutlass::PipelineState<Tile::kStages>;
  using TilePipeline = typename Tile::TilePipeline;
  using TileState = typename cutlass::PipelineState<Tile::kTileSlots>;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kConsumers = Tile::kConsumers, kConsumerThreads = Tile::kConsumerThreads;
  const FwdArgs& a = p.a;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Tile::SharedStorage*>(smem_raw);
  const int warp_group = threadIdx.x / 128;
  const bool packed = a.cu_seqlens_q != nullptr;
  // (the gate's term warps, 2 and 3, gather no keys: indexed keys come as a copy, fwd_ws_supports)
  const bool indexed = Tile::kKeyRows && !Tile::kGateTerms && a.kpos.rows != nullptr;

  // Key ends (the per-query path; one tile per CTA, launch_fwd_ws): the rows before the first one
  // that a query of the tile may still keep (end > m0) are masked for all of them; the key
  // blocks they fill are skipped. Every thread reads its share of the ends (the order of the
  // rows is not assumed); warp minima meet in shared memory at the barrier below.
  const bool skip_dead = Tile::kKeyRows && a.kpos.ends != nullptr;
  if (skip_dead) {
    int m_block, h, b, n_min, n_max;
    FwdWsTileWindows windows;
    fwd_ws_tile_coords(blockIdx.x, 0, p.schedule, m_block, h, b);  // (unpaired: one tile a unit)
    const SeqBounds seq(a, b);
    const int m0 = m_block * kBlockM;
    if (m0 < seq.len_q()) {
      fwd_ws_key_range<Tile>(a, seq, b, h, m0, kBlockM, n_min, n_max, windows);  // (no windows here)
      const int32_t* ends = ends_row(a.kpos, b, h);
      const int lo = n_min * kBlockN, hi = min(a.seqlen_k, n_max * kBlockN);
      int first = hi;
#pragma unroll 4
      for (int j = lo + int(threadIdx.x); j < hi; j += Tile::kNThreads)
        if (__ldg(ends + j) > m0) first = min(first, j);
      first = __reduce_min_sync(0xffffffffu, first);
      if (threadIdx.x % 32 == 0) ss.first_alive[threadIdx.x / 32] = first;
    }
  }

  // Barriers: initialized by warp 0, visible to all before the roles split. Indexed keys: the
  // K and V stages are filled by the gather warps' cp.async (one warp a pipeline: 32 arrivals).
  const auto kv_params = indexed ? cp_async_pipeline_params<Pipeline>(warp_group == 0, kConsumerThreads, 32)
                                 : tma_pipeline_params<Pipeline>(Tile::kKVStageBytes, warp_group == 0, kConsumerThreads);
  Pipeline pipe_k(ss.pipe_k, kv_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(ss.pipe_v, kv_params, Shape<_1, _1, _1>{});
  // The bias tiles and the mask tiles (their pipelines advance with K's, one block each, over
  // Tile::kOperandStages stages).
  using OperandPipeline = typename Tile::OperandPipeline;
  OperandPipeline pipe_bias(ss.pipe_bias,
                            tma_pipeline_params<OperandPipeline>(Tile::kBiasStageBytes, warp_group == 0, kConsumerThreads),
                            Shape<_1, _1, _1>{});
  OperandPipeline pipe_mask(ss.pipe_mask,
                            tma_pipeline_params<OperandPipeline>(Tile::kMaskStageBytes, warp_group == 0, kConsumerThreads),
                            Shape<_1, _1, _1>{});
  using KeyRowPipeline = typename Tile::KeyRowPipeline;
  // (the gate's term warps read the key rows' stages too: alpha and delta)
  using GateTerms = typename Tile::GateTerms;
  KeyRowPipeline pipe_key_rows(
      ss.pipe_key_rows, loader_pipeline_params<KeyRowPipeline>(
                            warp_group == 0, kConsumerThreads + (Tile::kGateTerms ? GateTerms::kProducerThreads : 0)));
  // (its barriers initialized only where the term warps run)
  auto pipe_gate_terms = [&]() {
    if constexpr (Tile::kGateTerms)
      return typename GateTerms::Pipeline(ss.pipe_gate_terms, GateTerms::params(warp_group == 0));
    else
      return 0;
  }();
  // The tiles' readers: the consumers, the key rows' or packed Q's loader and the gather warps or
  // the gate's term warps.
  typename TilePipeline::Params tile_params;
  tile_params.dst_blockid = 0;  // (no cluster: a constant, not a register held by every role)
  // (gate skipping: every lane of the scheduler warp writes the tile's walk, so every lane waits
  // for the slot and arrives once its own writes are done)
  tile_params.producer_arv_count = Tile::kGateSkip ? 32 : 1;
  tile_params.consumer_arv_count = kConsumerThreads + (Tile::kKeyRows || Tile::kPackGqa ? 32 : 0) + (indexed || Tile::kGateTerms ? 64 : 0);
  TilePipeline pipe_tile(ss.pipe_tile, tile_params);
  auto& q_full = *reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&ss.q_full);
  auto& q_empty = *reinterpret_cast<cutlass::arch::ClusterBarrier*>(&ss.q_empty);
  if (threadIdx.x == 0) {
    q_full.init(1);
    q_empty.init(kConsumerThreads);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tile::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tile::SmemLayoutKV{});

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Tile::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if constexpr (Tile::kKeyRows) {
      if (warp == 1) {  // the key rows' loader, in the consumers' block order
        uint32_t taken = 0;
        // (gate skipping: the tile's kept blocks from its slot, held until the last is read, so
        // that the scheduler writes the slot's next walk after this warp's reads, not only
        // after the consumers' release that follows them)
        for (FwdWsTileInfo tile;
             (tile = next_fwd_ws_tile<Tile::kTileSlots, Tile::kGateSkip>(pipe_tile, taken, ss.tiles)).m_block >= 0;) {
          PipelineState write_r = pipeline_state_at<Tile::kStages>(tile.blocks_before, true);
          const SeqBounds seq(a, tile.b);
          KeyRowSources src = key_row_sources(a, tile.b, tile.h, seq.k0());
          if constexpr (Tile::kMask) src.mask = nullptr;  // (a full mask comes by its tiles)
          const int count = seq.len_k();
          // Whether a block's scores need the test on positions and bounds is decided here, not
          // on the consumers' path between their products (QueryBlockWindow, key_positions.h).
          // The tile's window, once (volatile shared values: not held in the loader's registers
          // through the loop):
          volatile QueryBlockWindow& win = ss.key_rows_window;
          const bool first_lane = (threadIdx.x & 31) == 0;
          if (first_lane) {
            const WindowMask pwin = a.kpos.ptr != nullptr ? position_window(a) : seq.window();
            const QueryBlockWindow w = QueryBlockWindow::of(pwin, tile.m_block * kBlockM, kBlockM);
            win.lo = w.lo;
            win.hi = w.hi;
            win.m_end = w.m_end;
          }
          for (int v = tile.n_max - 1; v >= tile.n_min; --v) {
            const int n = walk_key_block<Tile>(ss, (taken - 1) % Tile::kTileSlots, v);  // (the key block)
            pipe_key_rows.producer_acquire(write_r);
            auto& st = ss.key_rows[write_r.index()];
            if constexpr (!Tile::kGateOnly) load_key_rows<Element, typename Tile::KeyRowStage, kBlockN>(st, n, count, src);
            // The gate's rows: the block's delta, the tile's alpha (their sources derived afresh
            // in each block from opaque coordinates: hoisted out of the loop and held through it,
            // they made the loader spill).
            if constexpr (Tile::kGate) {
              const int gb = opaque_int(tile.b), gh = opaque_int(tile.h), m0 = opaque_int(tile.m_block) * kBlockM;
              const SeqBounds gseq(a, gb);
              load_gate_rows<Element, kBlockN>(st.delta, gate_delta_source(a, gb, gh, gseq.k0()), n * kBlockN,
                                               count - n * kBlockN);
              load_gate_rows<Element, kBlockM>(st.alpha, gate_alpha_source(a, gb, gh, gseq.q0()), m0,
                                               gseq.len_q() - m0);
            }
            // The block's part (the first lane: it wrote end_min, and the other lanes' rows are
            // visible after load_key_rows's __syncwarp; positions sorted).
            if constexpr (!Tile::kGateOnly)
              if (first_lane) st.needs_test = win.block_needs_test(st.pos[0], st.pos[kBlockN - 1], st.end_min);
            pipe_key_rows.producer_commit(write_r);
            ++write_r;
          }
          if constexpr (Tile::kGateSkip) release_fwd_ws_tile<Tile::kTileSlots>(pipe_tile, taken);
        }
        return;
      }
      if constexpr (Tile::kGateTerms) {
        if (warp >= 2) {  // the gate's terms of each block, for each consumer (gate_terms_sm90.h)
          typename Tile::TiledMmaS mma_s;
          const Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
          const int p = int(threadIdx.x) - 64;
          const GateTermPairPoly poly = GateTermPairPoly::of(-a.scale * GateMath::kLn2 * GateMath::of(a.gate.linear).k);
          uint32_t taken = 0;
          for (FwdWsTileInfo tile; (tile = next_fwd_ws_tile<Tile::kTileSlots>(pipe_tile, taken, ss.tiles)).m_block >= 0;) {
            PipelineState read_r = pipeline_state_at<Tile::kStages>(tile.blocks_before, false);
            for (int n = tile.n_max - 1; n >= tile.n_min; --n) {
              pipe_key_rows.consumer_wait(read_r);
              const auto& st = ss.key_rows[read_r.index()];
              CUTE_UNROLL
              for (int c = 0; c < kConsumers; ++c) {
                const auto write = GateTerms::state(read_r.count(), c, true);
                pipe_gate_terms.producer_acquire(write);
                fill_gate_terms(ss.gate_terms.data() + write.index() * GateTerms::kSlotBytes, mma_s, cS, c, p,
                                st.alpha, st.delta, poly);
                pipe_gate_terms.producer_commit(write);
              }
              pipe_key_rows.consumer_release(read_r);
              ++read_r;
            }
          }
          return;
        }
      }
      if (indexed && warp >= 2) {  // K (warp 2) and V (warp 3) rows, by cp.async
        // (one call per pipeline: a pipeline chosen at run time would live in local memory)
        auto gather_tiles = [&](Pipeline& pipe, const Element* stages, const void* base, int64_t bs, int64_t hs,
                                int64_t rs) {
          uint32_t taken = 0;
          for (FwdWsTileInfo tile; (tile = next_fwd_ws_tile<Tile::kTileSlots>(pipe_tile, taken, ss.tiles)).m_block >= 0;) {
            if (tile.n_max <= tile.n_min) continue;
            const int64_t off = int64_t(tile.b / a.kpos.rows_batch_div) * bs + int64_t(tile.h / a.group) * hs;
            gather_kv_blocks<Tile>(a, tile.b, tile.h, SeqBounds(a, tile.b).len_k(), tile.n_min, tile.n_max, pipe,
                                   pipeline_state_at<Tile::kStages>(tile.blocks_before, true), stages, base, off, rs);
          }
        };
        if (warp == 3) gather_tiles(pipe_v, ss.v.data(), a.v, a.v_bs, a.v_hs, a.v_rs);
        else gather_tiles(pipe_k, ss.k.data(), a.k, a.k_bs, a.k_hs, a.k_rs);
        asm volatile("cp.async.wait_all;\n" ::);  // (no copy outlives its thread)
        return;
      }
    }
    if constexpr (Tile::kPackGqa) {
      if (warp == 1) {  // Q of each tile, its rows from the group's heads (pack_gqa_sm90.h), by cp.async
        uint32_t taken = 0;
        for (FwdWsTileInfo tile; (tile = next_fwd_ws_tile<Tile::kTileSlots>(pipe_tile, taken, ss.tiles)).m_block >= 0;) {
          // (the previous tile's output staged in the buffer has been stored)
          if (taken > 1) q_empty.wait((taken - 2) & 1);
          const SeqBounds seq(a, tile.b);
          const Element* q_group = static_cast<const Element*>(a.q) + int64_t(tile.b) * a.q_bs +
                                   int64_t(seq.q0()) * a.q_rs + int64_t(tile.h) * a.group * a.q_hs;
          const int lane = threadIdx.x % 32;
          load_packed_q_sw128<kBlockM, kHeadDim>(cute::cast_smem_ptr_to_uint(ss.q.data()), q_group, a.q_rs, a.q_hs,
                                                 tile.m_block * kBlockM, a.group, seq.len_q(), a.head_dim, lane);
          // Landed, then visible to wgmma (the async proxy) before the barrier publishes it.
          asm volatile("cp.async.wait_all;\n" ::: "memory");
          cutlass::arch::fence_view_async_shared();
          __syncwarp();
          if (lane == 0) q_full.arrive();
        }
        return;
      }
    }
    if (warp != 0) return;
    // (read afresh at each use: the lane index is not held in a register across tiles)
    auto first_lane = []() {
      unsigned l;
      asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
      return l == 0;
    };
    // The scheduler warp: finds each tile's key blocks (all lanes), hands the tile to the other
    // roles and issues its TMA loads (lane 0).
    if (first_lane()) {  // (the descriptors' first use would otherwise fetch them on the critical path)
      cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
      if constexpr (Tile::kBias) cute::prefetch_tma_descriptor(p.tma_bias.get_tma_descriptor());
      if constexpr (Tile::kMask) cute::prefetch_tma_descriptor(p.tma_mask.get_tma_descriptor());
    }
    // Counters across tiles, kept by lane 0 in shared memory (the producer's registers are few):
    // the tiles handed over so far, and their key blocks (as many K, V and bias stages each).
    volatile uint32_t& tiles = ss.sched_tiles;
    volatile uint32_t& blocks = ss.sched_blocks;
    if (first_lane()) {
      tiles = 0;
      blocks = 0;
    }

    // The loads of one tile, the i-th of this CTA: K[n] and V[n] from the last key block to the
    // first (K[n - 1] before V[n]), the bias tile with each K, Q once the consumers are done with
    // the previous tile's (its buffer stages their output).
    auto load_tile = [&](const FwdWsTileInfo& tile, uint32_t i) {
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.rows_q, a.head_dim, p.q_ext.heads, p.q_ext.batch));
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.rows_k, a.head_dim, p.kv_ext.heads, p.kv_ext.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.rows_k, a.head_dim, p.kv_ext.heads, p.kv_ext.batch));
      Tensor mB = p.tma_bias.get_tma_tensor(make_shape(a.seqlen_q, a.seqlen_k, p.bias_ext.heads, p.bias_ext.batch));
      Tensor sBias = make_tensor(make_smem_ptr(reinterpret_cast<typename Tile::BiasElement*>(ss.bias_tiles.data())),
                                 typename Tile::SmemLayoutBias{});
      Tensor mM = p.tma_mask.get_tma_tensor(make_shape(a.seqlen_q, a.seqlen_k, p.mask_ext.heads, p.mask_ext.batch));
      Tensor sMask = make_tensor(make_smem_ptr(ss.mask_tiles.data()), typename Tile::SmemLayoutMask{});
      const SeqBounds seq(a, tile.b);
      // Block nb of the walk: from the tile's slot, which the consumers hold until these loads
      // are long issued.
      auto key_block = [&](int nb) { return walk_key_block<Tile>(ss, i % Tile::kTileSlots, nb); };
      // (packed heads: the tile's head is the KV head)
      const int h_kv = p.kv_ext.head_at(Tile::kPackGqa ? tile.h : tile.h / a.group), b_kv = p.kv_ext.batch_at(tile.b);
      Tensor gQ = local_tile(
          domain_offset(make_coord(seq.q0(), 0), mQ(_, _, p.q_ext.head_at(tile.h), p.q_ext.batch_at(tile.b))),
          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(tile.m_block, 0));
      // (tuples, not structured bindings: the lambdas below capture them, which C++17 does not allow)
      auto tQ = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto load_q = [&]() {
        if constexpr (!Tile::kPackGqa) {  // (packed heads: Q from its own loader warp)
          if (i > 0) q_empty.wait((i - 1) & 1);
          q_full.arrive_and_expect_tx(Tile::kQBytes);
          copy(p.tma_q.with(ss.q_full), get<0>(tQ), get<1>(tQ));
        }
      };
      // (indexed keys: K and V from the gather warps, the bias and mask tiles from here)
      if (tile.n_max <= tile.n_min || (indexed && !Tile::kBias && !Tile::kMask)) {
        load_q();
        return;
      }
      Tensor gK = local_tile(
          domain_offset(make_coord(seq.k0(), 0), mK(_, _, h_kv, b_kv)),
          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
      Tensor gV = local_tile(
          domain_offset(make_coord(seq.k0(), 0), mV(_, _, h_kv, b_kv)),
          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
      auto tK = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto tV = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      // The bias of this query block: (kBlockM, kBlockN, key blocks) of its (head, batch) slice.
      Tensor gB = local_tile(mB(_, _, p.bias_ext.head_at(tile.h / a.bias.head_div), p.bias_ext.batch_at(tile.b)),
                             Shape<Int<kBlockM>, Int<Tile::kBiasN>>{}, make_coord(tile.m_block, _));
      const auto tB = tma_partition(p.tma_bias, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBias), group_modes<0, 2>(gB));
      // The mask's likewise.
      Tensor gM = local_tile(mM(_, _, p.mask_ext.head_at(tile.h / a.mask.head_div), p.mask_ext.batch_at(tile.b)),
                             Shape<Int<Tile::kMaskM>, Int<Tile::kMaskN>>{}, make_coord(tile.m_block, _));
      const auto tM = tma_partition(p.tma_mask, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sMask), group_modes<0, 2>(gM));
      // With K[nb]. The bias streams from HBM (no other CTA reads it) and the two stages give it
      // one block of lead: the tile kBiasPrefetch blocks further is prefetched into L2 meanwhile.
      constexpr int kBiasPrefetch = 2;
      // The producer state of block nb's K, V and bias stages: the CTA's earlier tiles filled
      // blocks_before of each, this one fills them from n_max - 1 down (computed, not held in
      // registers).
      auto state_of = [&](int nb) {
        return pipeline_state_at<Tile::kStages>(tile.blocks_before + uint32_t(tile.n_max - 1 - nb), true);
      };
      auto load_k = [&](int nb) {
        if (indexed) return;
        const PipelineState write_k = state_of(nb);
        pipe_k.producer_acquire(write_k);
        copy(p.tma_k.with(*pipe_k.producer_get_barrier(write_k)), get<0>(tK)(_, key_block(nb)),
             get<1>(tK)(_, write_k.index()));
      };
      // Block nb's bias and mask tiles (their stages: as K's, over Tile::kOperandStages).
      auto load_operand_tiles = [&](int nb) {
        const auto write_b =
            pipeline_state_at<Tile::kOperandStages>(tile.blocks_before + uint32_t(tile.n_max - 1 - nb), true);
        if constexpr (Tile::kBias) {
          pipe_bias.producer_acquire(write_b);
          copy(p.tma_bias.with(*pipe_bias.producer_get_barrier(write_b)), get<0>(tB)(_, nb), get<1>(tB)(_, write_b.index()));
          if (nb - kBiasPrefetch >= tile.n_min) prefetch(p.tma_bias, get<0>(tB)(_, nb - kBiasPrefetch));
        }
        if constexpr (Tile::kMask) {
          pipe_mask.producer_acquire(write_b);
          copy(p.tma_mask.with(*pipe_mask.producer_get_barrier(write_b)), get<0>(tM)(_, nb), get<1>(tM)(_, write_b.index()));
          if (nb - kBiasPrefetch >= tile.n_min) prefetch(p.tma_mask, get<0>(tM)(_, nb - kBiasPrefetch));
        }
      };
      // With fewer operand stages than K's, block nb's tiles wait until the consumers are done
      // with those of nb + 1 (after their S product of it): V[nb + 1] goes first, so that its
      // P V product does not wait behind them.
      constexpr bool kOperandsAfterV = Tile::kOperandStages < Tile::kStages;
      int n = tile.n_max - 1;
      load_k(n);
      load_operand_tiles(n);
      load_q();
      for (; n >= tile.n_min; --n) {
        if (n > tile.n_min) {
          load_k(n - 1);
          if constexpr (!kOperandsAfterV) load_operand_tiles(n - 1);
        }
        if (!indexed) {
          const PipelineState write_v = state_of(n);
          pipe_v.producer_acquire(write_v);
          copy(p.tma_v.with(*pipe_v.producer_get_barrier(write_v)), get<0>(tV)(_, key_block(n)),
               get<1>(tV)(_, write_v.index()));
        }
        if constexpr (kOperandsAfterV) {
          if (n > tile.n_min) load_operand_tiles(n - 1);
        }
      }
    };

    // Units blockIdx.x, blockIdx.x + gridDim.x, ..., their tiles in turn: step q is tile q % 2
    // of the q / 2-th unit when paired, else its one tile of the q-th. The next step also
    // through shared memory (not held in a register through the tile's loads).
    volatile int& next_step = ss.sched_next;
    for (int q = 0;;) {
      const int half = p.schedule.paired ? q & 1 : 0;
      const int u = int(blockIdx.x) + (p.schedule.paired ? q >> 1 : q) * int(gridDim.x);
      FwdWsTileInfo tile{-1, 0, 0, 0, 0, 0};  // (past the last tile: the end)
      FwdWsTileWindows tile_windows{};
      bool skip = false;
      if (u < p.schedule.units) {
        int m_block, h, b, n_min, n_max;
        // (packed batches: past the end of a shorter sequence)
        skip = !fwd_ws_tile_coords(u, half, p.schedule, m_block, h, b) ||
               m_block * kBlockM >= tile_rows_of<Tile::kPackGqa>(SeqBounds(a, b).len_q(), a.group);
        if (!skip) {
          const SeqBounds seq(a, b);
          int q_first = m_block * kBlockM, q_count = kBlockM;
          if constexpr (Tile::kPackGqa) packed_query_span(m_block * kBlockM, kBlockM, a.group, q_first, q_count);
          fwd_ws_key_range<Tile>(a, seq, b, h, q_first, q_count, n_min, n_max, tile_windows);
          if (skip_dead && n_max > n_min) {
            int first = INT_MAX;
            for (int w = 0; w < Tile::kNThreads / 32; ++w) first = min(first, ss.first_alive[w]);
            n_min = min(n_max, max(n_min, first / kBlockN));
          }
          tile = FwdWsTileInfo{m_block, h, b, n_min, n_max, 0};
        }
      }
      // Gate skipping: the tile's kept key blocks into its slot (the whole warp, once the slot is
      // free), the tile then their virtual range [0, count).
      if constexpr (Tile::kGateSkip) {
        if (!skip) {
          __syncwarp();  // (lane 0's count of tiles, read by every lane)
          const TileState slot = pipeline_state_at<Tile::kTileSlots>(tiles, true);
          pipe_tile.producer_acquire(slot);
          if (tile.m_block >= 0) {
            const int count = gate_skip_walk(gate_keep_row(a.gate, tile.b, tile.h, tile.m_block * kBlockM),
                                             tile.n_min, tile.n_max, ss.skip_walk[slot.index()]);
            tile.n_min = 0;
            tile.n_max = count;
          }
          if (!first_lane()) pipe_tile.producer_commit(slot);  // (lane 0's, after the tile's info below)
          __syncwarp();
        }
      }
      if (first_lane()) {
        next_step = q + 1;
        if (!skip) {
          tile.blocks_before = blocks;
          const uint32_t i = tiles;
          const TileState slot = pipeline_state_at<Tile::kTileSlots>(i, true);
          if constexpr (!Tile::kGateSkip) pipe_tile.producer_acquire(slot);
          ss.tiles[slot.index()] = tile;
          if constexpr (Tile::kWindows) ss.tile_windows[slot.index()] = tile_windows;
          pipe_tile.producer_commit(slot);
          if (tile.m_block >= 0) {
            blocks = tile.blocks_before + max(tile.n_max - tile.n_min, 0);
            tiles = i + 1;
            load_tile(tile, i);
          }
        }
      }
      if (!skip && tile.m_block < 0) break;
      __syncwarp();
      q = next_step;
      __syncwarp();
    }
    if (first_lane()) {  // stay until the consumers have released every stage (no load outlives the CTA's smem)
      const PipelineState write = pipeline_state_at<Tile::kStages>(uint32_t(blocks), true);
      pipe_k.producer_tail(write);
      pipe_v.producer_tail(write);
      const auto write_b = pipeline_state_at<Tile::kOperandStages>(uint32_t(blocks), true);
      if constexpr (Tile::kBias) pipe_bias.producer_tail(write_b);
      if constexpr (Tile::kMask) pipe_mask.producer_tail(write_b);
    }
    return;
  }

  // ---------------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Tile::kConsumerRegs>();
  const int consumer = (threadIdx.x - 128) / 128;
  // The consumer thread index, read afresh where a phase of a tile needs it and opaque to the
  // compiler: derived from one value, every fragment address and coordinate would be hoisted
  // out of the tile loop and held through every key loop and epilogue (spills).
  auto opaque_thread_index = []() { return opaque_int(int(threadIdx.x) - 128); };

  typename Tile::TiledMmaS mma_s;
  typename Tile::TiledMmaO mma_o;
  // The shared-memory operands (A, B) of a wgmma depend on the warpgroup only: they are taken
  // from the slice of the warpgroup's first thread, whose index comes from a shuffle of lane 0
  // so that the compiler knows it warp-uniform. The operand descriptors then live in uniform
  // registers (an add and a move per operand and wgmma); from the (opaque) thread index every
  // wgmma rebuilt its descriptors in vector registers and moved them over.
  const int wg_thread0 = __shfl_sync(0xffffffff, consumer, 0) * 128;
  auto wg_s = mma_s.get_thread_slice(wg_thread0);
  auto wg_o = mma_o.get_thread_slice(wg_thread0);
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  constexpr float kLog2e = 1.4426950408889634f;
  const float sl2 = a.scale * kLog2e;  // (raw scores: the scale folded into the exponent)

  // Consumer w's turn on the tensor cores: it waits on barrier w, and hands the turn to w + 1.
  // The gate's variants take no turns: their score transform (three MUFU operations a score, a
  // chain of latencies) takes longer than the other consumer's products, so the turns only held
  // the consumers' products back; free-running, their forward took 0.97x the time (H200, B=2,
  // S=8192, H=16, D=128, causal and not, three A/B runs). The reverse -- the transforms in turns,
  // so that one consumer's ran beside the other's products -- took 1.2x: the two consumers'
  // transforms together hide each other's latencies, which one alone does not. With the terms
  // from the producer's warps (kGateTerms) the transform is short, and the turns are a build
  // option (kGateTermTurns).
  // (The gate alone, kGateOnly, as the gate's other variants: the same chain a score less the key
  // row's terms.)
  constexpr bool kTurns = !Tile::kGate || (Tile::kGateTerms && kGateTermTurns);
  auto sched_sync = [&]() {
    if constexpr (kTurns) NamedBarrier::sync(kSchedThreads, kSchedBarrier + consumer);
  };
  auto sched_pass = [&]() {
    if constexpr (kTurns)
      NamedBarrier::arrive(kSchedThreads, kSchedBarrier + (consumer + 1 == kConsumers ? 0 : consumer + 1));
  };

  // The tiles taken: a counter, not a pipeline state, across tiles (registers: O's accumulators
  // need them). Where the K, V, bias and key-row pipelines stand comes with each tile.
  for (uint32_t tiles = 0;; ++tiles) {
    // The tile stays in its slot until its epilogue: read from there where used (volatile: not
    // held in registers).
    const TileState slot = pipeline_state_at<Tile::kTileSlots>(tiles, false);
    pipe_tile.consumer_wait(slot);
    const volatile FwdWsTileInfo& tile = ss.tiles[slot.index()];
    const volatile FwdWsTileWindows& tile_windows = ss.tile_windows[Tile::kWindows ? slot.index() : 0];
    // Key block nv of the tile's walk (from its slot).
    auto key_block = [&](int nv) { return walk_key_block<Tile>(ss, slot.index(), nv); };
    if (tile.m_block < 0) break;
    const int n_min = tile.n_min, n_max = tile.n_max;
    const int m0 = tile.m_block * kBlockM;
    const int tid = opaque_thread_index();
    Tensor tScS = mma_s.get_thread_slice(tid).partition_C(cS);
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    OnlineSoftmax<kRows> softmax;
    softmax.init();
    // (every tile loads Q, with or without key blocks: its buffer stages the output)
    q_full.wait(tiles & 1);

    if (n_max > n_min) {
      // The first turn, once Q is in: the previous tile's turns are all taken by then (its Q
      // buffer was released after them).
      if (kTurns && consumer == kConsumers - 1) NamedBarrier::arrive(kSchedThreads, kSchedBarrier + 0);
      PipelineState read_k = pipeline_state_at<Tile::kStages>(tile.blocks_before, false), read_v = read_k,
                    read_r = read_k;
      auto read_b = pipeline_state_at<Tile::kOperandStages>(tile.blocks_before, false);  // (bias and mask tiles)
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor rP = make_tensor<Element>(acc_s.layout());
      Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
      // At D = 256 the GEMMs' shared-memory descriptors are rebuilt at each issue from an address
      // the compiler cannot see through: hoisted out of the loop, every k-step's descriptors of Q,
      // K and V held registers that O's 128 accumulators need (spills). At the smaller head dims
      // they stay hoisted, off the tensor-core turn's critical path.
      auto opaque = [](Element* ptr) {
        if constexpr (kHeadDim == 256) asm volatile("" : "+l"(ptr));
        return ptr;
      };
      auto issue_s = [&](int stage) {
        Tensor q = make_tensor(make_smem_ptr(opaque(ss.q.data())), typename Tile::SmemLayoutQ{});
        Tensor k = make_tensor(make_smem_ptr(opaque(ss.k.data())), typename Tile::SmemLayoutKV{});
        Tensor tSrQ = wg_s.partition_fragment_A(q);
        Tensor tSrK = wg_s.partition_fragment_B(k);
        gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
      };
      auto issue_pv = [&](int stage) {
        Tensor vt = make_tensor(make_smem_ptr(opaque(ss.v.data())), typename Tile::SmemLayoutVt{});
        Tensor tOrVt = wg_o.partition_fragment_B(vt);
        gemm_issue</*kZeroInit=*/false, /*kRegA=*/true>(mma_o, tOrP, tOrVt(_, _, _, stage), acc_o);
      };
      const WindowMask win = SeqBounds(a, tile.b).window();
      // The bias and the window / tail test of block n, then the softmax; alpha: O's rescale
      // factors. (Inlined by force: a call takes the accumulators' address, which puts them in
      // local memory, and the windows' test made the lambda big enough to be called.)
      auto scores_to_probs = [&](int n, float (&alpha)[kRows]) __attribute__((always_inline)) {
        // Softcap before any bias: s = softcap * tanh(scale * qk / softcap) + bias, the bias then
        // added to scores scaled already.
        float scale = a.scale;
        if constexpr (Tile::kSoftcap) {
          if (a.softcap != 0.f) {
            CUTE_UNROLL
            for (int i = 0; i < size(s_rc); ++i) s_rc(i) = a.softcap * tanhf(s_rc(i) * a.scale_div_softcap);
            scale = 1.f;
          }
        }
        // (block n's bias and mask stages: read_b of both pipelines, advanced once they are read)
        if constexpr (Tile::kBias) {
          pipe_bias.consumer_wait(read_b);
          const auto* bias_stage = reinterpret_cast<const typename Tile::BiasElement*>(
              ss.bias_tiles.data() + read_b.index() * Tile::kBiasStageBytes);
          if constexpr (Tile::kBiasBytes == 4) add_bias_sw128<kBlockM>(s_rc, tScS_rc, bias_stage, scale);
          else add_bias_sw128<Element, kBlockM>(s_rc, tScS_rc, bias_stage, scale);
          pipe_bias.consumer_release(read_b);
        }
        // The mask tile's false elements: -inf on the final score (after any bias, so that no
        // bias value turns a masked score into anything else).
        auto apply_mask_tile = [&]() {
          if constexpr (Tile::kMask) {
            static_assert(is_mask_sw_layout<typename Tile::SmemLayoutMask, kBlockM, kBlockN>(),
                          "the mask's reads follow the tile's layout");
            pipe_mask.consumer_wait(read_b);
            apply_mask_sw<kBlockM, kBlockN>(s_rc, tScS_rc, ss.mask_tiles.data() + read_b.index() * Tile::kMaskStageBytes);
            pipe_mask.consumer_release(read_b);
          }
        };
        if constexpr (Tile::kMask && !Tile::kKeyRows) apply_mask_tile();
        if constexpr (Tile::kKeyRows) {
          pipe_key_rows.consumer_wait(read_r);
          const auto& st = ss.key_rows[read_r.index()];
          // (beside bias tiles: the score is final, the rows carry no bias; the gate alone: the
          // scale alone, so that the scores are the backward's to the bit)
          if constexpr (Tile::kGateOnly) {
            CUTE_UNROLL
            for (int i = 0; i < size(s_rc); ++i) s_rc(i) *= scale;
          } else if constexpr (!Tile::kBias) {
            add_key_bias(s_rc, tScS_rc, st.bias, scale);
          }
          // The gate on the final scores (its scale the softmax scale, after any softcap); its
          // logarithm terms from the term warps' slot where they compute them.
          if constexpr (Tile::kGateTerms) {
            const auto read_t = GateTerms::state(read_r.count(), consumer, false);
            pipe_gate_terms.consumer_wait(read_t);
            add_gate_terms(s_rc, tScS_rc, ss.gate_terms.data() + read_t.index() * GateTerms::kSlotBytes,
                           int(threadIdx.x) % 128, st.alpha, st.delta, a.scale, a.gate.linear);
            pipe_gate_terms.consumer_release(read_t);
          } else if constexpr (Tile::kGate) {
            add_gate_scores(s_rc, tScS_rc, st.alpha, st.delta, a.scale, a.gate.linear);
          }
          if constexpr (Tile::kMask) apply_mask_tile();
          // The test on positions (the blocks the loader marked): gathered keys' window on
          // original positions, else the plain window (positions are indices); query bounds
          // (key ends, a mask).
          if constexpr (Tile::kGateOnly) {
            if (win.block_needs_mask(m0, kBlockM, kBlockN, n))
              transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n * kBlockN, win, nullptr,
                                                                        0, nullptr, 0);
          } else if (st.needs_test) {
            const PositionTest pt{st.pos, a.kpos.ptr != nullptr ? position_window(a) : win, Tile::kKeyRowEndDelta};
            mask_and_bias_scores_impl<false, false, true, true, true, float, kBlockN>(
                s_rc, tScS_rc, m0, key_block(n) * kBlockN, win, nullptr, 0, nullptr, 0, &pt);
          }
          pipe_key_rows.consumer_release(read_r);
          ++read_r;
        } else if constexpr (Tile::kWindows) {
          // Windows with sinks: block n of the walk, tested where the window does not show it whole
          // (the window's test covers causal and the tails: a key past the sequence lies above
          // every valid query's diagonal).
          const int nk = key_block(n);
          if (!tile_windows.clear.has(nk))
            apply_sink_window(s_rc, tScS_rc, SinkWindowTest::load(tile_windows.window), m0, nk * kBlockN);
        } else if constexpr (Tile::kPackGqa) {  // (the test on each row's own query)
          int q_first, q_count;
          packed_query_span(m0, kBlockM, a.group, q_first, q_count);
          if (win.block_needs_mask(q_first, q_count, kBlockN, n))
            mask_packed_rows<kBlockN>(s_rc, tScS_rc, m0, a.group, n * kBlockN, win);
        } else if (win.block_needs_mask(m0, kBlockM, kBlockN, n)) {
          transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n * kBlockN, win, nullptr, 0,
                                                                    nullptr, 0);
        }
        if constexpr (Tile::kBias || Tile::kMask) ++read_b;
        if constexpr (Tile::kScaledScores) softmax.template update_scaled_deferred<true, true>(s_rc, kLog2e, alpha);
        else softmax.template update_scaled_deferred<false>(s_rc, sl2, alpha);
      };

      // Packed batches: the rows of a key block past the sequence's end are the next sequence's
      // keys (zeros only at the end of the tensor). Their scores are -inf (the tail test), so P is
      // exactly 0 there, but 0 * a NaN or Inf in those V rows would reach this sequence's output:
      // the consumers zero them in the one block that has them, before any P V of that stage, and
      // outside the tensor-core turns (every consumer takes part in the barrier).
      const int len_k = SeqBounds(a, tile.b).len_k();  // (read once: packed lengths come from memory)
      auto clear_v_tail = [&](int nv) {
        const int valid = len_k - key_block(nv) * kBlockN;
        if (!packed || valid >= kBlockN) return;
        pipe_v.consumer_wait(read_v);
        // (its addresses from the index afresh: derived from tid, they were held through the loop)
        for (int idx = opaque_thread_index(); idx < (kBlockN - valid) * kHeadDim; idx += kConsumerThreads)
          sV(valid + idx / kHeadDim, idx % kHeadDim, read_v.index()) = Element(0.f);
        fence_smem_for_wgmma();
        // (not .aligned: a consumer without rows arrives from its own loop, and the lanes of a
        // warp from the zeroing loop's different trip counts; compute-sanitizer's synccheck
        // flagged the aligned form there)
        NamedBarrier(kConsumerThreads, kTailBarrier).arrive_and_wait_unaligned();
      };

      // A consumer whose 64 rows all lie past the sequence (a short sequence, the last query
      // block of a longer one; never consumer 0) runs no product and no softmax: it takes its
      // tensor-core turns and consumes its pipeline stages unread, so that the others' products
      // run back to back. (Its rows are never stored. A branch around the loop, not a flag held
      // through it: the flag cost the loop registers, spills at D=64, 128 and 256.)
      // A block's score stages (bias, mask tiles, key rows) consumed unread.
      auto skip_score_stages = [&]() {
        if constexpr (Tile::kBias) {
          pipe_bias.consumer_wait(read_b);
          pipe_bias.consumer_release(read_b);
        }
        if constexpr (Tile::kMask) {
          pipe_mask.consumer_wait(read_b);
          pipe_mask.consumer_release(read_b);
        }
        if constexpr (Tile::kBias || Tile::kMask) ++read_b;
        if constexpr (Tile::kKeyRows) {
          pipe_key_rows.consumer_wait(read_r);
          pipe_key_rows.consumer_release(read_r);
          if constexpr (Tile::kGateTerms) {
            const auto read_t = GateTerms::state(read_r.count(), consumer, false);
            pipe_gate_terms.consumer_wait(read_t);
            pipe_gate_terms.consumer_release(read_t);
          }
          ++read_r;
        }
      };
      if (consumer * 64 >= tile_rows_of<Tile::kPackGqa>(SeqBounds(a, tile.b).len_q(), a.group) - m0) {
        for (int n = n_max - 1; n >= n_min - 1; --n) {  // (n_min - 1: the last P V turn)
          if (n >= n_min) pipe_k.consumer_wait(read_k);
          if (n < n_max - 1) {
            clear_v_tail(n + 1);
            pipe_v.consumer_wait(read_v);
          }
          sched_sync();
          sched_pass();
          if (n >= n_min) {
            pipe_k.consumer_release(read_k);
            ++read_k;
            skip_score_stages();
          }
          if (n < n_max - 1) {
            pipe_v.consumer_release(read_v);
            ++read_v;
          }
        }
      } else {
        // (gate skipping: the blocks of the tile's walk, its kept ones alone: a skipped cell's
        // block is neither loaded nor computed)
        static_assert(!Tile::kGateSkip || (kBlockM == kGateCell && kBlockN == kGateCell),
                      "gate skipping: a tile is one cell");
        int n = n_max - 1;
        pipe_k.consumer_wait(read_k);
        sched_sync();
        issue_s(read_k.index());
        sched_pass();
        gemm_wait<0>(acc_s);
        pipe_k.consumer_release(read_k);
        ++read_k;
        {
          float alpha[kRows];
          scores_to_probs(n, alpha);  // (alpha = 0: O is still zero)
          convert_fragment<Element, false>(acc_s, rP);
        }

        for (--n; n >= n_min; --n) {
          pipe_k.consumer_wait(read_k);
          clear_v_tail(n + 1);
          sched_sync();
          issue_s(read_k.index());
          pipe_v.consumer_wait(read_v);
          issue_pv(read_v.index());
          sched_pass();
          gemm_wait<1>(acc_s);
          pipe_k.consumer_release(read_k);
          ++read_k;
          float alpha[kRows];
          scores_to_probs(n, alpha);
          gemm_wait<0>(acc_o);
          pipe_v.consumer_release(read_v);
          ++read_v;
          // (the skip pays with a bias or key rows; on plain scores its vote sits on the shortest
          // path between the P V product and the next turn, 2-3 % slower there)
          if constexpr (Tile::kScaledScores) softmax.rescale_if_needed(acc_o_rc, alpha);
          else softmax.rescale(acc_o_rc, alpha);
          convert_fragment<Element, false>(acc_s, rP);
        }
        clear_v_tail(n_min);
        pipe_v.consumer_wait(read_v);
        sched_sync();
        issue_pv(read_v.index());
        sched_pass();
        gemm_wait<0>(acc_o);
        pipe_v.consumer_release(read_v);
        ++read_v;
      }
      // The last consumer's final hand-over is to consumer 0: consume it, so that no barrier
      // is left half arrived.
      if (consumer == 0) sched_sync();
    }

    // (the epilogue's thread index afresh: the key loop's is not held through it)
    const int etid = opaque_thread_index();
    float lse[kRows];
    int rows[kRows];
    softmax.finalize(acc_o_rc, lse, Tile::kScaledScores ? 1.f : a.scale);
    Tensor tEcS = make_tensor(mma_s.get_thread_slice(etid).partition_C(cS).data(), tScS_rc.layout());
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) rows[r] = get<0>(tEcS(r, 0));

    // Epilogue: this consumer's 64 rows through its own rows of sQ (read only by its own S GEMMs,
    // all complete), then 16-byte coalesced stores.
    Tensor rO = make_tensor<Element>(acc_o.layout());
    convert_fragment<Element, /*kSaturate=*/true>(acc_o, rO);
    Tensor tOsO = mma_o.get_thread_slice(etid).partition_C(sQ);
    copy(rO, tOsO);
    const SeqBounds seq(a, tile.b);
    constexpr int kChunksPerRow = kHeadDim / 8;
    constexpr int kChunks = 64 * kChunksPerRow;
    static_assert(kChunks % 128 == 0);
    const int wtid = etid % 128;
    // Row r of the tile is tile row m0 + r of the sequence (packed query heads: query (m0 + r) /
    // group of head (m0 + r) % group of the group): each row's lse and output at its own (query,
    // head). (Packed, the stores in a rolled loop: unrolled, the rows' divisions and addresses
    // spilled at head dim 256.)
    const int q0 = seq.q0();
    const int rows_valid = min(kBlockM, tile_rows_of<Tile::kPackGqa>(seq.len_q(), a.group) - m0);
    const int h0 = Tile::kPackGqa ? tile.h * a.group : tile.h;  // the tile's (first) head
    auto row_offset = [&](int r, int64_t row_stride, int64_t head_stride) {
      return tile_row_offset<Tile::kPackGqa>(m0 + r, a.group, row_stride, head_stride);
    };
    float* g_lse = a.lse + seq.stat_offset(h0, q0);
    if ((etid & 3) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r)
        if (rows[r] < rows_valid) g_lse[row_offset(rows[r], 1, a.lse_hs)] = lse[r];
    }
    NamedBarrier::sync(128, kEpilogueBarrier + consumer);
    Element* gO = static_cast<Element*>(a.out) + int64_t(tile.b) * a.o_bs + int64_t(q0) * a.o_rs + int64_t(h0) * a.o_hs;
#pragma unroll(Tile::kPackGqa ? 1 : kChunks / 128)
    for (int it = 0; it < kChunks / 128; ++it) {
      const int idx = it * 128 + wtid;
      const int r = consumer * 64 + idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
      if (r < rows_valid && c < a.head_dim)
        *reinterpret_cast<uint4*>(gO + row_offset(r, a.o_rs, a.o_hs) + c) = *reinterpret_cast<const uint4*>(&sQ(r, c));
    }
    // The next tile's Q may now land in these rows (by TMA: the async proxy, after these
    // generic writes).
    cutlass::arch::fence_view_async_shared();
    q_empty.arrive();
    pipe_tile.consumer_release(slot);
  }
#endif
}

}  // namespace dmattn::cuda::sm90
