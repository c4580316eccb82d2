// Launcher of the decode kernels for one element type (docs/decode.md); instantiated once per
// type in src/cuda/inst/decode_<dtype>.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/decode_args.h"

namespace dmattn::cuda {

// The head-dim bucket run_decode picks: 64 / 128 / 256.
inline constexpr int decode_max_head_dim(int d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

// Whether `rows` packed query rows at head dim d run on the 64-row kernel (decode_rows_kernel.h,
// chunks of kDecodeChunkRows) rather than the one-tile kernel (chunks of kDecodeRows): the grid's
// row chunks (decode_row_chunks) and the launch follow this one answer.
inline constexpr bool decode_rows_chunked(int64_t rows, int d) {
  return rows > kDecodeRows && decode_max_head_dim(d) <= kDecodeRowsMaxHeadDim;
}

// The decode kernel, then the merge of its key splits. a.out null: out comes from
// allocate_out(context) (ForwardParams::allocate_out), called between the two launches where the
// kernel writes partial rows only, else before it. Returns the out used.
template <typename Element>
void* run_decode(const DecodeArgs& a, cudaStream_t stream, void* (*allocate_out)(void*) = nullptr,
                 void* context = nullptr);

}  // namespace dmattn::cuda

#ifdef DMATTN_DECODE_LAUNCH_IMPL
#include <algorithm>
#include <optional>

#include "cuda/common/check.h"
#include "cuda/decode/decode_combine.h"
#include "cuda/decode/decode_kernel.h"
#include "cuda/decode/decode_rows_kernel.h"
#include "cuda/common/device_info.h"
#include "cuda/common/launch.h"
#include "cuda/sm90/decode_narrow_sm90.h"
#include "cuda/sm90/decode_sm90.h"
#include "cuda/sm90/enabled.h"

namespace dmattn::cuda {

// Launches kernel on the decode grid (row_chunks * num_splits, heads_kv, batch), or the balanced
// form's (balanced_ctas).
template <typename Kernel>
void launch_on_decode_grid(Kernel kernel, int threads, int smem, const DecodeArgs& a, cudaStream_t stream) {
  const dim3 grid = a.balanced ? dim3(a.balanced_ctas) : dim3(a.row_chunks * a.num_splits, a.heads_kv, a.batch);
  launch_kernel(kernel, grid, threads, smem, stream, a, "decode kernel launch");
}

template <typename Element, int kD, DecodeOperands kOps>
void launch_decode_kernel(const DecodeArgs& a, cudaStream_t stream) {
  using Tile = decode_detail::DecodeTile<kD>;
  launch_on_decode_grid(decode_kernel<Element, kD, kOps>, Tile::kThreads,
                        Tile::smem_bytes(kOps == DecodeOperands::kRing), a, stream);
}

template <typename Element, int kD, bool kOperands>
void launch_decode_rows_kernel(const DecodeArgs& a, cudaStream_t stream) {
  using Tile = decode_detail::DecodeRowsTile<kD>;
  launch_on_decode_grid(decode_rows_kernel<Element, kD, kOperands>, Tile::kThreads, Tile::kSmemBytes, a, stream);
}

// Whether the calls without mask / bias entries take the wgmma kernel (decode_sm90.h) at
// head dims up to 128, whatever their rows: on Hopper, unless DMATTN_DECODE_SM90=0 (for
// comparisons), for keys it finds a stage at a time (a contiguous cache, or pages of at least a
// stage: gathered rows and smaller pages need a table read per key, which its warpgroup would
// wait for at each stage, where the one-tile kernel's per-warp rings read one or two entries a
// tile). It reads the keys at memory speed with 1 to 64 rows (its padding rows cost tensor-core
// time, which a decoding step has to spare), and with short caches it is faster than the
// one-tile kernel (fewer instructions a key). The choice depends on the device and the cache's
// form alone (packed batches are contiguous), so that a packed batch and its sequences take the
// same kernel: a chunk of at most one tile of rows is one 64-row chunk too (row_chunks 1 either
// way).
inline bool decode_on_sm90() {
  static const bool off = sm90::env_switched_off("DMATTN_DECODE_SM90");
  return !off && sm90::device_runs_sm90_kernels();
}

// Whether a call runs on the narrow kernel (decode_narrow_sm90.h), with or without mask / bias
// entries of any layout: at most kDecodeNarrowRows packed rows (a packed batch's launch of
// sequences of that many, or a call of one), head dims up to 128, keys found a stage at a time
// (as the wgmma kernel's) or indexed without pages (attention_topk's decoding step), on Hopper,
// not in the balanced form; unless DMATTN_DECODE_NARROW=0 (for
// comparisons: then the wgmma kernel or the mma.sync kernels). Rows and the cache's form decide,
// so a packed batch and its sequences take the same kernel.
inline bool decode_narrow_takes(const DecodeArgs& a) {
  static const bool off = sm90::env_switched_off("DMATTN_DECODE_NARROW");
  return !off && !a.balanced && int64_t(a.seqlen_q) * a.group <= kDecodeNarrowRows &&
         decode_max_head_dim(a.head_dim) <= kDecodeRowsMaxHeadDim &&
         (decode_detail::keys_by_stage<decode_detail::kNarrowStageKeys>(a) ||
          (a.key_rows != nullptr && a.block_table == nullptr)) &&
         decode_on_sm90();
}

// Pages of fewer keys than this keep the narrow kernel's CTAs on one split each (below).
inline constexpr int kNarrowPairedMinPage = 256;

// The narrow kernel's count for n splits of `rows` (batch, kv head) rows (its grid: rows x
// splits CTAs): one narrow CTA alone on an SM streams K / V at the memory's pace, where the split
// counts (decode_num_splits) fill two CTAs an SM, so a CTA reads the keys of two splits, (n + 1) /
// 2 -- but not fewer than `needed` (narrow_splits_needed: 90 % of the SMs busy; a short cache of
// few rows, where the CTAs' own pace, not the memory's, sets the time). Never above n, and
// monotone in n.
inline int narrow_splits_needed(int64_t rows, int sms) {
  const int64_t fill = (int64_t(sms) * 9 + 9) / 10;
  return static_cast<int>(std::min<int64_t>(kDecodeMaxSplits, (fill + rows - 1) / std::max<int64_t>(1, rows)));
}
inline int narrow_split_count(int n, int needed) { return std::max((n + 1) / 2, std::min(n, needed)); }

// The narrow kernel's splits (narrow_split_count) of a call's count, and of a packed sequence's
// (its split_table entries, for one sequence's rows: a sequence keeps its own call's splits
// packed, and a packed launch's count, the largest entry, maps to the largest of theirs). A
// function of the counts alone: a forced count maps too. Paged caches of pages under
// kNarrowPairedMinPage keys keep theirs (measured: a stage's page a random jump, one CTA an SM
// did not keep enough bytes in flight: 1.07x the time at pages of 64, as fast at 256). The other
// kernels' calls are returned as they are.
inline DecodeArgs with_narrow_splits(const DecodeArgs& a) {
  if (!decode_narrow_takes(a) || (a.block_table != nullptr && a.page_size < kNarrowPairedMinPage)) return a;
  const bool packed = a.cu_seqlens_q != nullptr;
  const int needed =
      narrow_splits_needed(packed ? a.heads_kv : int64_t(a.batch) * a.heads_kv, current_multiprocessor_count());
  DecodeArgs b = a;
  b.num_splits = narrow_split_count(a.num_splits, needed);
  if (packed) {
    for (auto& chunks : b.split_table) {
      for (uint8_t& n : chunks) n = static_cast<uint8_t>(narrow_split_count(n, needed));
    }
  }
  return b;
}

// Where the splits' lse lie: after their partial rows (num_splits, B, H, Sq, D), or packed
// (num_splits, 1, H, total_q, D), in the workspace at part_out (the balanced form's:
// with_balanced_shares).
inline DecodeArgs with_partial_lse(const DecodeArgs& a) {
  if (a.balanced || a.num_splits <= 1) return a;
  const int64_t rows = a.cu_seqlens_q != nullptr ? int64_t(a.num_heads) * a.total_q
                                                 : int64_t(a.batch) * a.num_heads * a.seqlen_q;
  DecodeArgs b = a;
  b.part_lse = a.part_out + int64_t(a.num_splits) * rows * a.head_dim;
  return b;
}

// The wgmma kernel's form for a call's mask / bias entries (decode_bias_sm90.h): none without
// them; with a bias of q's 16-bit type along the keys (stride 1; any alignment) and no mask, the
// bias product for at most kBiasRows packed rows (a packed batch's launch of up to one tile of
// rows, or a call with that few: a sequence takes it in both forms) and each thread's loaded
// entries for more (the packed launch of the larger sequences, or such a call alone); with a
// bool mask along the keys (stride 1), beside such a bias or none, each thread's loaded entries
// for more than kBiasRows rows (fewer: the narrow kernel up to 8, the mma.sync kernels); the
// loaded entries unless DMATTN_DECODE_SM90_ENTRIES=0 (for comparisons). Other entries have no
// form here (nullopt: the mma.sync kernels take them).
inline std::optional<decode_detail::DecodeBias> decode_sm90_bias_form(const DecodeArgs& a) {
  using decode_detail::DecodeBias;
  static const bool entries_off = sm90::env_switched_off("DMATTN_DECODE_SM90_ENTRIES");
  const bool mask = a.mask.ptr != nullptr, bias = a.bias.ptr != nullptr;
  if (!mask && !bias) return DecodeBias::kNone;
  if ((bias && (a.bias_fp32 || a.bias.sk != 1)) || (mask && a.mask.sk != 1)) return std::nullopt;
  const bool few_rows = int64_t(a.seqlen_q) * a.group <= decode_detail::kBiasRows;
  if (!mask && few_rows) return DecodeBias::kProduct;
  if (few_rows || entries_off) return std::nullopt;
  return mask ? DecodeBias::kEntriesMask : DecodeBias::kEntries;
}
inline bool decode_bias_on_sm90(const DecodeArgs& a) {
  return decode_sm90_bias_form(a) == decode_detail::DecodeBias::kProduct;
}

// The call in the balanced form (decode_balanced.h) where it allows it (balanced_ctas, set for
// the shapes decode_balanced_splits takes) and the wgmma kernel takes it: a dense call of one
// row chunk whose keys come a stage at a time, without mask / bias entries but the bias
// product's, and a workspace that holds its rows + balanced_ctas - 1 slots; else as it is.
inline DecodeArgs with_balanced_shares(const DecodeArgs& a) {
  const bool operands = a.mask.ptr != nullptr || a.bias.ptr != nullptr;
  if (a.balanced_ctas <= 0 || a.cu_seqlens_q != nullptr || a.row_chunks != 1 || a.part_out == nullptr ||
      decode_max_head_dim(a.head_dim) > kDecodeRowsMaxHeadDim || (operands && !decode_bias_on_sm90(a)) ||
      !decode_detail::keys_by_stage<decode_detail::kBalancedStageKeys>(a) || !decode_on_sm90())
    return a;
  const int64_t rows_per_slot = int64_t(a.seqlen_q) * a.group;
  const int64_t slots = int64_t(a.batch) * a.heads_kv + a.balanced_ctas - 1;
  if (slots * rows_per_slot * (a.head_dim + 1) > a.workspace_floats) return a;
  DecodeArgs b = a;
  b.balanced = true;
  b.part_lse = a.part_out + slots * rows_per_slot * a.head_dim;
  return b;
}

template <typename Element, int kD>
void launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  const bool operands = a.mask.ptr != nullptr || a.bias.ptr != nullptr;
  if constexpr (kD <= kDecodeRowsMaxHeadDim) {  // (the 64-row kernels exist up to that bucket)
    using Sm90Tile = decode_detail::DecodeSm90Tile<Element, kD>;
    using decode_detail::DecodeBias;
    if (a.balanced) {  // (with_balanced_shares took it for this kernel)
      if (operands) launch_on_decode_grid(decode_sm90_kernel<Element, kD, DecodeBias::kProduct, true>,
                                          Sm90Tile::kThreads, Sm90Tile::kSmemBytes, a, stream);
      else launch_on_decode_grid(decode_sm90_kernel<Element, kD, DecodeBias::kNone, true>, Sm90Tile::kThreads,
                                 Sm90Tile::kSmemBytes, a, stream);
      return;
    }
    if (decode_narrow_takes(a)) {
      using NarrowTile = decode_detail::DecodeNarrowTile<Element, kD>;
      // (indexed keys: the variant with entries, which reads none where there are none)
      if (a.key_rows != nullptr)
        launch_on_decode_grid(decode_narrow_sm90_kernel<Element, kD, true, true>, NarrowTile::kThreads,
                              NarrowTile::kSmemBytes, a, stream);
      else if (operands)
        launch_on_decode_grid(decode_narrow_sm90_kernel<Element, kD, true>, NarrowTile::kThreads,
                              NarrowTile::kSmemBytes, a, stream);
      else
        launch_on_decode_grid(decode_narrow_sm90_kernel<Element, kD, false>, NarrowTile::kThreads,
                              NarrowTile::kSmemBytes, a, stream);
      return;
    }
    const std::optional<DecodeBias> bias_form = decode_sm90_bias_form(a);
    if (bias_form && decode_detail::keys_by_stage<Sm90Tile::kStageKeys>(a) && decode_on_sm90()) {
      const auto launch = [&](auto kernel) {
        launch_on_decode_grid(kernel, Sm90Tile::kThreads, Sm90Tile::kSmemBytes, a, stream);
      };
      switch (*bias_form) {
        case DecodeBias::kNone: launch(decode_sm90_kernel<Element, kD, DecodeBias::kNone>); break;
        case DecodeBias::kProduct: launch(decode_sm90_kernel<Element, kD, DecodeBias::kProduct>); break;
        case DecodeBias::kEntries: launch(decode_sm90_kernel<Element, kD, DecodeBias::kEntries>); break;
        case DecodeBias::kEntriesMask: launch(decode_sm90_kernel<Element, kD, DecodeBias::kEntriesMask>); break;
      }
      return;
    }
    if (decode_rows_chunked(int64_t(a.seqlen_q) * a.group, a.head_dim)) {  // 64-row chunks, one ring
      if (operands) launch_decode_rows_kernel<Element, kD, true>(a, stream);
      else launch_decode_rows_kernel<Element, kD, false>(a, stream);
      return;
    }
  }
  if (!operands) {
    launch_decode_kernel<Element, kD, DecodeOperands::kNone>(a, stream);
  } else if (a.operands_in_ring &&
             decode_detail::DecodeTile<kD>::smem_bytes(true) <= max_shared_memory_optin(current_device())) {
    launch_decode_kernel<Element, kD, DecodeOperands::kRing>(a, stream);
  } else {  // any layout, or a GPU whose blocks cannot hold the larger ring (sm_86 / sm_89)
    launch_decode_kernel<Element, kD, DecodeOperands::kRegisters>(a, stream);
  }
}

template <typename Element>
void* run_decode(const DecodeArgs& call, cudaStream_t stream, void* (*allocate_out)(void*), void* context) {
  DecodeArgs a = with_partial_lse(with_narrow_splits(with_balanced_shares(call)));
  check(a.out != nullptr || allocate_out != nullptr, ErrorKind::kValue,
        "out: a decode launch needs out or a way to allocate it");
  const auto allocate = [&] {
    a.out = allocate_out(context);
    check(a.out != nullptr && reinterpret_cast<uintptr_t>(a.out) % 16 == 0, ErrorKind::kValue,
          "out: the allocator returned no 16-byte aligned storage");
  };
  // out allocated here: before the kernel where it writes out (one split, or the balanced form),
  // else once the kernel is on its way (the merge is the first to write out).
  const bool kernel_writes_out = a.num_splits == 1 || a.balanced;
  if (a.out == nullptr && kernel_writes_out) allocate();
  switch (decode_max_head_dim(a.head_dim)) {
    case 64: launch_decode<Element, 64>(a, stream); break;
    case 128: launch_decode<Element, 128>(a, stream); break;
    default: launch_decode<Element, 256>(a, stream); break;
  }
  if (a.out == nullptr) allocate();
  if (a.num_splits > 1 || a.balanced) {
    const int64_t rows = int64_t(a.batch) * a.num_heads * a.seqlen_q;
    launch_dependent_kernel(decode_combine_kernel<Element>, dim3(static_cast<unsigned>(rows)), kDecodeCombineThreads,
                            stream, a, sm90::device_runs_sm90_kernels(), "decode combine kernel launch");
  }
  return a.out;
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_DECODE(Element) \
  template void* dmattn::cuda::run_decode<Element>(const dmattn::cuda::DecodeArgs&, cudaStream_t, void* (*)(void*), \
                                                   void*);
#endif
