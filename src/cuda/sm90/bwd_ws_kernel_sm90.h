// The warp-specialized Hopper backward (sm_90a), FlashAttention-3's structure: one CTA per (key
// block, kv head, batch) (cta_order.h) with
//   - a producer warpgroup (registers given back with setmaxnreg):
//       warp 0, one thread: K and V once (one transaction barrier), then Q[t] and dO[t] of every
//         query block t the key block meets (every query head of the GQA group), by TMA through
//         two kStages-deep PipelineTmaAsync pipelines; with a full bias (kFullBias) also block
//         t's bias tile, into its one buffer once the consumers have added block t - 1's (and
//         block t + 1's tile prefetched into L2, so that the load waits on L2 only);
//       warp 1: the row statistics of block t (lse or the exact path's m and log2 l, Delta) and,
//         with key rows, the key block's positions, query bounds and bias for t's query head,
//         into a stage of a PipelineAsync;
//       warp 2: dQ's writer: once a consumer has staged its half of dQ[t] in shared memory, one
//         TMA reduce-add per (64, 32) box into dq_accum, then the buffer is handed back (named
//         barriers dQFull / dQEmpty, FlashAttention-3's scheme): the consumers never wait on
//         the global reduction (deterministic mode: the adds into one query block's rows in
//         key block order, each after its predecessor's, ordered_adds_sm90.h; the consumers
//         wait only when the writer falls behind); with a full bias's gradient, first dS[t] as
//         dbias's tile (one TMA store from its shared-memory buffer: dbias = dS where every dS
//         element has its own dbias element);
//       warp 3, with a full bias's gradient: zeros into dbias's rows of this key block that no
//         query reaches (causal / window), while the loop runs (under a causal mask the key
//         blocks that zero the most compute the least; docs/design.md);
//   - two consumer warpgroups (registers raised), per query block t:
//       issue S = Q K^T, dP = dO V^T; the score transform (scale, key bias or bias tile, window /
//       positions tests) and P = exp(s - lse) while dP runs; dS = P (dP - Delta); column sums of
//       dS for a key bias; P, dS -> shared memory; one barrier of both consumers (dS complete);
//       issue dV += P^T dO, dK += dS^T Q, dQ = dS K; wait; release Q[t], dO[t];
//       dQ -> shared memory (fp32) for the writer (head dim 256: the consumers in turns on one
//       buffer, bwd_ws_tile_sm90.h).
//     dK and dV stay in registers across the loop and are stored at the end (scale applied).
// With the gate (the variant Tile::kGate: on key rows, or on plain scores where it comes alone),
// the loader adds the query block's alpha rows to the stages and the key block's delta rows (key
// rows; on plain scores the CTA loads them once), the transform adds scale * g(alpha delta) to the
// scores, and once P is stored the gate's gradients of the block go from dS into dalpha's
// accumulator (row sums) and shared memory (column sums, flushed into ddelta at the end;
// gate_grads_sm90.h). With gate skipping (Tile::kGateSkip) the loader marks a skipped cell's
// stage: on key rows its statistic +inf makes P and dS 0 and the consumers skip the gate's value;
// on plain scores they run no product there and the dQ writer adds nothing for it.
// The score transform and P / dS are the general Hopper kernel's (bwd_common.h): the same
// numerics, exactly. A query-broadcast dbias's column sums (the variant Tile::kColSum) are one
// more product, dS^T times a tile of ones (as the general kernel's bias fast path), issued before
// dV and added to a shared row after dK's wait (dbias_colsum_sm90.h); an fp32 bias's are summed
// in fp32 from dS before its 16-bit rounding instead (as the general kernel's fp32-bias path), so
// that a gradient whose terms cancel keeps its zero.
// Buffers: P has one buffer (read only by its own consumer's dV product, complete at that
// consumer's wait; at head dim 256 two, as dS: both consumers' dV products read all of it), dS
// two (a dQ product of block t, which reads both consumers' halves, or the writer's dbias store,
// may still read it while block t + 1 is written; the barrier of block t + 1 orders block
// t + 2's writes after it). At D = 64 one consumer computes dQ[t], consumer t % 2 (the other
// still takes its turn with the writer, without a tile: the hand-backs stay matched). The
// dbias store of dS[t] is issued in the writer's turn for consumer 0's dQ[t] and waited for
// (read) before the writer hands consumer 0's dQ buffer back: each consumer writes dS[t + 2]
// only after its dQ-empty wait of block t + 1, which follows that hand-back.
// Compiled for every target, with a body only for sm_90a.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/common/copy.h"
#include "cuda/common/bwd_parts.h"
#include "cuda/common/cta_order.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/score_mask.h"
#include "cuda/common/seq_bounds.h"
#include "cuda/sm90/acc_store_sm90.h"
#include "cuda/sm90/bias_tile_sm90.h"
#include "cuda/sm90/bwd_ws_tile_sm90.h"
#include "cuda/sm90/dbias_colsum_sm90.h"
#include "cuda/sm90/gate_grads_sm90.h"
#include "cuda/sm90/gate_sm90.h"
#include "cuda/sm90/gate_terms_sm90.h"
#include "cuda/sm90/gmma.h"
#include "cuda/sm90/key_rows_sm90.h"
#include "cuda/sm90/ordered_adds_sm90.h"
#include "cuda/sm90/pipeline_params_sm90.h"

