// The balanced form of the split-KV decode (docs/decode.md, "Balanced shares"): instead of
// every (batch, kv head) row cut into the same number of splits, the key stages of the whole
// batch are dealt out in equal shares to a fixed number of CTAs (the places the GPU holds at
// once), a share free to end one row and start the next. Equal rows then fill every place (256
// CTAs of four splits leave 8 of the H200's 264 empty), and rows of unequal lengths (a serving
// batch) no longer leave the CTAs of short rows idle while those of long ones run.
//
// Rows r = b * heads_kv + kvh hold n_b stages (kBalancedStageKeys keys each; the same for every
// kv head of batch b), at offsets N_r in the batch's T stages. CTA c of P takes stages
// [floor(c T / P), floor((c + 1) T / P)), row by row. A row inside one CTA's share is written as
// output directly; a row cut by shares leaves one partial result per CTA c that holds part of
// it, in slot r + c: its parts are the CTAs c_lo(r) .. c_hi(r), and c_lo(r') >= c_hi(r) for
// r' > r, so the slots are unique and at most rows + P - 1. The merge finds c_lo and c_hi from
// the same lengths by the same arithmetic. Everything derives from the cache lengths on the
// device, read by each CTA (B values), so nothing waits for the host.
#pragma once

#include <cstdint>

#include "cuda/decode/decode_kernel.h"

namespace dmattn::cuda::decode_detail {

// The kernel that runs the balanced form (decode_sm90.h) reads keys in stages of this many.
inline constexpr int kBalancedStageKeys = 64;

// Batch b's row (every kv head alike): its sequence, the keys its queries may see (window /
// causal) from a whole stage on, and their stages.
struct BalancedRow {
  DecodeSeq seq;
  SplitKeys keys;
  int stages;
};
__device__ __forceinline__ BalancedRow balanced_row(const DecodeArgs& a, int b) {
  BalancedRow r;
  r.seq = decode_seq(a, b, kDecodeChunkRows);
  r.seq.splits = 1;  // (the whole row: one split)
  r.keys = split_keys(a, r.seq, 0, r.seq.len_q * a.group, 0, kBalancedStageKeys);
  const int n = r.keys.end - r.keys.begin;
  r.stages = n > 0 ? (n + kBalancedStageKeys - 1) / kBalancedStageKeys : 0;
  return r;
}

// Row qi of head h in slot `slot` of the balanced form's partial rows: a slot holds the Sq * group
// rows of one (batch, kv head).
__device__ __forceinline__ int64_t balanced_slot_row(const DecodeArgs& a, int slot, int h, int qi) {
  return (int64_t(slot) * a.seqlen_q + qi) * a.group + h % a.group;
}

// The batch's T key stages over every (batch, kv head) row, and the CTAs that share them:
// balanced_ctas, or T where it is smaller, so that every share holds a stage (a row's parts
// then number at most P / heads_kv + 2, which the host keeps within the merge's
// kDecodeMaxSplits).
struct BalancedShares {
  int64_t total;
  int ctas;
  // The first stage of CTA c's share.
  __device__ __forceinline__ int64_t start(int64_t c) const { return c * total / ctas; }
  // The CTA whose share holds stage s (< total): the last c with floor(c T / P) <= s.
  __device__ __forceinline__ int cta_of(int64_t s) const {
    return static_cast<int>(min(int64_t(ctas - 1), ((s + 1) * ctas - 1) / total));
  }
};
__device__ __forceinline__ BalancedShares balanced_shares(const DecodeArgs& a) {
  int64_t stages = 0;
  for (int b = 0; b < a.batch; ++b) stages += balanced_row(a, b).stages;
  const int64_t total = stages * a.heads_kv;
  return {total, static_cast<int>(min(int64_t(a.balanced_ctas), total))};
}

// One part of a CTA's share: stages [t0, t1) of row (b, kvh), as the keys [keys.begin, keys.end)
// of the kernels' split loop; written to slot `slot`, or as output where the share holds the
// whole row (direct).
struct BalancedPart {
  DecodeSeq seq;
  int kvh, slot;
  SplitKeys keys;
  bool direct;
};

// Calls part(BalancedPart) for each part of this CTA's share, in row order (none for a CTA
// past shares.ctas).
template <class Part>
__device__ __forceinline__ void for_each_balanced_part(const DecodeArgs& a, Part&& part) {
  const BalancedShares shares = balanced_shares(a);
  if (static_cast<int>(blockIdx.x) >= shares.ctas) return;
  const int64_t lo = shares.start(blockIdx.x), hi = shares.start(blockIdx.x + 1);
  int64_t first = 0;  // N of batch b's first row
  for (int b = 0; b < a.batch && first < hi; ++b) {
    const BalancedRow row = balanced_row(a, b);
    const int64_t n = row.stages;
    if (n > 0 && first + n * a.heads_kv > lo) {
      for (int kvh = lo > first ? static_cast<int>((lo - first) / n) : 0; kvh < a.heads_kv; ++kvh) {
        const int64_t r0 = first + kvh * n;
        if (r0 >= hi) break;
        const int t0 = static_cast<int>(max(lo, r0) - r0), t1 = static_cast<int>(min(hi, r0 + n) - r0);
        BalancedPart p;
        p.seq = row.seq;
        p.kvh = kvh;
        p.slot = b * a.heads_kv + kvh + static_cast<int>(blockIdx.x);
        p.keys = {row.keys.off, row.keys.begin + t0 * kBalancedStageKeys,
                  min(row.keys.end, row.keys.begin + t1 * kBalancedStageKeys)};
        p.direct = t0 == 0 && t1 == n;
        part(p);
      }
    }
    first += n * a.heads_kv;
  }
}

// Where the merge finds row (b, kvh)'s parts: slots first_slot .. first_slot + parts - 1; parts
// 0 for a row without keys (out 0, lse -inf), 1 for a row its CTA wrote directly.
struct BalancedParts {
  int first_slot, parts;
};
__device__ __forceinline__ BalancedParts balanced_parts(const DecodeArgs& a, int b, int kvh) {
  const BalancedShares shares = balanced_shares(a);
  int64_t first = 0;
  for (int bb = 0; bb < b; ++bb) first += int64_t(balanced_row(a, bb).stages) * a.heads_kv;
  const int64_t n = balanced_row(a, b).stages;
  if (n == 0) return {0, 0};
  const int64_t r0 = first + kvh * n;
  const int c_lo = shares.cta_of(r0), c_hi = shares.cta_of(r0 + n - 1);
  return {b * a.heads_kv + kvh + c_lo, c_hi - c_lo + 1};
}

}  // namespace dmattn::cuda::decode_detail
