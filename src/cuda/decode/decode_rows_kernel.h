// Split-KV decode for more packed query rows than one 16-row tile (speculative decoding: a few
// queries times the query heads of a kv head; docs/decode.md). One CTA per (64-row chunk, key
// split, kv head, batch): each warp owns one 16-row tile, and every warp reads every key of the
// split from one CTA-wide cp.async ring, so that a K / V row crosses from memory to the SM once
// for the 64 rows (decode_kernel.h, one tile per CTA, would read it once per 16-row chunk).
// The per-tile work is decode_kernel.h's, split in two (tile_scores: q K^T; tile_update: the
// softmax and P V) on tiles of 32 keys, twice the keys of decode_kernel.h's steps, so that a
// warp can start the next tile's products before this tile's softmax (software pipelining).
#pragma once

#include "cuda/decode/decode_balanced.h"
#include "cuda/decode/decode_kernel.h"

namespace dmattn::cuda {

namespace decode_detail {

// Geometry per head-dim bucket kD (64 / 128; at 256 the accumulators of a 16-row tile and the
// ring's addressing spill, so those rows take decode_kernel.h's 16-row chunks): four warps, 64
// rows, q in registers; three stages of 64 keys of K and V: 48 / 96 KB, two CTAs an SM.
template <int kD>
struct DecodeRowsTile {
  static_assert(kD <= kDecodeRowsMaxHeadDim, "decode_rows_kernel: head dims up to 128");
  static constexpr int kWarps = 4;
  static constexpr int kRows = kWarps * kDecodeRows;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStageKeys = 64;
  static constexpr int kStages = 3;
  static constexpr int kStageBytes = 2 * kStageKeys * kD * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};


// Where a CTA of a 64-row kernel stands: its row chunk c0 .. c0 + cta_rows - 1 of the sequence's
// packed rows (total_rows of them), key split, kv head and batch (grid (row_chunks * num_splits,
// heads_kv, batch), the chunk fastest), and its warp's 16 rows r0 .. r0 + nrows - 1 (nrows <= 0:
// a warp past the chunk's rows). idle: nothing to do (a packed batch: another launch's sequence,
// or a shorter one).
struct RowsChunk {
  int split, kvh, warp, lane;
  DecodeSeq seq;
  int total_rows, c0, cta_rows, r0, nrows;
  __device__ __forceinline__ bool idle() const { return seq.splits == 0 || cta_rows <= 0; }
};
__device__ __forceinline__ RowsChunk rows_chunk(const DecodeArgs& a, int chunk_rows) {
  RowsChunk c;
  const int chunk = blockIdx.x % a.row_chunks;
  c.split = blockIdx.x / a.row_chunks;
  c.kvh = blockIdx.y;
  c.warp = threadIdx.x / 32, c.lane = threadIdx.x % 32;
  c.seq = decode_seq(a, blockIdx.z, chunk_rows);
  c.total_rows = c.seq.len_q * a.group;
  c.c0 = chunk * chunk_rows;
  c.cta_rows = min(chunk_rows, c.total_rows - c.c0);
  c.r0 = c.c0 + c.warp * kDecodeRows;
  c.nrows = min(kDecodeRows, c.total_rows - c.r0);
  return c;
}

// The pages of a stage's keys [jt, min(jt + kStageKeys, ke)) in a paged cache whose pages hold at
// least a stage's keys: the page of jt and the next one (read only where the stage crosses into
// it), and jt's row on its page. Two independent table reads, which a kernel issues a stage
// ahead of the copies that use them (a table read before each stage's copies is a dependent
// global load on the copying threads' path).
struct StagePages {
  int64_t first, second;
  int row0;
};
template <int kStageKeys>
__device__ __forceinline__ StagePages stage_pages(const DecodeArgs& a, const DecodeSeq& seq, int jt, int ke) {
  StagePages pg{seq.bm, seq.bm, 0};
  if (jt >= ke) return pg;
  const int p = jt / a.page_size;
  pg.row0 = jt - p * a.page_size;
  const int32_t* row = a.block_table + seq.bm * a.bt_stride + p;
  pg.first = row[0];
  pg.second = min(ke, jt + kStageKeys) - 1 - jt + pg.row0 >= a.page_size ? row[1] : pg.first;
  return pg;
}
// Whether a stage's keys are found without a table read per key: a contiguous cache, or pages
// of at least a stage (else gathered rows or smaller pages); and whether a paged cache's stages
// take stage_pages.
template <int kStageKeys>
__host__ __device__ __forceinline__ bool keys_by_stage(const DecodeArgs& a) {
  return a.key_rows == nullptr && (a.block_table == nullptr || a.page_size >= kStageKeys);
}
template <int kStageKeys>
__device__ __forceinline__ bool pages_by_stage(const DecodeArgs& a) {
  return a.block_table != nullptr && keys_by_stage<kStageKeys>(a);
}

// Indexed keys (DecodeArgs::key_rows, no pages) a stage ahead: the source rows of the thread's
// keys of the stage at jt (StageCopies' rows r_t + u kPassRows), -1 past ke. The narrow kernel
// reads them one stage before it issues that stage's copies, so that no copy waits on its index.
template <int kPasses>
struct StageRows {
  int32_t row[kPasses];
};

// The copies of one stage (kStageKeys keys of K and V, from key jt on) by a CTA of kThreads
// threads into the K / V tiles at dk and dk + kStageKeys * kD: a thread copies one 16-byte chunk
// column c_t of rows r_t, r_t + kPassRows, ... (kPassRows a multiple of 8, so that the rows'
// swizzle is the same and the destination moves by whole rows: `row_step` elements a row; in a
// contiguous cache the source moves by one row stride per pass). `offset(r, c)`: the element
// offset of chunk c of row r in a tile (the kernel's layout). Keys at or past ke are
// zero-filled, never read (their rows may lie behind the batch's length). A paged cache takes
// the stage's pages from `pages` (pages_by_stage), or else reads the table per key.
template <typename Element, int kD, int kStageKeys, int kThreads>
struct StageCopies {
  static constexpr int kChunks = kD / 8;
  static constexpr int kPassRows = kThreads / kChunks, kPasses = kStageKeys / kPassRows;
  static_assert(kThreads % kChunks == 0 && kPassRows % 8 == 0 && kStageKeys % kPassRows == 0,
                "whole rows a pass, whole swizzle periods a pass, whole passes a stage");
  int c_t, r_t, so_t, pass_step;
  bool c_in;
  template <typename Offset>
  __device__ __forceinline__ StageCopies(const DecodeArgs& a, Offset offset, int row_step)
      : c_t(threadIdx.x % kChunks), r_t(threadIdx.x / kChunks), so_t(offset(r_t, c_t)),
        pass_step(kPassRows * row_step), c_in(c_t * 8 < a.head_dim) {}
  using Rows = StageRows<kPasses>;
  __device__ __forceinline__ Rows rows_of(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int jt, int ke) const {
    Rows r;
    const int32_t* index = a.key_rows + seq.bm * a.kr_sb + kvh * a.kr_sh;
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      const int j = jt + r_t + u * kPassRows;
      r.row[u] = j < ke ? index[j] : -1;
    }
    return r;
  }
  // The stage's copies from indexed keys (rows_of's); a row outside [0, kr_rows) is zeros, as
  // key_row reads it.
  __device__ __forceinline__ void issue_rows(const DecodeArgs& a, const DecodeSeq& seq, int kvh, const Rows& rows,
                                             Element* tile_k) const {
    const Element* kbase = static_cast<const Element*>(a.k);
    const Element* vbase = static_cast<const Element*>(a.v);
    Element* dk = tile_k + so_t;
    Element* dv = dk + kStageKeys * kD;
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      const int row = rows.row[u];
      const bool ok = c_in && row >= 0 && row < a.kr_rows;
      const KeyRow at = key_row_at(a, seq.bm, ok ? row : 0, kvh);
      cp_async_16(dk + u * pass_step, kbase + (ok ? at.k + c_t * 8 : 0), ok ? 16 : 0);
      cp_async_16(dv + u * pass_step, vbase + (ok ? at.v + c_t * 8 : 0), ok ? 16 : 0);
    }
  }
  __device__ __forceinline__ void issue(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int jt, int ke,
                                        Element* tile_k, const StagePages* pages = nullptr) const {
    const Element* kbase = static_cast<const Element*>(a.k);
    const Element* vbase = static_cast<const Element*>(a.v);
    Element* dk = tile_k + so_t;
    Element* dv = dk + kStageKeys * kD;
    if (a.block_table == nullptr && a.key_rows == nullptr) {
      KeyRow at = key_row_at(a, seq.bm, seq.k0 + jt + r_t, kvh);
      const int64_t step_k = int64_t(kPassRows) * a.k_st.row_stride, step_v = int64_t(kPassRows) * a.v_st.row_stride;
      if (c_in && jt + kStageKeys <= ke) {  // a whole stage: every row read, no test or select a copy
        const Element* sk = kbase + at.k + c_t * 8;
        const Element* sv = vbase + at.v + c_t * 8;
#pragma unroll
        for (int u = 0; u < kPasses; ++u) {
          cp_async_16_whole(dk + u * pass_step, sk);
          cp_async_16_whole(dv + u * pass_step, sv);
          sk += step_k, sv += step_v;
        }
        return;
      }
#pragma unroll
      for (int u = 0; u < kPasses; ++u) {
        const bool ok = c_in && jt + r_t + u * kPassRows < ke;
        cp_async_16(dk + u * pass_step, kbase + (ok ? at.k + c_t * 8 : 0), ok ? 16 : 0);
        cp_async_16(dv + u * pass_step, vbase + (ok ? at.v + c_t * 8 : 0), ok ? 16 : 0);
        at.k += step_k, at.v += step_v;
      }
    } else if (pages != nullptr && pages_by_stage<kStageKeys>(a)) {
#pragma unroll
      for (int u = 0; u < kPasses; ++u) {
        const int r = r_t + u * kPassRows;
        const bool ok = c_in && jt + r < ke;
        const int row = pages->row0 + r;
        const bool next = row >= a.page_size;
        const KeyRow at = key_row_at(a, next ? pages->second : pages->first, next ? row - a.page_size : row, kvh);
        cp_async_16(dk + u * pass_step, kbase + (ok ? at.k + c_t * 8 : 0), ok ? 16 : 0);
        cp_async_16(dv + u * pass_step, vbase + (ok ? at.v + c_t * 8 : 0), ok ? 16 : 0);
      }
    } else {
#pragma unroll 2
      for (int u = 0; u < kPasses; ++u) {
        const int j = jt + r_t + u * kPassRows;
        KeyRow at{0, 0};
        const bool ok = c_in && j < ke && key_row(a, seq, kvh, j, at);
        cp_async_16(dk + u * pass_step, kbase + at.k + c_t * 8, ok ? 16 : 0);
        cp_async_16(dv + u * pass_step, vbase + at.v + c_t * 8, ok ? 16 : 0);
      }
    }
  }
};