namespace dmattn::cuda::sm90 {

template <class Tile>
struct BwdWsParams {
  BwdArgs a;
  typename Tile::TmaQ tma_q, tma_do;
  typename Tile::TmaKV tma_k, tma_v;
  typename Tile::TmadQ tma_dq;  // (unused without dq_accum)
  typename Tile::TmaBias tma_bias;    // (Tile::kFullBias only)
  typename Tile::TmadBias tma_dbias;  // (Tile::kFullBias with dbias kDbDirect only)
  int bias_heads, bias_batch;         // the bias's head / batch extents (1: broadcast)
  // The TMA views' row and batch extents: a dense batch's (seqlen, batch), or a packed batch's
  // (total rows, 1), whose sequences the kernel offsets by their first rows.
  int rows_q, rows_k, tma_batch;
};

// Named barriers (ids after CUTLASS's reserved ones).
struct BwdWsBarrier {
  static constexpr int kPdS = 0;        // both consumers: P and dS of block t written
  static constexpr int kDqFull = 1;     // + w: consumer w's dQ staged (consumer w + the writer warp)
  static constexpr int kDqEmpty = 3;    // + w: consumer w's dQ buffer free again
  static constexpr int kColSum = 5;     // both consumers: column-sum flushes, packed tails cleared
  static constexpr int kDqThreads = 128 + 32;
};

// kPacked: a packed batch (cu_seqlens): the sequences' lengths read from memory. A template
// parameter: read at run time, the lengths were values of the query loop in every variant (276 B
// of spills in the key-row consumers against 144 B).
template <class Tile, bool kPacked>
__global__ void __launch_bounds__(Tile::kNThreads, 1) bwd_ws_kernel_sm90(const __grid_constant__ BwdWsParams<Tile> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Tile::Element;
  using Pipeline = typename Tile::Pipeline;
  using RowPipeline = typename Tile::RowPipeline;
  using PipelineState = typename cutlass::PipelineState<Tile::kStages>;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  using Bar = BwdWsBarrier;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kConsumerThreads = Tile::kConsumerThreads;
  const BwdArgs& a = p.a;
  const FwdArgs& f = a.f;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Tile::SharedStorage*>(smem_raw);
  const int warp_group = threadIdx.x / 128;
  const CtaCoords cta = bwd_cta_coords(a);
  const int n_block = bwd_cta_n_block();
  const int n0 = n_block * kBlockN;
  // (the CTA's coordinates divided out of its index: warp-uniform, for the uniform registers)
  const int kvh = warp_uniform(cta.y), b = warp_uniform(cta.z);
  const int group = f.group;
  const SeqBoundsOf<kPacked ? kSeqFormPacked : kSeqFormDense> seq(f, b);  // (dense: the parameters)
  // A packed batch (one sequence of all rows to TMA, tma_batch 1): sequence b's rows from its
  // first; its tiles reach past its end into the next sequence's rows, which the kernel keeps
  // out of every sum (docs/design.md).
  constexpr bool packed = kPacked;
  const int tb = packed ? 0 : b;
  const bool want_dq = a.dq_accum != nullptr;
  constexpr bool colsum = Tile::kColSum;  // (the launch picks the variant: a.dbias_mode == kDbColSum)
  constexpr int kColSumRows = Tile::kColSumRows;
  // A full bias's gradient: dS's tiles stored by the dQ writer (which then runs without dQ too).
  const bool dbias_tiles = Tile::kFullBias && a.dbias != nullptr && a.dbias_mode == kDbDirect;
  const bool writer = want_dq || dbias_tiles;
  // Indexed keys: the producer warpgroup copies the key block's K and V rows by cp.async, issued
  // first thing so that they overlap the setup below; each of its threads arrives on kv_full
  // once the barrier is initialized (128 arrivals, each when the thread's copies have landed).
  const bool indexed = Tile::kKeyRows && f.kpos.rows != nullptr;
  if constexpr (Tile::kKeyRows) {  // (compiled only where gathered keys may come)
    if (indexed && warp_group == 0) {
      static_assert(is_sw128_layout<typename Tile::SmemLayoutKV, kBlockN, Tile::kHeadDim>(),
                    "the gather's addresses follow the K / V tiles' layout");
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      const int64_t src_b = b / f.kpos.rows_batch_div;
      GatherRowIndices<kBlockN, 4> ix;
      ix.load(rows_row(f.kpos, b, kvh * group) + n0, seq.len_k() - n0, warp, lane);
      gather_rows_sw128<kBlockN, kHeadDim, 4>(cute::cast_smem_ptr_to_uint(ss.k.data()),
                                              static_cast<const Element*>(f.k) + src_b * f.k_bs + int64_t(kvh) * f.k_hs,
                                              f.k_rs, ix, f.kpos.rows_source_len, f.head_dim, warp, lane);
      gather_rows_sw128<kBlockN, kHeadDim, 4>(cute::cast_smem_ptr_to_uint(ss.v.data()),
                                              static_cast<const Element*>(f.v) + src_b * f.v_bs + int64_t(kvh) * f.v_hs,
                                              f.v_rs, ix, f.kpos.rows_source_len, f.head_dim, warp, lane);
    }
  }

  // The query blocks [m_lo, m_hi) that meet this key block (gathered keys: from its positions,
  // which every thread reads after the counting barrier).
  int m_lo, m_hi;
  BlockWalk m_walk;  // (windows with sinks: [m_lo, m_hi) are virtual blocks of the walk)
  if constexpr (Tile::kWindows) {  // (one row for the KV head: bwd_ws_supports)
    const SinkWindow w = SinkWindow::of(f, kvh * group, seq.len_q(), seq.len_k());
    m_walk = w.query_blocks(n0, kBlockN, kBlockM, m_lo, m_hi);
    if (threadIdx.x == 0) {
      ss.window = SinkWindowTest::of(w);
      ss.window_clear = w.clear_query_blocks(n0, kBlockN, kBlockM);
    }
  } else if constexpr (Tile::kKeyRows) {
    if (f.kpos.ptr != nullptr) {
      const KeyPositionRow kp_row(f, b, kvh * group);
      load_positions_tile<kBlockN, Tile::kNThreads, false>(ss.pos.data(), kp_row.row, kp_row.count, n0, threadIdx.x,
                                                           nullptr, 0);
      const int n_valid = positions_tile_valid_count<kBlockN>(ss.pos.data(), f.kpos.seqlen_k_original, threadIdx.x);
      kp_row.query_block_range(ss.pos[0], ss.pos[n_valid > 0 ? n_valid - 1 : 0], n_valid, kBlockM, m_lo, m_hi);
      // Key ends: the queries from the block's largest end on keep none of its rows (the
      // per-query path orders its candidates so that a block's ends are close together).
      if (f.kpos.ends != nullptr) {
        const int end_max = key_block_end_max<kBlockN, Tile::kNThreads>(f.kpos, b, kvh * group, group, kp_row.count,
                                                                        n0, threadIdx.x, ss.end_max);
        m_hi = min(m_hi, int((int64_t(end_max) + kBlockM - 1) / kBlockM));
      }
    } else {
      bwd_query_block_range(seq.window(), n0, kBlockN, kBlockM, m_lo, m_hi);
    }
    if constexpr (colsum) {
      for (int i = threadIdx.x; i < kColSumRows * kBlockN; i += Tile::kNThreads) ss.colsum[i] = 0.f;
      // (the column-sum product's B operand, published to wgmma by this fence and the barriers
      // before the first product)
      for (int i = threadIdx.x; i < cute::cosize(typename Tile::SmemLayoutOnes{}); i += Tile::kNThreads)
        ss.ones[i] = Element(1.f);
      fence_smem_for_wgmma();
    }
  } else {
    bwd_query_block_range(seq.window(), n0, kBlockN, kBlockM, m_lo, m_hi);
  }
  // (the same in every thread: from lane 0, so that the compiler knows them warp-uniform and may
  // keep them and what derives from them in uniform registers)
  m_lo = warp_uniform(m_lo);
  m_hi = warp_uniform(m_hi);
  const int n_m = max(m_hi - m_lo, 0);
  const int n_iter = n_m * group;
  if (threadIdx.x == 0) {  // (published by the barrier below)
    ss.walk_m_lo = m_lo;
    ss.walk_m_hi = m_hi;
    ss.walk_n_m = n_m;
    ss.walk_n_iter = n_iter;
    ss.walk_cols_valid = min(kBlockN, seq.len_k() - n0);
    ss.cta_b = b;
    ss.cta_kvh = kvh;
  }
  // The gate: its column sums start at 0; on plain scores the key block's delta rows, once (the
  // kv head's: every query head of the CTA's walk shares them).
  if constexpr (Tile::kGate) {
    for (int i = threadIdx.x; i < 4 * kBlockN; i += Tile::kNThreads) ss.gate_col[i] = 0.f;
    if constexpr (!Tile::kKeyRows) {
      const GateRowSource src = gate_delta_source(f, b, kvh * group, seq.k0());
      for (int j = threadIdx.x; j < kBlockN; j += Tile::kNThreads)
        ss.gate_delta[j] = n0 + j < seq.len_k() ? gate_load<Element>(src.base, int64_t(n0 + j) * src.step, src.fp32) : 0.f;
    }
  }

  const auto pipe_params = tma_pipeline_params<Pipeline>(Tile::kQBytes, warp_group == 0, kConsumerThreads);
  Pipeline pipe_q(ss.pipe_q, pipe_params, Shape<_1, _1, _1>{});
  using PipelineDo = typename Tile::PipelineDo;
  PipelineDo pipe_do(ss.pipe_do, tma_pipeline_params<PipelineDo>(Tile::kQBytes, warp_group == 0, kConsumerThreads),
                     Shape<_1, _1, _1>{});
  // (the gate's term warp reads the stages' alpha rows too; its pipeline's barriers are
  // initialized only where it runs)
  using GateTerms = typename Tile::GateTerms;
  RowPipeline pipe_rows(ss.pipe_rows, loader_pipeline_params<RowPipeline>(
                                          warp_group == 0,
                                          kConsumerThreads + (Tile::kGateTerms ? GateTerms::kProducerThreads : 0)));
  auto pipe_gate_terms = [&]() {
    if constexpr (Tile::kGateTerms)
      return typename GateTerms::Pipeline(ss.pipe_gate_terms, GateTerms::params(warp_group == 0));
    else
      return 0;
  }();
  using BiasPipeline = typename Tile::BiasPipeline;
  BiasPipeline pipe_bias(ss.pipe_bias,
                         tma_pipeline_params<BiasPipeline>(Tile::kBiasBytes, warp_group == 0, kConsumerThreads),
                         Shape<_1, _1, _1>{});
  auto& kv_full = *reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&ss.kv_full);
  // (indexed keys: the producers' copies, issued above, arrive once they land: 128 arrivals)
  if (threadIdx.x == 0) {
    ss.m_walk = m_walk;
    kv_full.init(indexed ? 128 : 1);
    if constexpr (Tile::kDqTurns)
      for (int w = 0; w < Tile::kConsumers; ++w) cutlass::arch::ClusterBarrier::init(&ss.dq_turn[w], 128 + 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Query block t: query head kvh * group + t / n_m, block m_lo + t % n_m. (A walk starting at a
  // block that depends on the key block, so that neighbouring CTAs add into different dQ rows,
  // measured no faster: 7.83 against 7.81 ms dense, 4.29 against 4.15 causal, docs/design.md.)
  // The query block of virtual block v (read from shared memory where used: not held in the
  // roles' registers through their loops; the identity outside the windows' variant). A key
  // block's query runs are two at most -- the sinks' run and the near band's start together,
  // the far band's lies in the sinks' or after the near band's --, so one gap (split1, gap1).
  auto m_at = [&](int v) {
    if constexpr (Tile::kWindows) {
      const volatile BlockWalk& w = ss.m_walk;
      return v - (v < w.split1 ? w.gap1 : 0);
    } else {
      return v;
    }
  };
  // The walk and the CTA's coordinates read again from shared memory where they are used: the
  // producer's roles (held in their 40 registers through the loops, they spilled) and the
  // consumers' epilogue (held through the query loop, they took the consumers' registers).
  // (A volatile read: the compiler neither merges it with an earlier one nor hoists it.)
  auto read_again = [](const int32_t& x) { return int(const_cast<const volatile int32_t&>(x)); };
  auto walk_iters = [&] { return read_again(ss.walk_n_iter); };
  auto walk_lo = [&] { return read_again(ss.walk_m_lo); };
  auto walk_hi = [&] { return read_again(ss.walk_m_hi); };
  auto walk_n_m = [&] { return read_again(ss.walk_n_m); };
  auto walk_cols_valid = [&] { return read_again(ss.walk_cols_valid); };
  auto head_of = [&](int t) { return kvh * group + t / walk_n_m(); };
  auto m_block_of = [&](int t) { return m_at(walk_lo() + t % walk_n_m()); };

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Tile::kProducerRegs>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (indexed) {
      cutlass::arch::cpasync_barrier_arrive_noinc(&ss.kv_full);
      // (the consumers wait for these copies before anything else; without a query block they
      // do not, and no copy may outlive the CTA)
      if (walk_iters() == 0) asm volatile("cp.async.wait_all;\n" ::);
    }
    if (warp == 3) {  // dbias where no query reaches the key block, or the gate's terms
      if constexpr (Tile::kGateTerms) {  // (gate_terms_sm90.h: one slot a query block, for both consumers)
        typename Tile::TiledMmaSdP mma_sdp;
        const Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
        const GateTermPoly poly = GateTermPoly::of(255.f * GateMath::of(f.gate.linear).k);
        PipelineState read;
        for (int t = 0; t < walk_iters(); ++t) {
          pipe_rows.consumer_wait(read);
          const auto& st = ss.rows[read.index()];
          const auto write = one_stage_producer_state(t);
          pipe_gate_terms.producer_acquire(write);
          // (a skipped cell's slot committed unwritten: its consumers take it unread)
          if (!Tile::kGateSkip || !st.gate_skip) {
            const float* delta_rows;  // (key rows: the stage's; plain scores: the CTA's)
            if constexpr (Tile::kKeyRows) delta_rows = st.keys.delta;
            else delta_rows = ss.gate_delta.data();
            fill_gate_term_bytes(ss.gate_terms.data(), mma_sdp, cS, lane, st.alpha, delta_rows, poly);
          }
          pipe_gate_terms.producer_commit(write);
          pipe_rows.consumer_release(read);
          ++read;
        }
        return;
      }
      if (dbias_tiles)
        bwd_dbias_zero_unreached_warp<Element, kBlockM>(a, b, kvh, walk_lo(), walk_hi(), n0, min(kBlockN, f.seqlen_k - n0), lane);
      return;
    }
    if (walk_iters() == 0) return;
    if (warp == 1) {  // the row statistics and key rows
      PipelineState write = cutlass::make_producer_start_state<RowPipeline>();
      for (int t = 0; t < walk_iters(); ++t) {
        const int h = head_of(t);
        const int m0 = m_block_of(t) * kBlockM;
        pipe_rows.producer_acquire(write);
        auto& st = ss.rows[write.index()];
        // (packed: the sequence's first rows and lengths, read once per block, once the stage is
        // free: nothing of them is held through the wait)
        const int q0 = seq.q0(), len_q = seq.len_q();
        const int rows_valid = min(kBlockM, len_q - m0);
        const int64_t row_stat = seq.stat_offset(h, q0) + m0;
        if (packed && lane == 0) {
          st.seq_len[0] = len_q;
          st.seq_len[1] = seq.len_k();
        }
        // Windows with sinks: whether the window shows the tile in part (the element test; by the
        // first lane, as the lengths, and first: nothing of it is held through the loads below).
        if constexpr (Tile::kWindows) {
          if (lane == 0) st.window_on = !const_cast<const volatile ClearQueryBlocks&>(ss.window_clear).has(m0 / kBlockM);
        }
        // Gate skipping: a skipped cell's rows get the statistic +inf, so that P = exp(s - inf)
        // and dS are 0 there (its pairs count as masked) without a test in the consumers, which
        // skip the gate's math on the stage's flag.
        const bool gate_skip = Tile::kGateSkip && !gate_keeps(gate_keep_row(f.gate, opaque_int(b), h, m0), n_block);
        if constexpr (Tile::kGateSkip) {
          if (lane == 0) st.gate_skip = gate_skip;
        }
        // (one row a lane at a time: unrolled, the gate's loader spilled a register)
#pragma unroll 1
        for (int r = lane; r < rows_valid; r += 32) {
          st.m[r] = gate_skip ? INFINITY : a.row_m[row_stat + r];
          if (a.row_log2l != nullptr) st.log2l[r] = a.row_log2l[row_stat + r];
          st.delta[r] = a.delta[row_stat + r];
        }
        // The key rows depend on the head only (the key block is the CTA's): a stage keeps
        // them from its previous use, kStages blocks back, while the head is the same.
        if constexpr (Tile::kKeyRows) {
          if (t < Tile::kStages || head_of(t - Tile::kStages) != h)
            load_key_rows<Element, typename Tile::KeyRows, kBlockN, /*kUnrolled=*/false>(
                st.keys, n_block, seq.len_k(), key_row_sources(f, b, h, seq.k0()));
        }
        // The gate's rows: the key block's delta (the kv head's: once per stage), the query
        // block's alpha (its source from an opaque batch index: the invariant part hoisted out of
        // the loop took the 40-register loader's registers).
        if constexpr (Tile::kGate) {
          if constexpr (Tile::kKeyRows) {
            if (t < Tile::kStages)
              load_gate_rows<Element, kBlockN>(st.keys.delta, gate_delta_source(f, b, h, seq.k0()), n0, seq.len_k() - n0);
          }
          load_gate_rows<Element, kBlockM>(st.alpha, gate_alpha_source(f, opaque_int(b), h, seq.q0()), m0,
                                           min(kBlockM, seq.len_q() - m0));
        }
        pipe_rows.producer_commit(write);
        ++write;
      }
      return;
    }
    if (warp == 2) {  // dQ's writer (and dbias's)
      if (!writer) return;
      Tensor mdQ = p.tma_dq.get_tma_tensor(make_shape(p.rows_q, f.head_dim, f.num_heads, p.tma_batch));
      Tensor sdQ = make_tensor(make_smem_ptr(ss.dq.data()), typename Tile::SmemLayoutdQBoxes{});
      Tensor mdB = p.tma_dbias.get_tma_tensor(make_shape(f.seqlen_q, f.seqlen_k, f.num_heads, f.batch));
      // Deterministic mode (a.dq_order): block t's dQ is added after the previous key block's
      // adds into the same rows, if that block meets them. Both ends of bwd_query_block_range
      // grow with the key block, so the key blocks that meet a query block are consecutive: the
      // previous one is the only one to wait for, the first one waits for none, and the
      // previous one meets every query block of this one below its own end prev_hi.
      int prev_hi = 0;
      if (a.dq_order != nullptr && n_block > 0) {
        int prev_lo;
        bwd_query_block_range(seq.window(), n0 - kBlockN, kBlockN, kBlockM, prev_lo, prev_hi);
      }
      // The staging buffers start free; each later hand-back but the last matches a consumer's
      // wait (no barrier is left half arrived when the CTA ends). Head dim 256 hands the one
      // buffer over by the turn barriers instead: consumer 0's first turn is the writer's arrival
      // here and consumer 1's before its loop.
      if constexpr (Tile::kDqTurns) {
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.dq_turn[0]);
      } else {
        CUTE_UNROLL
        for (int w = 0; w < Tile::kConsumers; ++w) NamedBarrier::arrive(Bar::kDqThreads, Bar::kDqEmpty + w);
      }
      for (int t = 0; t < walk_iters(); ++t) {
        const int mb = m_block_of(t), h = head_of(t);
        // Gate skipping on plain scores: a skipped cell's consumers stage no dQ (their turns are
        // kept, and so is the order of the adds in deterministic mode).
        const bool skipped = Tile::kGateSkip && !Tile::kKeyRows &&
                             !gate_keeps(gate_keep_row(f.gate, opaque_int(b), h, mb * kBlockM), n_block);
        // (deterministic mode: this query block's flag, ordered_adds_sm90.h)
        int* const order = a.dq_order != nullptr ? a.dq_order + (int64_t(b) * f.num_heads + h) *
                                                                    dq_order_blocks(f.seqlen_q, kBlockM) + mb
                                                 : nullptr;
        // Packed batches: the sequence's rows from its first (q0). A block past the sequence's end
        // adds into the next sequence's rows too: zeros (the consumers zero those rows of dQ).
        const int q0 = packed ? seq.q0() : 0;
        Tensor gdQ = local_tile(domain_offset(make_coord(q0, 0), mdQ(_, _, h, tb)),
                                Shape<Int<kBlockM>, Int<Tile::kDqBoxCols>>{}, make_coord(mb, _));
        auto [tdQgdQ, tdQsdQ] = tma_partition(p.tma_dq, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdQ),
                                              group_modes<0, 2>(gdQ));
        CUTE_UNROLL
        for (int w = 0; w < Tile::kConsumers; ++w) {
          NamedBarrier::sync(Bar::kDqThreads, Bar::kDqFull + w);
          if (lane == 0) {
            if constexpr (Tile::kFullBias) {
              // dS[t] is complete: consumer 0 passed the barrier of both consumers' P / dS.
              if (w == 0 && dbias_tiles) {
                Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data() + (t & 1) * Tile::kPElems),
                                         typename Tile::SmemLayoutP{});
                Tensor gdB = local_tile(mdB(_, _, h, b), Shape<Int<kBlockM>, Int<kBlockN>>{},
                                        make_coord(mb, n_block));
                auto [tBgB, tBsB] = tma_partition(p.tma_dbias, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdS),
                                                  group_modes<0, 2>(gdB));
                copy(p.tma_dbias, tBsB, tBgB);
              }
            }
            // (turns: each consumer's columns fill the whole buffer)
            constexpr int kBoxesPerConsumer = Tile::kDqTurns ? Tile::kDqBoxes : Tile::kDqBoxes / Tile::kConsumers;
            if (want_dq && Tile::computes_dq(w, t)) {
              // Ordered adds: after the previous key block's (the consumers add disjoint columns).
              if (order != nullptr && w == Tile::first_dq_adder(t) && mb < prev_hi) wait_for_flag(order, n_block);
              if (!skipped) {
                CUTE_UNROLL
                for (int j = 0; j < kBoxesPerConsumer; ++j) {
                  const int box = w * kBoxesPerConsumer + j;  // (of the dQ row)
                  copy(p.tma_dq, tdQsdQ(_, box % Tile::kDqBoxes), tdQgdQ(_, box % Tile::kDqHeadBoxes));
                }
              }
            }
            tma_store_arrive();
            tma_store_wait<0>();  // the boxes have been read: the buffer may be written again
            // (turns: consumer 0's columns read, consumer 1's turn; consumer 1's, consumer 0's
            // next block's)
            if constexpr (Tile::kDqTurns) cutlass::arch::ClusterBarrier::arrive(&ss.dq_turn[1 - w]);
          }
          __syncwarp();
          if (!Tile::kDqTurns && t + 1 < walk_iters()) NamedBarrier::arrive(Bar::kDqThreads, Bar::kDqEmpty + w);
        }
        // Ordered adds: this block's performed in global memory, then the next key block may
        // add (the consumers have their buffers back meanwhile).
        if (order != nullptr && lane == 0) {
          bulk_ops_complete();
          publish_flag(order, n_block + 1);
        }
      }
      if (lane == 0) tma_store_wait<0>();
      return;
    }
    if (threadIdx.x != 0) return;
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Tile::kFullBias) cute::prefetch_tma_descriptor(p.tma_bias.get_tma_descriptor());
    const int heads_kv = f.num_heads / group;
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.rows_k, f.head_dim, heads_kv, p.tma_batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.rows_k, f.head_dim, heads_kv, p.tma_batch));
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tile::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tile::SmemLayoutKV{});
    const int k0 = packed ? seq.k0() : 0;
    Tensor gK = local_tile(domain_offset(make_coord(k0, 0), mK(_, _, kvh, tb)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    Tensor gV = local_tile(domain_offset(make_coord(k0, 0), mV(_, _, kvh, tb)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    if (!indexed) {
      kv_full.arrive_and_expect_tx(2 * Tile::kKVBytes);
      copy(p.tma_k.with(ss.kv_full), tKgK, tKsK);
      copy(p.tma_v.with(ss.kv_full), tVgV, tVsV);
    }

    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.rows_q, f.head_dim, f.num_heads, p.tma_batch));
    Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.rows_q, f.head_dim, f.num_heads, p.tma_batch));
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tile::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tile::SmemLayoutDo{});
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();  // (Q's, and dO's at the same depth)
    // dO's state at block t: Q's, or at head dim 256 its one stage's, derived from t (a second
    // state held took the producer warps' registers).
    // (a copy of Q's state: the callers copy it anyway)
    auto write_do_at = [&](int t) {
      if constexpr (Tile::kStagesDo == Tile::kStages) return write;
      else return one_stage_producer_state(t);
    };
    auto write_bias = cutlass::make_producer_start_state<BiasPipeline>();
    Tensor mB = p.tma_bias.get_tma_tensor(make_shape(f.seqlen_q, f.seqlen_k, p.bias_heads, p.bias_batch));
    Tensor sB = make_tensor(make_smem_ptr(ss.bias.data()), typename Tile::SmemLayoutP{});
    // Block t's bias tile: (kBlockM, kBlockN) of its (head, batch) slice.
    auto bias_tile = [&](int t) {
      return local_tile(mB(_, _, p.bias_heads == 1 ? 0 : head_of(t) / f.bias.head_div, p.bias_batch == 1 ? 0 : b),
                        Shape<Int<kBlockM>, Int<kBlockN>>{}, make_coord(m_block_of(t), n_block));
    };
    // (packed: read once; reloaded in each block it cost 84 B more spills in the producer warps)
    const int q0 = packed ? seq.q0() : 0;
    // (the head and query block stepped, as the consumers do: dividing t each block took the
    // registers of a 40-register TMA thread at head dim 256)
    int h = head_of(0), mb = walk_lo();
    for (int t = 0; t < walk_iters(); ++t) {
      const int m_block = m_at(mb);
      Tensor gQ = local_tile(domain_offset(make_coord(q0, 0), mQ(_, _, h, tb)), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(m_block, 0));
      Tensor gdO = local_tile(domain_offset(make_coord(q0, 0), mdO(_, _, h, tb)), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                              make_coord(m_block, 0));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] =
          tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      pipe_q.producer_acquire(write);
      copy(p.tma_q.with(*pipe_q.producer_get_barrier(write)), tQgQ, tQsQ(_, write.index()));
      const auto write_do = write_do_at(t);
      pipe_do.producer_acquire(write_do);
      copy(p.tma_do.with(*pipe_do.producer_get_barrier(write_do)), tdOgdO, tdOsdO(_, write_do.index()));
      ++write;
      if constexpr (Tile::kFullBias) {
        pipe_bias.producer_acquire(write_bias);  // the consumers have added block t - 1's tile
        auto [tBgB, tBsB] = tma_partition(p.tma_bias, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                          group_modes<0, 2>(bias_tile(t)));
        copy(p.tma_bias.with(*pipe_bias.producer_get_barrier(write_bias)), tBgB, tBsB);
        ++write_bias;
        if (t + 1 < walk_iters()) {
          auto [tNgB, tNsB] = tma_partition(p.tma_bias, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                            group_modes<0, 2>(bias_tile(t + 1)));
          prefetch(p.tma_bias, tNgB);
        }
      }
      if (++mb == walk_hi()) {
        mb = walk_lo();
        ++h;
      }
    }
    // Stay until the consumers have released every stage (no load outlives the CTA's smem).
    pipe_q.producer_tail(write);
    pipe_do.producer_tail(write_do_at(walk_iters()));
    if constexpr (Tile::kFullBias) pipe_bias.producer_tail(write_bias);
    return;
  }

  // ---------------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Tile::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;
  const int consumer = ctid / 128;
  // The named barriers of this consumer's dQ hand-over with the writer, their ids taken from the
  // consumer index where they are used (hoisted, the two ids were loop-carried registers, which
  // the windows variant spilled).
  const auto dq_empty = [&] { return Bar::kDqEmpty + opaque_int(consumer); };
  const auto dq_full = [&] { return Bar::kDqFull + opaque_int(consumer); };

  typename Tile::TiledMmaSdP mma_sdp;
  typename Tile::TiledMmadKV mma_dkv;
  typename Tile::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(Tile::kDqOneConsumer ? ctid % 128 : ctid);
  // The shared-memory operands (A, B) of a wgmma depend on the warpgroup only: they are taken
  // from the slice of the warpgroup's first thread, whose index comes from a shuffle of lane 0
  // so that the compiler knows it warp-uniform. The operand descriptors then live in uniform
  // registers (an add and a move per operand and wgmma); from the thread index itself every
  // wgmma rebuilt its descriptors in vector registers and moved them over (six instructions, and
  // the moves' latency, per wgmma: one wgmma per 32 scores of a thread at D = 128).
  const int wg_thread0 = __shfl_sync(0xffffffff, consumer, 0) * 128;
  auto wg_sdp = mma_sdp.get_thread_slice(wg_thread0);
  auto wg_dkv = mma_dkv.get_thread_slice(wg_thread0);
  auto wg_dq = mma_dq.get_thread_slice(Tile::kDqOneConsumer ? 0 : wg_thread0);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tile::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tile::SmemLayoutDo{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tile::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tile::SmemLayoutDot{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tile::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tile::SmemLayoutKt{});
  auto sP_at = [&](int buf) {
    return make_tensor(make_smem_ptr(ss.p.data() + buf * Tile::kPElems), typename Tile::SmemLayoutP{});
  };
  auto sPt_at = [&](int buf) {
    return make_tensor(make_smem_ptr(ss.p.data() + buf * Tile::kPElems), typename Tile::SmemLayoutPt{});
  };
  auto sdS_at = [&](int buf) {
    return make_tensor(make_smem_ptr(ss.ds.data() + buf * Tile::kPElems), typename Tile::SmemLayoutP{});
  };
  auto sdSt_at = [&](int buf) {
    return make_tensor(make_smem_ptr(ss.ds.data() + buf * Tile::kPElems), typename Tile::SmemLayoutPt{});
  };
  // (written by the consumers' stores only: its swizzle on offsets, as for P and dS below)
  Tensor sdQ = as_position_independent_swizzle_tensor(
      make_tensor(make_smem_ptr(ss.dq.data()), typename Tile::SmemLayoutdQ{}));

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  const bool bias_per_head = a.bsize_h == f.num_heads && a.bias_head_div == 1;
  const bool colsum_per_head = colsum && bias_per_head && group > 1;
  const int cols_valid = min(kBlockN, seq.len_k() - n0);
  auto consumers_sync = [] { NamedBarrier::sync(kConsumerThreads, Bar::kColSum); };
  auto colsum_flush = [&](int h) {
    colsum_flush_smem<Element, kBlockN, kColSumRows, kConsumerThreads>(
        a, ss.colsum.data(), read_again(ss.cta_b), h, n0, walk_cols_valid(), ctid, consumers_sync);
  };

  // Packed batches: the rows of a tile past its sequence's end are the next sequence's (zeros
  // only at the end of the tensor). Their scores, P and dS are exactly 0 (the tail test, the
  // row statistics), but 0 times a NaN or Inf there would reach this sequence's gradients: the
  // consumers zero those rows of K and V once, and of Q and dO in the block that has them, before
  // any product reads them (both consumers, then their barrier; the column sums' barrier id, at
  // points both consumers pass in the same order).
  // (the thread's offsets from an opaque index: hoisted out of the query-block loop, they were
  // loop-carried registers that the packed windows variant spilled)
  auto clear_tail_rows = [&](auto&& tile, int from, int rows) {
    for (int i = opaque_int(ctid); i < (rows - from) * kHeadDim; i += kConsumerThreads)
      tile(from + i / kHeadDim, i % kHeadDim) = Element(0.f);
  };
  if (n_iter > 0) {
    kv_full.wait(0);
    if (packed && cols_valid < kBlockN) {
      clear_tail_rows(sK, cols_valid, kBlockN);
      clear_tail_rows(sV, cols_valid, kBlockN);
      fence_smem_for_wgmma();
      consumers_sync();
    }
    // Q, dO and the rows advance together, one stage per query block: one state for the three
    // pipelines (three held across the loop took registers the key-row consumers lack).
    PipelineState read;
    // dO's state at block t: Q's, or at head dim 256 its one stage's, derived from t.
    auto read_do_at = [&](int t) {
      if constexpr (Tile::kStagesDo == Tile::kStages) return read;
      else return one_stage_consumer_state(t);
    };
    // (h, mb) = (head_of(t), m_block_of(t)), stepped rather than divided out of t (kWalkInSmem:
    // derived from t and the walk in shared memory, as is the pipelines' state; volatile reads,
    // so that none of it is held through the loop).
    int h = kvh * group, mb = m_lo;
    auto blocks = [&]() {
      if constexpr (Tile::kWalkInSmem) return walk_iters();
      else return n_iter;
    };
    // Head dim 256: consumer 1's arrivals for consumer 0's first turn (with the writer's).
    if (Tile::kDqTurns && consumer == 1) cutlass::arch::ClusterBarrier::arrive(&ss.dq_turn[0]);
    for (int t = 0; t < blocks(); ++t) {
      if constexpr (Tile::kWalkInSmem) {
        const int n_m_now = walk_n_m();
        h = kvh * group + t / n_m_now;
        mb = walk_lo() + t % n_m_now;
        read = pipeline_state_at<Tile::kStages>(uint32_t(t), false);
      }
      const auto read_do = read_do_at(t);
      const int m0 = m_at(mb) * kBlockM;
      const int buf = Tile::kDsBuffers == 2 ? t & 1 : 0;
      const int pbuf = Tile::kPBuffers == 2 ? t & 1 : 0;
      // Gate skipping on plain scores: a skipped cell (the stage's flag, the same for both
      // consumers: they hold the same query block) runs no product; its P, dS and G are 0. Its Q
      // and dO stages are awaited and released in turn, both consumers meet at the P / dS barrier
      // (which orders the dS buffers' reuse: the next block's stores follow the dQ products of
      // the one before) and the writer gets their turns without a tile.
      if constexpr (Tile::kGate && !Tile::kKeyRows) pipe_rows.consumer_wait(read);
      if constexpr (Tile::kGateSkip && !Tile::kKeyRows) {
        if (ss.rows[read.index()].gate_skip) {
          if constexpr (Tile::kGateTerms) {
            pipe_gate_terms.consumer_wait(one_stage_consumer_state(t));
            pipe_gate_terms.consumer_release(one_stage_consumer_state(t));
          }
          pipe_q.consumer_wait(read);
          pipe_do.consumer_wait(read_do);
          NamedBarrier::sync(kConsumerThreads, Bar::kPdS);
          if (want_dq) {
            NamedBarrier::sync(Bar::kDqThreads, dq_empty());
            NamedBarrier::arrive(Bar::kDqThreads, dq_full());
          }
          pipe_rows.consumer_release(read);
          pipe_q.consumer_release(read);
          pipe_do.consumer_release(read_do);
          ++read;
          if (++mb == m_hi) {
            mb = m_lo;
            ++h;
          }
          continue;
        }
      }

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      pipe_q.consumer_wait(read);
      if (packed) {
        const int rows_in_seq = seq.rows_valid(m0, kBlockM);
        if (rows_in_seq < kBlockM) {
          pipe_do.consumer_wait(read_do);
          clear_tail_rows(sQ(_, _, read.index()), rows_in_seq, kBlockM);
          clear_tail_rows(sdO(_, _, read_do.index()), rows_in_seq, kBlockM);
          fence_smem_for_wgmma();
          consumers_sync();
        }
      }
      {
        Tensor tSrQ = wg_sdp.partition_fragment_A(sQ)(_, _, _, read.index());
        Tensor tSrK = wg_sdp.partition_fragment_B(sK);
        gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_sdp, tSrQ, tSrK, acc_s);
      }
      auto issue_dp = [&] {
        pipe_do.consumer_wait(read_do);
        Tensor tdPrdO = wg_sdp.partition_fragment_A(sdO)(_, _, _, read_do.index());
        Tensor tdPrV = wg_sdp.partition_fragment_B(sV);
        gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_sdp, tdPrdO, tdPrV, acc_dp);
      };
      // Plain scores: dP runs while S is transformed. Key rows: dP is issued after the
      // per-element tests, whose position and bound reads would otherwise sit beside dP's
      // accumulators in flight (ptxas: 432 B of spills that way). dO in one stage: after the
      // transform too, which its load may still overlap.
      constexpr bool kDpAfterTransform = Tile::kKeyRows || Tile::kStagesDo == 1;
      if constexpr (!kDpAfterTransform) issue_dp();
      pipe_rows.consumer_wait(read);
      const auto& st = ss.rows[read.index()];
      // The window from the kernel arguments (dense) or from the block's stage (packed: the
      // sequence's lengths, which the loader warp copies there; held across the loop, or read
      // from memory in each block, they spilled). Key rows test positions (the gathered keys'
      // own, else the index): one window, on the original keys' count with gathered keys.
      const WindowMask win =
          packed ? WindowMask{st.seq_len[0], st.seq_len[1], f.window_left, f.window_right}
                 : WindowMask{f.seqlen_q, Tile::kKeyRows && f.kpos.ptr != nullptr ? f.kpos.seqlen_k_original : f.seqlen_k,
                              f.window_left, f.window_right};
      const int rows_valid = min(kBlockM, int(win.seqlen_q) - m0);
      float row_m[kRows], row_log2l[kRows], delta[kRows];
      bwd_load_row_stats<kRows, /*kReadAll=*/true>(tScS_rc, st.m, a.row_log2l != nullptr ? st.log2l : nullptr,
                                                   st.delta, rows_valid, row_m, row_log2l, delta);

      gemm_wait<kDpAfterTransform ? 0 : 1>(acc_s);  // S done; dP may still run
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      if constexpr (Tile::kKeyRows) {
        // s = scale * qk, then + bias (two roundings, as the general transform: the exact path's
        // statistics kernel computes m and l with it, and a single-key row must give P = 1
        // exactly), then the tests on positions and query bounds.
        const auto& kr = st.keys;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) *= f.scale;
        add_key_bias(s_rc, tScS_rc, kr.bias, 1.f);
        // Gate skipping: a skipped cell runs without the gate's value (its rows' statistic +inf
        // makes P and dS 0, so its G too). (The flag of the block's stage, the same for both
        // consumers: they hold the same query block.)
        if constexpr (Tile::kGateTerms) {  // (its logarithm terms from the term warp's slot)
          const auto read_t = one_stage_consumer_state(t);
          pipe_gate_terms.consumer_wait(read_t);
          if (!Tile::kGateSkip || !st.gate_skip)
            add_gate_term_bytes(s_rc, tScS_rc, ss.gate_terms.data(), ctid, st.alpha, kr.delta, f.scale, f.gate.linear);
          pipe_gate_terms.consumer_release(read_t);
        } else if constexpr (Tile::kGate) {
          if (!Tile::kGateSkip || !st.gate_skip) add_gate_scores(s_rc, tScS_rc, st.alpha, kr.delta, f.scale, f.gate.linear);
        }
        const PositionTest pt{kr.pos, win, Tile::kKeyRowEndDelta};
        if (bounded_block_needs_mask<kBlockN>(pt.win, kr.pos, m0, kBlockM, kr.end_min))
          mask_and_bias_scores_impl<false, false, true, true, true, float, kBlockN>(s_rc, tScS_rc, m0, n0, win, nullptr, 0,
                                                                                   nullptr, 0, &pt);
        issue_dp();
      } else {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) *= f.scale;
        // The gate alone (plain scores): on the scaled scores, before the window / tail test (its
        // logarithm terms from the term warp's slot where it computes them).
        if constexpr (Tile::kGateTerms) {
          const auto read_t = one_stage_consumer_state(t);
          pipe_gate_terms.consumer_wait(read_t);
          add_gate_term_bytes(s_rc, tScS_rc, ss.gate_terms.data(), ctid, st.alpha, ss.gate_delta.data(), f.scale,
                              f.gate.linear);
          pipe_gate_terms.consumer_release(read_t);
        } else if constexpr (Tile::kGate) {
          add_gate_scores(s_rc, tScS_rc, st.alpha, ss.gate_delta.data(), f.scale, f.gate.linear);
        }
        if constexpr (Tile::kFullBias) {
          // + bias (two roundings, as the general transform; its tile landed by TMA), then the
          // window / tail test
          const auto read_bias = one_stage_consumer_state(t);
          pipe_bias.consumer_wait(read_bias);
          add_bias_sw128<Element, kBlockM>(s_rc, tScS_rc, ss.bias.data(), 1.f);
          pipe_bias.consumer_release(read_bias);
        }
        // Windows with sinks: the window's test (causal and the tails with it: a key past the
        // sequence lies above every valid query's diagonal) on the tiles the loader marked.
        if constexpr (Tile::kWindows) {
          if (st.window_on) {
            // (the coordinates from the thread index read afresh: held through the loop, a piece
            // of them was spilled)
            Tensor tc = mma_sdp.get_thread_slice(fresh_thread_index() - 128).partition_C(cS);
            apply_sink_window(s_rc, make_tensor(tc.data(), acc_rowcol(tc.layout())), SinkWindowTest::load(ss.window), m0,
                              n0);
          }
        } else if (win.block_needs_mask(m0, kBlockM, kBlockN, n_block)) {
          mask_and_bias_scores<false, true, Element, kBlockN>(s_rc, tScS_rc, m0, n0, win, nullptr, 0, nullptr, 0);
        }
        if constexpr (kDpAfterTransform) issue_dp();
      }
      gemm_wait<0>(acc_dp);
      bwd_p_ds(s_rc, dp_rc, row_m, row_log2l, delta);
      // An fp32 bias's column sums from dS in fp32 (each warp its own row of them); a 16-bit
      // bias's come from the product below.
      if constexpr (colsum) {
        if (f.bias_fp32) colsum_add_smem<kBlockN, kColSumRows>(dp_rc, tScS_rc, ss.colsum.data(), ctid);
      }
      // (the gate's gradients read the stage's rows once the products are issued)
      if constexpr (!Tile::kGate) pipe_rows.consumer_release(read);

      {  // P, dS -> shared memory (stmatrix). P's buffer is free: this consumer's dV product of
         // t - 1 is complete (its wait). dS[t % 2] was last read by the dQ products of t - 2,
         // which both consumers finished before the barrier of t - 1. P goes first: its
         // registers are free while the column sums of dS run.
        // The stores' addresses: the 128-byte swizzle applied to the offset within the
        // 1024-byte-aligned buffer (a position-independent swizzle), then added to its 32-bit
        // shared address. Applied to the 64-bit generic pointer, as the swizzled layout does, each
        // address took five or six instructions of 64-bit arithmetic, recomputed in every block.
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
        // (windows with sinks: from the thread index read afresh, as the window's test above; the
        // addresses' pieces held through the loop were spilled there)
        auto thr_r2s = r2s.get_thread_slice(Tile::kWindows ? fresh_thread_index() - 128 : ctid);
        Tensor rP = make_tensor<Element>(acc_s.layout());
        convert_fragment<Element, false>(acc_s, rP);
        copy(r2s, thr_r2s.retile_S(rP), thr_r2s.partition_D(as_position_independent_swizzle_tensor(sP_at(pbuf))));
        Tensor rdS = make_tensor<Element>(acc_dp.layout());
        convert_fragment<Element, true>(acc_dp, rdS);
        copy(r2s, thr_r2s.retile_S(rdS), thr_r2s.partition_D(as_position_independent_swizzle_tensor(sdS_at(buf))));
      }
      fence_smem_for_wgmma();
      NamedBarrier::sync(kConsumerThreads, Bar::kPdS);

      // dbias's column sums (kColSum) first, then dV += P^T dO, dQ = dS K, dK += dS^T Q: dQ is
      // staged for its writer while dK still runs; the column sums are added once dK is done.
      typename Tile::TiledMmaColSum mma_cs;
      Tensor acc_cs = partition_fragment_C(mma_cs, Shape<Int<kBlockN>, _8>{});
      if (colsum && !f.bias_fp32) {
        auto wg_cs = mma_cs.get_thread_slice(wg_thread0);
        Tensor tCSrdSt = wg_cs.partition_fragment_A(sdSt_at(buf));
        Tensor tCSrOnes =
            wg_cs.partition_fragment_B(make_tensor(make_smem_ptr(ss.ones.data()), typename Tile::SmemLayoutOnes{}));
        gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_cs, tCSrdSt, tCSrOnes, acc_cs);
      }
      auto issue_dk = [&] {
        Tensor tdKrdSt = wg_dkv.partition_fragment_A(sdSt_at(buf));
        Tensor tdKrQt = wg_dkv.partition_fragment_B(sQt);
        gemm_issue</*kZeroInit=*/false, /*kRegA=*/false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, read.index()), acc_dk);
      };
      {
        Tensor tdVrPt = wg_dkv.partition_fragment_A(sPt_at(pbuf));
        Tensor tdVrdOt = wg_dkv.partition_fragment_B(sdOt);
        gemm_issue</*kZeroInit=*/false, /*kRegA=*/false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, read_do.index()), acc_dv);
      }
      // D = 128 and 256: this consumer's half of the columns; D = 64: every column, in the blocks
      // of this consumer's parity. All from all of dS and K.
      const bool dq_here = want_dq && Tile::computes_dq(consumer, t);
      // dO in one stage: released once the dV product has read it, so that the next block's
      // load starts while this block's dQ and dK run.
      const bool do_early = Tile::kStagesDo == 1 && dq_here;
      if (dq_here) {
        using DqShape = Shape<Int<kBlockM>, Int<kHeadDim>>;
        Tensor acc_dq = partition_fragment_C(mma_dq, DqShape{});
        {
          // Head dim 256: the consumers take turns on one staging buffer. This consumer's turn
          // comes once the other one has stored its tile and the writer has read it; each turn
          // barrier completes one phase a block (consumer 1's: consumer 0's tile of block t;
          // consumer 0's: consumer 1's of block t - 1, phase 0 the initial arrivals). mbarriers,
          // whose arrivals release each thread's own stores, so that the two consumers' writes of
          // the buffer are ordered directly and not only through the writer's barriers. dK is
          // issued first and the turn awaited before the dQ product: awaited among dQ's live
          // accumulators, the wait's loop made the consumers spill.
          if constexpr (Tile::kDqTurns) {
            issue_dk();
            cutlass::arch::ClusterBarrier::wait(&ss.dq_turn[consumer], t & 1);
          }
          Tensor tdQrdS = wg_dq.partition_fragment_A(sdS_at(buf));
          Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);
          gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_dq, tdQrdS, tdQrKt, acc_dq);
        }
        if constexpr (!Tile::kDqTurns) issue_dk();
        gemm_wait<Tile::kDqTurns ? 0 : 1>(acc_dq);  // dV and dQ done (head dim 256: dK too)
        warpgroup_fence_operand(acc_dv);
        if (do_early) pipe_do.consumer_release(read_do);
        {
          // Packed batches: the writer adds a block past the sequence's end by whole boxes, into the
          // next sequence's rows too. Those rows of dS are 0, but 0 times an Inf in this sequence's
          // K is NaN: they are zeroed. (Adding an exact 0 changes no sum, in any order: dq_accum
          // starts at +0 and a sum of floats is -0 only when both terms are.)
          if constexpr (packed) {
            if (rows_valid < kBlockM) {
              Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(DqShape{}));
              CUTE_UNROLL
              for (int i = 0; i < size(acc_dq); ++i)
                if (get<0>(tdQcdQ(i)) >= rows_valid) acc_dq(i) = 0.f;
            }
          }
          // dQ -> this consumer's boxes once the writer has read the previous ones (head dim
          // 256: its turn, awaited above).
          if constexpr (!Tile::kDqTurns) NamedBarrier::sync(Bar::kDqThreads, dq_empty());
          if constexpr (Tile::kDqOneConsumer)
            store_acc_to_smem(acc_dq, thr_dq.partition_C(local_tile(sdQ, Shape<Int<kBlockM>, Int<64>>{},
                                                                    make_coord(0, consumer))));
          else if constexpr (!Tile::kDqTurns)  // (D = 128: both consumers' columns)
            store_acc_to_smem(acc_dq, thr_dq.partition_C(sdQ));
          else {  // D = 256: this consumer's columns onto the buffer, where consumer 0's partition
                  // puts them (the two consumers' partitions differ by the columns' offset alone);
                  // the addresses from an opaque thread index (held across the loop, they spilled)
            const int tid = opaque_int(ctid % 128);
            Tensor sdQ_wide = make_tensor(make_smem_ptr(ss.dq.data()), typename Tile::SmemLayoutdQWide{});
            store_acc_to_smem(acc_dq,
                              mma_dq.get_thread_slice(tid).partition_C(as_position_independent_swizzle_tensor(sdQ_wide)));
          }
          cutlass::arch::fence_view_async_shared();  // the writer's TMA reads them
          NamedBarrier::arrive(Bar::kDqThreads, dq_full());
          // (head dim 256: the other consumer's turn follows this store)
          if constexpr (Tile::kDqTurns) cutlass::arch::ClusterBarrier::arrive(&ss.dq_turn[1 - consumer]);
        }
      } else {
        issue_dk();
        // The writer's turn without a dQ tile from this consumer (it may store dS[t] as dbias).
        // (head dim 256 never comes here with a turn to take: plain scores have no dbias tile,
        // and both consumers compute dQ whenever it is wanted)
        if (!Tile::kDqTurns && (want_dq || dbias_tiles)) {
          NamedBarrier::sync(Bar::kDqThreads, dq_empty());
          NamedBarrier::arrive(Bar::kDqThreads, dq_full());
        }
      }
      // The gate's gradients from dS in fp32 while the dK product runs (off the path from dS to
      // the products; dQ's registers are free by now): this consumer's 64 keys of the block (its
      // dalpha slice), its warp's row of the column sums.
      if constexpr (Tile::kGate) {
        static_assert(kBlockN == kGateCell && kGateCell % kBlockM == 0, "a block lies in one cell of gate skipping");
        // (a skipped cell's G is 0 from its dS: a test here cost the D = 128 consumers spills)
        const float* gate_delta;
        if constexpr (Tile::kKeyRows) gate_delta = st.keys.delta;
        else gate_delta = ss.gate_delta.data();
        gate_grads_sm90<kBlockN, 4>(a, dp_rc, tScS_rc, st.alpha, gate_delta, ss.gate_col.data(),
                                    seq.stat_offset(h) + m0, rows_valid, n0 + 64 * consumer, ctid);
        pipe_rows.consumer_release(read);
      }
      gemm_wait<0>(acc_dk);
      warpgroup_fence_operand(acc_dv);
      if (colsum && !f.bias_fp32) {
        warpgroup_fence_operand(acc_cs);
        colsum_acc_add_smem(acc_cs, ss.colsum.data(), ctid);
      }
      pipe_q.consumer_release(read);
      if (!do_early) pipe_do.consumer_release(read_do);
      ++read;
      if constexpr (Tile::kKeyRows) {
        if (colsum_per_head && mb == m_hi - 1) colsum_flush(h);
      }
      if constexpr (!Tile::kWalkInSmem) {
        if (++mb == m_hi) {
          mb = m_lo;
          ++h;
        }
      }
    }
  }

  // dbias pieces nothing reached, then dK / dV (the CTA's coordinates and the key block's valid
  // columns read again, above).
  const int b_out = read_again(ss.cta_b);
  const int kvh_out = read_again(ss.cta_kvh);
  const int cols_stored = walk_cols_valid();
  const int ctid_out = fresh_thread_index() - 128;  // (its derived offsets are not held through the loop either)
  if constexpr (Tile::kKeyRows) {
    if (colsum) {
      if (colsum_per_head) {
        if (walk_iters() == 0)
          for (int h = kvh_out * group; h < (kvh_out + 1) * group; ++h) colsum_flush(h);
      } else {
        colsum_flush(kvh_out * group);
      }
    }
  }
  // The gate's ddelta: every key of the block (0 where no query reached it).
  if constexpr (Tile::kGate) {
    if (a.ddelta != nullptr) {
      consumers_sync();  // (every warp's last column sums added)
      store_ddelta_sums<Element, kBlockN, 4, kConsumerThreads>(a, ss.gate_col.data(), b_out, kvh_out, n0, cols_stored,
                                                               ctid_out);
    }
  }
  const int64_t k_row = SeqBoundsOf<kPacked ? kSeqFormPacked : kSeqFormDense>(f, b_out).k0() + n0;
  Element* gdK = static_cast<Element*>(a.dk) + int64_t(b_out) * a.dk_bs + k_row * a.dk_rs + int64_t(kvh_out) * a.dk_hs;
  Element* gdV = static_cast<Element*>(a.dv) + int64_t(b_out) * a.dv_bs + k_row * a.dv_rs + int64_t(kvh_out) * a.dv_hs;
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tcKV = mma_dkv.get_thread_slice(ctid_out).partition_C(cKV);
  bwd_store_acc_pairs<Element>(acc_dk, tcKV, gdK, a.dk_rs, cols_stored, f.head_dim, f.scale);
  bwd_store_acc_pairs<Element>(acc_dv, tcKV, gdV, a.dv_rs, cols_stored, f.head_dim, 1.f);
#endif
}

}  // namespace dmattn::cuda::sm90
