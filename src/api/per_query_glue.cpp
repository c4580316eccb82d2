// Validation and dispatch of the per-query causal top-k glue (prefix_thresholds,
// segment_candidates; dmattn/api.h): CPU or CUDA.
#include <cstdint>
#include <utility>

#include "api/tensor_checks.h"
#include "cpu/per_query_glue.h"
#include "dmattn/api.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/indexed/per_query_glue.h"
#endif

namespace dmattn {

namespace {

void check_int_tensor(const TensorDesc& t, const TensorDesc& ref, const char* name) {
  check(t.device == DeviceKind::kCPU || t.device == DeviceKind::kCUDA, ErrorKind::kValue, name,
        ": expected a CPU or CUDA tensor, got ", device_name(t.device));
  checks::check_same_device(ref, t, name);
  checks::check_dtype(t, DType::kInt32, name);
  checks::check_contiguous(t, name);
}

// An optional bool (R, S) mask of selectable keys beside `ref` (R, S): same device, contiguous.
void check_allowed(const TensorDesc* allowed, const TensorDesc& ref) {
  if (allowed == nullptr) return;
  checks::check_same_device(ref, *allowed, "allowed");
  checks::check_dtype(*allowed, DType::kBool, "allowed");
  checks::check_contiguous(*allowed, "allowed");
  checks::check_shape(*allowed, ref.shape, "allowed");
}

bool on_cuda(const TensorDesc& t) {
#ifdef DMATTN_WITH_CUDA
  return t.device == DeviceKind::kCUDA;
#else
  check(t.device != DeviceKind::kCUDA, ErrorKind::kRuntime, "this build of dmattn has no CUDA backend");
  return false;
#endif
}

}  // namespace

void prefix_thresholds(const TensorDesc& ranks, const TensorDesc& order, int64_t keep, const TensorDesc& thresholds,
                       void* stream) {
  check_int_tensor(ranks, ranks, "ranks");
  check_int_tensor(order, ranks, "order");
  check_int_tensor(thresholds, ranks, "thresholds");
  checks::check_rank(ranks, 2, "ranks", "(rows, Sk)");
  checks::check_shape(order, ranks.shape, "order");
  checks::check_shape(thresholds, ranks.shape, "thresholds");
  const int64_t rows = ranks.shape[0], num_keys = ranks.shape[1];
  check(num_keys < (int64_t(1) << 30), ErrorKind::kValue, "ranks: expected Sk < 2^30, got ", num_keys);
  check(keep >= 1, ErrorKind::kValue, "keep: expected >= 1, got ", keep);
  const auto* r = static_cast<const int32_t*>(ranks.data);
  const auto* o = static_cast<const int32_t*>(order.data);
  auto* t = static_cast<int32_t*>(thresholds.data);
  if (on_cuda(ranks)) {
#ifdef DMATTN_WITH_CUDA
    cuda::prefix_thresholds({r, o, t, rows, num_keys, keep}, stream);
#endif
    return;
  }
  (void)stream;
  cpu::prefix_thresholds(r, o, t, rows, num_keys, keep);
}

void selection_key(const TensorDesc& scores, const TensorDesc* allowed, const TensorDesc& key, void* stream) {
  check(scores.device == DeviceKind::kCUDA, ErrorKind::kNotImplemented,
        "scores: selection_key runs on CUDA (the CPU composes torch ops), got a tensor on ", device_name(scores.device));
  check(scores.dtype == DType::kFloat16 || scores.dtype == DType::kBFloat16 || scores.dtype == DType::kFloat32,
        ErrorKind::kType, "scores: expected float16, bfloat16 or float32, got ", dtype_name(scores.dtype));
  checks::check_contiguous(scores, "scores");
  checks::check_rank(scores, 2, "scores", "(rows, Sk)");
  const int64_t num_keys = scores.shape[1];
  const bool key32 = scores.dtype != DType::kFloat32 && num_keys <= (int64_t(1) << 16);
  checks::check_same_device(scores, key, "key");
  checks::check_dtype(key, key32 ? DType::kInt32 : DType::kInt64, "key");
  checks::check_contiguous(key, "key");
  checks::check_shape(key, scores.shape, "key");
  check(num_keys < (int64_t(1) << 31), ErrorKind::kValue, "scores: expected Sk < 2^31, got ", num_keys);
  check_allowed(allowed, scores);
#ifdef DMATTN_WITH_CUDA
  cuda::SelectionKeyArgs a;
  a.scores = scores.data;
  a.allowed = allowed == nullptr ? nullptr : static_cast<const bool*>(allowed->data);
  a.key = key.data;
  a.rows = scores.shape[0];
  a.num_keys = num_keys;
  a.fmt = scores.dtype == DType::kFloat32 ? 2 : scores.dtype == DType::kBFloat16 ? 1 : 0;
  a.key32 = key32;
  cuda::selection_key(a, stream);
#else
  (void)stream;
  fail(ErrorKind::kRuntime, "this build of dmattn has no CUDA backend");
#endif
}

void interval_ends(const TensorDesc& sorted, const TensorDesc* allowed, int64_t keep, const TensorDesc& ranks,
                   const TensorDesc& order, const TensorDesc& thresholds, const TensorDesc& ends, void* stream) {
  check(sorted.device == DeviceKind::kCUDA, ErrorKind::kNotImplemented,
        "sorted: interval_ends runs on CUDA (the CPU composes torch ops), got a tensor on ", device_name(sorted.device));
  checks::check_dtype(sorted, DType::kInt64, "sorted");
  checks::check_contiguous(sorted, "sorted");
  checks::check_rank(sorted, 2, "sorted", "(rows, Sk)");
  for (const auto& [t, name] : {std::pair<const TensorDesc&, const char*>{ranks, "ranks"}, {order, "order"},
                                {thresholds, "thresholds"}, {ends, "ends"}}) {
    check_int_tensor(t, sorted, name);
    checks::check_shape(t, sorted.shape, name);
  }
  check_allowed(allowed, sorted);
  const int64_t rows = sorted.shape[0], num_keys = sorted.shape[1];
  check(num_keys < (int64_t(1) << 30), ErrorKind::kValue, "sorted: expected Sk < 2^30, got ", num_keys);
  check(keep >= 1, ErrorKind::kValue, "keep: expected >= 1, got ", keep);
#ifdef DMATTN_WITH_CUDA
  cuda::IntervalEndsArgs a;
  a.sorted = static_cast<const int64_t*>(sorted.data);
  a.allowed = allowed == nullptr ? nullptr : static_cast<const bool*>(allowed->data);
  a.ranks = static_cast<int32_t*>(ranks.data);
  a.order = static_cast<int32_t*>(order.data);
  a.thresholds = static_cast<int32_t*>(thresholds.data);
  a.ends = static_cast<int32_t*>(ends.data);
  a.rows = rows;
  a.num_keys = num_keys;
  a.keep = keep;
  cuda::interval_ends(a, stream);
#else
  (void)stream, (void)rows;
  fail(ErrorKind::kRuntime, "this build of dmattn has no CUDA backend");
#endif
}

void segment_candidates(const TensorDesc& ends, int64_t offset, int64_t seg_len, const TensorDesc& positions,
                        const TensorDesc& key_ends, const TensorDesc& index, const TensorDesc& slots, void* stream) {
  check_int_tensor(ends, ends, "ends");
  check_int_tensor(positions, ends, "positions");
  check_int_tensor(key_ends, ends, "key_ends");
  check_int_tensor(index, ends, "index");
  check_int_tensor(slots, ends, "slots");
  checks::check_rank(ends, 3, "ends", "(rows_b, rows_h, Sk)");
  checks::check_rank(positions, 3, "positions", "(rows_b * num_segments, rows_h, W)");
  const int64_t rows_b = ends.shape[0], rows_h = ends.shape[1], num_keys = ends.shape[2];
  check(seg_len >= 1 && offset >= 0, ErrorKind::kValue, "seg_len, offset: expected seg_len >= 1 and offset >= 0, got ",
        seg_len, " and ", offset);
  check(rows_b > 0 && positions.shape[0] % rows_b == 0 && positions.shape[1] == rows_h, ErrorKind::kValue,
        "positions: expected shape (", rows_b, " * num_segments, ", rows_h, ", W), got ", positions.shape_text());
  checks::check_shape(key_ends, positions.shape, "key_ends");
  checks::check_shape(index, positions.shape, "index");
  const int64_t num_segments = positions.shape[0] / rows_b, width = positions.shape[2];
  checks::check_shape(slots, {rows_b, num_segments, rows_h, num_keys}, "slots");
  check(num_segments * seg_len + offset < (int64_t(1) << 31) && num_keys < (int64_t(1) << 31), ErrorKind::kValue,
        "segment_candidates: positions must fit int32 (num_segments * seg_len + offset = ",
        num_segments * seg_len + offset, ")");
  const auto* e = static_cast<const int32_t*>(ends.data);
  auto* p = static_cast<int32_t*>(positions.data);
  auto* ke = static_cast<int32_t*>(key_ends.data);
  auto* ix = static_cast<int32_t*>(index.data);
  auto* sl = static_cast<int32_t*>(slots.data);
  if (on_cuda(ends)) {
#ifdef DMATTN_WITH_CUDA
    cuda::SegmentCandidatesArgs a;
    a.ends = e;
    a.positions = p;
    a.key_ends = ke;
    a.index = ix;
    a.slots = sl;
    a.rows_b = rows_b;
    a.rows_h = rows_h;
    a.num_keys = num_keys;
    a.num_segments = num_segments;
    a.width = width;
    a.offset = offset;
    a.seg_len = seg_len;
    cuda::segment_candidates(a, stream);
#endif
    return;
  }
  (void)stream;
  cpu::segment_candidates(e, p, ke, ix, sl, rows_b, rows_h, num_keys, num_segments, width, offset, seg_len);
}

}  // namespace dmattn