// A warp's 16 rows (packed rows r0 .., nrows of them) complete over split `split`: normalized
// and stored, into the output (direct: one split, or a balanced share's whole row) or the
// split's partial rows and lse (kBalanced: `split` is the share's slot, balanced_slot_row). o, m, l in the
// m16n8 accumulator layout (rows lane / 4 + 8 hf). An empty row (no allowed key in this split)
// is 0 with lse -inf; a NaN sum stays NaN.
template <typename Element, bool kBalanced = false, int kNd>
__device__ __forceinline__ void store_rows(const DecodeArgs& a, const DecodeSeq& seq, int split, int kvh, int r0,
                                           int nrows, int lane, const float (&o)[kNd][4], const float (&m)[2],
                                           const float (&l)[2], bool direct) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = lane / 4 + 8 * hf;
    const float sum = quad_sum(l[hf]);
    if (r >= nrows) continue;
    const bool empty = sum == 0.f;
    const float mu = m[hf] == -INFINITY ? 0.f : m[hf];
    const float lse = empty ? -INFINITY : mu + __log2f(sum) * kDecodeLn2;
    const int row = r0 + r, qi = row / a.group, h = kvh * a.group + row % a.group;
    const int64_t prow = kBalanced ? balanced_slot_row(a, split, h, qi) : partial_row(a, seq, split, h, qi);
    Element* dst = static_cast<Element*>(a.out) + seq.bm * a.o_st.batch_stride + (seq.q0 + qi) * a.o_st.row_stride +
                   h * a.o_st.head_stride;
