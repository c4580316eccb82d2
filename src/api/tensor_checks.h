// Argument checks shared by the dense and varlen validation (make_params.cpp,
// make_varlen_params.cpp). Each throws dmattn::Error naming the argument.
#pragma once

#include <vector>

#include "dmattn/error.h"
#include "dmattn/types.h"

namespace dmattn::checks {

// The dtype lse (and the CPU backend's accumulator) uses for inputs of dtype `d`.
inline DType stat_dtype(DType d) { return d == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

// q's device given as (device, device_id): the checks made on filled params.
inline void check_same_device(DeviceKind device, int32_t device_id, const TensorDesc& t, const char* name) {
  check(t.device == device && t.device_id == device_id, ErrorKind::kValue, name,
        ": expected a tensor on the same device as q (", device_name(device), ":",
        device_id, "), got ", device_name(t.device), ":", t.device_id);
}

inline void check_same_device(const TensorDesc& ref, const TensorDesc& t, const char* name) {
  check_same_device(ref.device, ref.device_id, t, name);
}

inline void check_rank(const TensorDesc& t, int64_t rank, const char* name, const char* layout) {
  check(t.rank() == rank, ErrorKind::kValue, name, ": expected a ", rank, "-D tensor ", layout,
        ", got shape ", t.shape_text());
}

inline void check_dtype(const TensorDesc& t, DType expected, const char* name) {
  check(t.dtype == expected, ErrorKind::kType, name, ": expected dtype ", dtype_name(expected),
        ", got ", dtype_name(t.dtype));
}

inline void check_shape(const TensorDesc& t, const std::vector<int64_t>& expected, const char* name) {
  check(t.shape == expected, ErrorKind::kValue, name, ": expected shape ", ShapeText{expected},
        ", got ", t.shape_text());
}

// The last dimension must be contiguous so rows can be loaded as vectors.
inline void check_last_dim_contiguous(const TensorDesc& t, const char* name) {
  // An empty tensor has no element whose address a stride could change.
  if (t.rank() == 0 || t.shape.back() <= 1 || t.numel() == 0) return;
  check(t.strides.back() == 1, ErrorKind::kValue, name,
        ": expected a contiguous last dimension (stride 1), got stride ", t.strides.back(),
        "; call .contiguous() first");
}

inline void check_contiguous(const TensorDesc& t, const char* name) {
  if (t.numel() == 0) return;  // torch gives empty tensors arbitrary strides
  int64_t expected = 1;
  for (int64_t d = t.rank() - 1; d >= 0; --d) {
    if (t.shape[d] != 1) {
      check(t.strides[d] == expected, ErrorKind::kValue, name,
            ": expected a contiguous tensor, got strides that are not row-major for shape ",
            t.shape_text());
    }
    expected *= t.shape[d];
  }
}

// A window bound (left or right, `what` names it; -1 = unbounded, other negatives are an error)
// as the backends take it: -1 where it reaches every position of the call (`extent`: the keys
// for the left bound, the queries for the right one), so that a bound near int64's largest
// value cannot overflow the kernels' position arithmetic, nor an int32 copy of it wrap.
inline int64_t window_bound(int64_t w, int64_t extent, const char* what) {
  check(w >= -1, ErrorKind::kValue, "window: expected ", what, " >= -1 (-1 = unbounded), got ", w);
  return w >= extent ? -1 : w;
}

}  // namespace dmattn::checks
