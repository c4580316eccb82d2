// Host side of the decode path: the split-count heuristic, the checks only these kernels
// need, DecodeArgs filled in one place, and the dispatch to the instantiation per dtype.
#include "cuda/host/decode_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <cutlass/numeric_types.h>

#include "cuda/common/check.h"
#include "cuda/decode/decode_args.h"
#include "cuda/host/decode_launch.h"
#include "cuda/common/device_info.h"
#include "cuda/host/host_operands.h"
#include "cuda/sm90/enabled.h"
#include "dmattn/error.h"

namespace dmattn::cuda {
namespace {

// Resident decode CTAs per SM (decode_kernel.h's launch bounds).
constexpr int64_t kCtasPerSm = 2;

int sm_count(int device_id) {
  const int n = multiprocessor_count(device_id);
  return n > 0 ? n : 108;
}

// The decode kernel's operand: the shared broadcast rule (host_operands.h), its strides only.
DecodeOperand make_decode_operand(const BroadcastOperand& op) {
  const OperandArgs o = make_operand(op, 1);
  DecodeOperand d;
  d.ptr = o.ptr;
  d.sb = o.stride_b, d.sh = o.stride_h, d.sq = o.stride_q, d.sk = o.stride_k;
  d.head_div = o.head_div;
  return d;
}

// Whether the mask and bias (those present) can travel in the kernel's cp.async ring
// (DecodeOperands::kRing): 16-byte chunks of a row's keys, so stride 1 along the keys, every row
// start 16-byte aligned, and a 16-bit bias (the ring holds 16 x 16 entries of each a stage).
bool operands_fit_ring(const DecodeArgs& a) {
  if (a.mask.ptr == nullptr && a.bias.ptr == nullptr) return false;
  const auto rows_aligned = [](const DecodeOperand& op, int64_t elems_per_16_bytes) {
    return reinterpret_cast<uintptr_t>(op.ptr) % 16 == 0 && op.sk == 1 && op.sb % elems_per_16_bytes == 0 &&
           op.sh % elems_per_16_bytes == 0 && op.sq % elems_per_16_bytes == 0;
  };
  if (a.mask.ptr != nullptr && !rows_aligned(a.mask, 16)) return false;
  if (a.bias.ptr != nullptr && (a.bias_fp32 || !rows_aligned(a.bias, 8))) return false;
  return true;
}

}  // namespace

int64_t decode_row_chunks(int64_t seqlen_q, int64_t group, int64_t head_dim) {
  const int64_t rows = seqlen_q * group;
  const int64_t chunk = decode_rows_chunked(rows, static_cast<int>(head_dim)) ? kDecodeChunkRows : kDecodeRows;
  return (rows + chunk - 1) / chunk;
}

// FlashAttention's num_splits heuristic, with this kernel's occupancy: a wave is
// sm_count * kCtasPerSm CTAs; among 1..max splits, the fewest whose last wave is at least 95%
// as full as the best possible, so that few splits are used when they already fill the GPU.
// (FlashAttention accepts 85%; a memory-bound kernel in a single wave gains in proportion to
// the SMs it keeps streaming: B=1, 8 kv heads, 128k keys on an H100 take 32 splits, 2.53 TB/s,
// where 85% would take 29, 2.47 TB/s.)
int64_t decode_num_splits(int64_t ctas, int64_t seqlen_k, int device_id) {
  if (ctas <= 0) return 1;
  const double wave = double(sm_count(device_id)) * kCtasPerSm;
  const int64_t max_splits = std::min<int64_t>(kDecodeMaxSplits, std::max<int64_t>(1, seqlen_k / kDecodeMinKeysPerSplit));
  if (double(ctas) >= 0.8 * wave || max_splits == 1) return 1;
  const auto efficiency = [&](int64_t s) {
    const double waves = double(ctas) * double(s) / wave;
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (efficiency(s) >= 0.95 * best) return s;
  }
  return 1;
}

namespace {

// The balanced form's CTAs: every place the GPU holds at once.
int64_t decode_balanced_ctas(int device_id) { return kCtasPerSm * sm_count(device_id); }

}  // namespace

// Where the balanced form runs (decode_launch.h, with_balanced_shares, adds what only the call's
// tensors say): the wgmma kernel's calls (Hopper, head dims up to 128, one chunk of at most 64
// packed rows); at least 4 stages a CTA when the cache is full (a shorter share pays its start --
// Q, the ring's first copies, its partial row -- for too few keys); and kv heads enough that a
// row's parts (at most P / heads_kv + 2) stay within the merge's kDecodeMaxSplits. Asked for
// with DMATTN_DECODE_BALANCED=1 (read at each call): measured on an H200 (docs/decode.md,
// "Balanced shares"), it is faster than the splits for batches of unequal cache lengths and
// slower for a batch of equal long rows, and the lengths are on the device.
int64_t decode_balanced_splits(int64_t batch, int64_t seqlen_q, int64_t group, int64_t heads_kv, int64_t head_dim,
                               int64_t seqlen_k, int device_id) {
  const char* env = std::getenv("DMATTN_DECODE_BALANCED");
  static const bool sm90_off = sm90::env_switched_off("DMATTN_DECODE_SM90");
  constexpr int64_t kStageKeys = 64, kMinStagesPerCta = 4;
  if (env == nullptr || env[0] != '1') return 0;
  if (sm90_off || head_dim > kDecodeRowsMaxHeadDim || seqlen_q * group > kDecodeChunkRows || batch < 1 ||
      heads_kv < 1 || seqlen_k < 1)
    return 0;
  if (!sm90::device_runs_sm90_kernels(device_id)) return 0;
  const int64_t ctas = decode_balanced_ctas(device_id), rows = batch * heads_kv;
  if (heads_kv * (kDecodeMaxSplits - 2) < ctas) return 0;
  if (rows * ((seqlen_k + kStageKeys - 1) / kStageKeys) < kMinStagesPerCta * ctas) return 0;
  return (rows + ctas - 1 + rows - 1) / rows;  // slots rows + P - 1, each a row's Sq * group rows
}

namespace {

// ---- Packed batches. A sequence of a packed batch takes the kernel, the row chunks and the
// split count that a call of that sequence alone takes, so that its rows equal that call's bit
// for bit (the varlen contract): a launch per kernel, each computing the sequences whose rows
// that kernel takes (DecodeArgs::rows_lo / rows_hi), each sequence with its own splits
// (DecodeArgs::split_table).

// decode_num_splits for one sequence of c row chunks (c = 1 .. kDecodePackedMaxChunks) and
// m * kDecodeMinKeysPerSplit keys (m = 1 .. kDecodeMaxSplits; its answer depends on the keys only
// through m), per (device, kv heads): 512 entries, computed once.
using SplitTable = uint8_t[kDecodePackedMaxChunks][kDecodeMaxSplits];
const SplitTable& packed_split_table(int64_t heads_kv, int device_id) {
  static std::mutex lock;
  static std::map<std::pair<int, int64_t>, std::vector<uint8_t>> tables;
  const std::lock_guard<std::mutex> guard(lock);
  std::vector<uint8_t>& t = tables[{device_id, heads_kv}];
  if (t.empty()) {
    t.resize(kDecodePackedMaxChunks * kDecodeMaxSplits);
    for (int c = 1; c <= kDecodePackedMaxChunks; ++c) {
      for (int m = 1; m <= kDecodeMaxSplits; ++m) {
        t[(c - 1) * kDecodeMaxSplits + m - 1] =
            static_cast<uint8_t>(decode_num_splits(heads_kv * c, int64_t(m) * kDecodeMinKeysPerSplit, device_id));
      }
    }
  }
  return *reinterpret_cast<const SplitTable*>(t.data());
}

// One launch of a packed call: the sequences with rows in (rows_lo, rows_hi], at most seqlen_q
// queries each, in row_chunks chunks, with at most num_splits splits.
struct PackedLaunch {
  int rows_lo = 0, rows_hi = 0;
  int64_t seqlen_q = 0, row_chunks = 0;
  int num_splits = 0;
};

// (table: packed_split_table of the call's kv heads and GPU)
std::vector<PackedLaunch> packed_launches(const SplitTable& table, int64_t group, int64_t head_dim,
                                          int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const int64_t max_m = std::clamp<int64_t>(max_seqlen_k / kDecodeMinKeysPerSplit, 1, kDecodeMaxSplits);
  // The one-tile kernel takes up to one tile of rows (at head dims above 128 up to
  // kDecodePackedMaxRows, in chunks); the 64-row kernel the rest (decode_rows_chunked). On Hopper
  // the narrow kernel takes up to kDecodeNarrowRows rows (decode_narrow_takes): a launch of their own.
  const bool rows_kernel = decode_max_head_dim(static_cast<int>(head_dim)) <= kDecodeRowsMaxHeadDim;
  const int one_tile_hi = rows_kernel ? kDecodeRows : kDecodePackedMaxRows;
  const int narrow_hi = rows_kernel ? kDecodeNarrowRows : 0;
  std::vector<PackedLaunch> launches;
  for (const auto& [lo, hi] : {std::pair<int, int>{0, narrow_hi}, {narrow_hi, one_tile_hi},
                               {one_tile_hi, kDecodePackedMaxRows}}) {
    if (lo >= hi) continue;
    PackedLaunch l;
    l.rows_lo = lo, l.rows_hi = hi;
    l.seqlen_q = std::min<int64_t>(max_seqlen_q, hi / group);  // the most queries a sequence in range has
    if (l.seqlen_q * group <= lo) continue;                     // none can be in range
    const int64_t chunk_rows = lo < one_tile_hi ? kDecodeRows : kDecodeChunkRows;
    l.row_chunks = (l.seqlen_q * group + chunk_rows - 1) / chunk_rows;
    for (int64_t c = 1; c <= l.row_chunks; ++c) {
      for (int64_t m = 1; m <= max_m; ++m) l.num_splits = std::max<int>(l.num_splits, table[c - 1][m - 1]);
    }
    launches.push_back(l);
  }
  return launches;
}

}  // namespace

int64_t decode_packed_splits(int64_t heads_kv, int64_t group, int64_t head_dim, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, int device_id) {
  int64_t splits = 0;
  const SplitTable& table = packed_split_table(heads_kv, device_id);
  for (const PackedLaunch& l : packed_launches(table, group, head_dim, max_seqlen_q, max_seqlen_k)) {
    splits = std::max<int64_t>(splits, l.num_splits);
  }
  return splits;
}

void decode_forward(const ForwardParams& p) {
  check(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16, ErrorKind::kType,
        "q: the CUDA backend supports float16 and bfloat16, got ", dtype_name(p.dtype));
  check(p.head_dim % 8 == 0 && p.head_dim >= 8 && p.head_dim <= 256, ErrorKind::kValue, "q: head_dim ",
        p.head_dim, " is not supported by the CUDA backend (expected a multiple of 8 up to 256)");
  check(!p.mask.present() || p.mask.dtype == DType::kBool, ErrorKind::kType, "mask: expected dtype bool");
  check(!p.bias.present() || p.bias.dtype == DType::kFloat32 || p.bias.dtype == p.dtype, ErrorKind::kType,
        "bias: expected q's dtype or float32");
  check(p.seqlen_k < (int64_t(1) << 31) && p.seqlen_q < (int64_t(1) << 31) &&
            p.key_rows_source_len < (int64_t(1) << 31) && p.total_q < (int64_t(1) << 31) &&
            p.total_k < (int64_t(1) << 31) && p.batch <= 65535 &&
            p.num_heads_kv <= 65535,
        ErrorKind::kValue, "q/k: the CUDA decode path supports lengths below 2^31 and at most 65535 batches ",
        "and kv heads");
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
  check_seq_tensor("q", p.q, p.q_strides);
  check_seq_tensor("out", p.out, p.out_strides);
  if (p.seqlen_k > 0) {
    check_seq_tensor("k", p.k, p.k_strides);
    check_seq_tensor("v", p.v, p.v_strides);
  }
  check(p.decode_splits <= kDecodeMaxSplits, ErrorKind::kValue, "num_splits: expected at most ", kDecodeMaxSplits,
        ", got ", p.decode_splits);
  check(p.decode_splits == 1 || p.split_workspace != nullptr, ErrorKind::kValue,
        "workspace: ", p.decode_splits, " key splits need a float32 workspace, got none");

  DecodeArgs a;
  a.q = p.q; a.k = p.k; a.v = p.v; a.out = p.out;
  a.lse = static_cast<float*>(p.lse);
  a.lse_bs = p.lse_batch_stride; a.lse_hs = p.lse_head_stride;
  a.q_st = p.q_strides; a.k_st = p.k_strides; a.v_st = p.v_strides; a.o_st = p.out_strides;
  a.batch = static_cast<int>(p.batch);
  a.seqlen_q = static_cast<int>(p.seqlen_q);
  a.seqlen_k = static_cast<int>(p.seqlen_k);
  a.num_heads = static_cast<int>(p.num_heads);
  a.heads_kv = static_cast<int>(p.num_heads_kv);
  a.group = static_cast<int>(p.group_size());
  a.head_dim = static_cast<int>(p.head_dim);
  a.seqused_k = p.seqused_k;
  a.block_table = p.block_table;
  a.bt_stride = p.block_table_stride;
  a.page_size = p.block_table != nullptr ? static_cast<int>(p.page_size) : 1;
  if (p.has_key_rows()) {  // (make_decode_forward_params: key_rows are the positions, one set per kv head)
    a.key_rows = p.key_rows;
    a.kr_sb = p.key_positions_stride_b;
    a.kr_sh = p.key_positions_stride_h;
    a.kr_rows = static_cast<int>(p.key_rows_source_len);
  }
  a.softcap = p.softcap > 0 ? static_cast<float>(p.softcap) : 0.f;
  a.q_scale = static_cast<float>(p.softcap > 0 ? p.scale / p.softcap : p.scale);
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.mask = make_decode_operand(p.mask);
  a.bias = make_decode_operand(p.bias);
  a.bias_fp32 = p.bias.present() && p.bias.dtype == DType::kFloat32;
  // (Packed: the sequences' keys start anywhere, so their entries are not 16-byte aligned.)
  a.operands_in_ring = !p.is_varlen() && operands_fit_ring(a);
  std::vector<DecodeArgs> launches;
  if (p.is_varlen()) {
    a.cu_seqlens_q = p.cu_seqlens_q;
    a.cu_seqlens_k = p.cu_seqlens_k;
    a.total_q = static_cast<int>(p.total_q);
    const SplitTable& table = packed_split_table(p.num_heads_kv, p.device_id);
    std::memcpy(a.split_table, table, sizeof(a.split_table));
    for (const PackedLaunch& l : packed_launches(table, p.group_size(), p.head_dim, p.seqlen_q, p.seqlen_k)) {
      check(l.num_splits <= std::max<int64_t>(1, p.decode_splits), ErrorKind::kValue, "num_splits: expected ",
            l.num_splits, " (decode_packed_splits), got ", p.decode_splits);
      DecodeArgs la = a;
      la.rows_lo = l.rows_lo, la.rows_hi = l.rows_hi;
      la.seqlen_q = static_cast<int>(l.seqlen_q);
      la.row_chunks = static_cast<int>(l.row_chunks);
      la.num_splits = l.num_splits;
      launches.push_back(la);
    }
  } else {
    a.row_chunks = static_cast<int>(decode_row_chunks(p.seqlen_q, p.group_size(), p.head_dim));
    a.num_splits = static_cast<int>(std::max<int64_t>(1, p.decode_splits));
    if (p.decode_balanced && p.split_workspace != nullptr &&
        decode_balanced_splits(p.batch, p.seqlen_q, p.group_size(), p.num_heads_kv, p.head_dim, p.seqlen_k,
                               p.device_id) > 0) {
      a.balanced_ctas = static_cast<int>(decode_balanced_ctas(p.device_id));
    }
    launches.push_back(a);
  }
  // The splits' partial rows and their lse in the workspace (run_decode places the lse after the
  // rows of its kernel's splits). Packed launches run one after the other on the stream and share it.
  for (DecodeArgs& la : launches) {
    la.part_out = p.split_workspace;  // (also with one split: the balanced form's, decode_launch.h)
    la.workspace_floats = p.split_workspace_floats;
  }

  int prev = -1;
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
  if (prev != p.device_id) check_cuda(cudaSetDevice(p.device_id), "cudaSetDevice");
  auto stream = static_cast<cudaStream_t>(p.stream);
  try {
    // out allocated by the call (allocate_out): by the first launch (run_decode: after its kernel
    // where that writes partial rows only, so that the GPU starts while the host allocates).
    void* out = p.allocate_out != nullptr ? nullptr : p.out;
    for (DecodeArgs& la : launches) {
      la.out = out;
      out = p.dtype == DType::kBFloat16
                ? run_decode<cutlass::bfloat16_t>(la, stream, p.allocate_out, p.allocate_out_context)
                : run_decode<cutlass::half_t>(la, stream, p.allocate_out, p.allocate_out_context);
    }
  } catch (...) {
    if (prev != p.device_id) cudaSetDevice(prev);
    throw;
  }
  if (prev != p.device_id) cudaSetDevice(prev);
}

}  // namespace dmattn::cuda