#pragma unroll
    for (int dn = 0; dn < kNd; ++dn) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = dn * 8 + (lane % 4) * 2 + e;
        if (d >= a.head_dim) continue;
        const float out = empty ? 0.f : o[dn][2 * hf + e] / sum;
        if (direct) dst[d] = Element(saturate_keep_nan<Element>(out));
        else a.part_out[prow * a.head_dim + d] = out;
      }
    }
    if (lane % 4 == 0) {
      if (direct) a.lse[seq.bm * a.lse_bs + h * a.lse_hs + seq.q0 + qi] = lse;
      else a.part_lse[prow] = lse;
    }
  }
}

}  // namespace decode_detail

// Grid (row_chunks * num_splits, heads_kv, batch) with 64-row chunks,
// DecodeRowsTile<kD>::kThreads threads and kSmemBytes of dynamic shared memory. kOperands: mask
// / bias entries read from global memory at each 32-key tile (any layout).
template <typename Element, int kD, bool kOperands>
__global__ void __launch_bounds__(decode_detail::DecodeRowsTile<kD>::kThreads, 2)
    decode_rows_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  using Tile = DecodeRowsTile<kD>;
  constexpr int kStageKeys = Tile::kStageKeys, kStages = Tile::kStages;
  constexpr int kNd = kD / 8;

  launch_dependents();  // (the splits' merge may be placed now: it waits for this grid's end)
  const RowsChunk rc = rows_chunk(a, Tile::kRows);
  if (rc.idle()) return;
  const DecodeSeq& seq = rc.seq;
  const int split = rc.split, kvh = rc.kvh, lane = rc.lane, c0 = rc.c0, cta_rows = rc.cta_rows;
  // The warp's tile; a warp past the chunk's rows only helps with the copies.
  const int r0 = rc.r0, nrows = rc.nrows;
  const bool computes = nrows > 0;

  // Splits on whole stages, so that a stage never straddles two.
  const SplitKeys keys = split_keys(a, seq, c0, cta_rows, split, kStageKeys);
  const int kb = keys.begin, ke = keys.end;

  int row_i[2], row_h[2];
  accumulator_rows(a, kvh, computes ? r0 : c0, computes ? nrows : 1, lane, row_i, row_h);
  const int i_first = r0 / a.group, i_last = (r0 + max(nrows, 1) - 1) / a.group;  // the warp's queries

  // q's A fragments of the warp's tile in registers (decode_kernel.h's layout; 0 past its rows).
  extern __shared__ __align__(16) char decode_smem[];
  uint32_t qa[kD / 16][4];
  load_q_fragments<Element>(a, seq, kvh, r0, nrows, lane, qa);
  const auto q_fragment = [&](int ks, uint32_t (&f)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = qa[ks][e];
  };

  float o[kNd][4], m[2], l[2];
  start_rows(o, m, l);

  // The CTA's threads copy stage it (keys kb + it * kStageKeys onwards) together; keys past the
  // split's end are zero-filled, never read (their rows may lie behind the batch's length).
  const auto stage_k = [&](int it) {
    return reinterpret_cast<Element*>(decode_smem + (it % kStages) * Tile::kStageBytes);
  };
  const int stages = ke > kb ? (ke - kb + kStageKeys - 1) / kStageKeys : 0;
  const StageCopies<Element, kD, kStageKeys, Tile::kThreads> copies(a, [](int r, int c) { return tile_offset<kD>(r, c); }, kD);
  const auto issue = [&](int it) {
    if (it < stages) copies.issue(a, seq, kvh, kb + it * kStageKeys, ke, stage_k(it));
    cp_async_commit();
  };

  // Tiles of 32 keys, two a stage, software-pipelined: the scores of tile t + 1 are computed
  // before tile t's softmax and values, so that the tensor cores work while the softmax waits on
  // its dependencies (with two warps a scheduler, the other warp alone cannot cover it). A stage
  // is waited for when its first tile's scores start; its slot is then refilled with the next
  // stage, the slot of two stages back (every warp has passed its last use: the values of that
  // stage's second tile, before this barrier).
  constexpr int kTileKeys = 32;
  const int tiles = ke > kb ? (ke - kb + kTileKeys - 1) / kTileKeys : 0;
  const OperandRows op_rows = operand_rows(a, seq, row_h, row_i);
  StepOperandsOf<kTileKeys> op_a, op_b;
  float s_a[kTileKeys / 8][4], s_b[kTileKeys / 8][4];
  const auto tile_keys = [&](int t) {
    return reinterpret_cast<const Element*>(stage_k(t / 2)) + (t % 2) * kTileKeys * kD;
  };
  const auto tile_start = [&](int t) { return kb + t * kTileKeys; };
  // The scores (and the mask / bias entries) of tile t: t even begins a stage.
  const auto begin_tile = [&](int t, float (&s)[kTileKeys / 8][4], StepOperandsOf<kTileKeys>& op) {
    if (t % 2 == 0) {
      cp_async_wait<0>();  // the stage's copies (the only ones in flight) have landed ...
      __syncthreads();     // ... everyone's; every warp is done with the slot refilled next
      issue(t / 2 + 1);
    }
    if (!computes) return;
    if constexpr (kOperands) load_step_operands(a, op_rows, tile_start(t), ke, lane, op);
    tile_scores<Element, kD, kTileKeys>(tile_keys(t), q_fragment, s, lane);
  };
  const auto end_tile = [&](int t, float (&s)[kTileKeys / 8][4], const StepOperandsOf<kTileKeys>& op) {
    if (!computes) return;
    const int jt = tile_start(t);
    const bool inside = tile_inside(a, keys.off, i_first, i_last, jt, kTileKeys, ke);
    tile_update<Element, kD, kOperands, kTileKeys>(a, s, tile_keys(t) + kStageKeys * kD, jt, ke, keys.off, row_i,
                                                   op, m, l, o, lane, inside);
  };
  issue(0);
  if constexpr (kOperands) {  // one tile at a time: a second set of scores and entries spilled
    for (int t = 0; t < tiles; ++t) {
      begin_tile(t, s_a, op_a);
      end_tile(t, s_a, op_a);
    }
  } else {
    if (tiles > 0) begin_tile(0, s_a, op_a);
    for (int t = 0; t < tiles; t += 2) {  // tile t's scores are in s_a
      if (t + 1 < tiles) begin_tile(t + 1, s_b, op_b);
      end_tile(t, s_a, op_a);
      if (t + 1 < tiles) {
        if (t + 2 < tiles) begin_tile(t + 2, s_a, op_a);
        end_tile(t + 1, s_b, op_b);
      }
    }
  }
  cp_async_wait<0>();
  if (!computes) return;

  // The warp's rows are complete over the split: normalized here (no merge across warps).
  store_rows<Element>(a, seq, split, kvh, r0, nrows, lane, o, m, l, a.num_splits == 1);
}

}  // namespace dmattn::cuda
