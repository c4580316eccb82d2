// A typed, strided host tensor for the C++ tests: the data behind a dmattn::TensorDesc, with
// element access as double, arbitrary physical layouts (permuted and padded), NaN poisoning,
// and a check that nothing outside the logical elements was written.
#pragma once

#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "cpu/half_convert.h"
#include "dmattn/types.h"

namespace dmattn::test {

// Physical layout of a tensor: `order` lists the logical dims from outermost to innermost,
// and every dimension's stride is padded by `pad` extra elements beyond dense packing.
struct Layout {
  std::vector<int> order;  // empty = row-major
  int64_t pad = 0;
};

class TestTensor {
 public:
  TestTensor() = default;
  TestTensor(DType dtype, std::vector<int64_t> shape, const Layout& layout = {})
      : dtype_(dtype), shape_(std::move(shape)), strides_(shape_.size(), 0) {
    const int rank = static_cast<int>(shape_.size());
    std::vector<int> order = layout.order;
    if (order.empty()) {
      order.resize(rank);
      std::iota(order.begin(), order.end(), 0);
    }
    int64_t stride = 1;
    int64_t extent = 1;  // elements spanned so far (max offset + 1)
    for (int k = rank - 1; k >= 0; --k) {
      const int dim = order[k];
      strides_[dim] = stride;
      extent += (shape_[dim] - 1) * stride;
      // The innermost dim stays unit-stride; outer ones get padding.
      stride = extent + layout.pad;
      if (shape_[dim] == 0) extent = 0;
    }
    if (numel() == 0) extent = 0;
    bytes_.assign(static_cast<size_t>(extent) * dtype_size(dtype_), 0);
  }

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }

  TensorDesc desc() {
    TensorDesc d;
    d.data = bytes_.empty() ? static_cast<void*>(&empty_storage_) : bytes_.data();
    d.dtype = dtype_;
    d.device = DeviceKind::kCPU;
    d.shape = shape_;
    d.strides = strides_;
    return d;
  }

  // Offset (in elements) of the element with row-major logical index `flat`.
  int64_t offset_of(int64_t flat) const {
    int64_t offset = 0;
    for (int64_t d = rank() - 1; d >= 0; --d) {
      offset += (flat % shape_[d]) * strides_[d];
      flat /= shape_[d];
    }
    return offset;
  }

  double get(int64_t flat) const { return read(offset_of(flat)); }
  void set(int64_t flat, double value) { write(offset_of(flat), value); }

  // All logical elements as doubles, row-major.
  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    for (int64_t e = 0; e < numel(); ++e) out[e] = get(e);
    return out;
  }

  // Every byte 0xFF: a NaN in every floating type, "true" in a bool.
  void poison() {
    if (!bytes_.empty()) std::memset(bytes_.data(), 0xFF, bytes_.size());
  }

  // After poison() and a call that should write only the logical elements: true if every
  // byte that is not part of a logical element is still 0xFF.
  bool padding_untouched() const {
    std::vector<bool> is_element(bytes_.size() / std::max<size_t>(1, dtype_size(dtype_)), false);
    for (int64_t e = 0; e < numel(); ++e) is_element[offset_of(e)] = true;
    const size_t width = dtype_size(dtype_);
    for (size_t slot = 0; slot < is_element.size(); ++slot) {
      if (is_element[slot]) continue;
      for (size_t byte = 0; byte < width; ++byte) {
        if (bytes_[slot * width + byte] != 0xFF) return false;
      }
    }
    return true;
  }

  const std::vector<uint8_t>& raw_bytes() const { return bytes_; }

 private:
  double read(int64_t offset) const {
    const uint8_t* p = bytes_.data() + offset * dtype_size(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { float v; std::memcpy(&v, p, 4); return v; }
      case DType::kFloat64: { double v; std::memcpy(&v, p, 8); return v; }
      case DType::kFloat16: { cpu::Half v; std::memcpy(&v, p, 2); return cpu::half_to_float(v); }
      case DType::kBFloat16: {
        cpu::BFloat16 v;
        std::memcpy(&v, p, 2);
        return cpu::bfloat16_to_float(v);
      }
      case DType::kBool: return *p ? 1.0 : 0.0;
      default: throw std::logic_error("TestTensor: unsupported dtype");
    }
  }

  // Rounds to the tensor's dtype (nearest even; fp16/bf16 through float32, which is exact
  // for the values the tests generate: they are already float32 or coarser).
  void write(int64_t offset, double value) {
    uint8_t* p = bytes_.data() + offset * dtype_size(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { float v = static_cast<float>(value); std::memcpy(p, &v, 4); return; }
      case DType::kFloat64: std::memcpy(p, &value, 8); return;
      case DType::kFloat16: {
        const cpu::Half v = cpu::float_to_half(static_cast<float>(value));
        std::memcpy(p, &v, 2);
        return;
      }
      case DType::kBFloat16: {
        const cpu::BFloat16 v = cpu::float_to_bfloat16(static_cast<float>(value));
        std::memcpy(p, &v, 2);
        return;
      }
      case DType::kBool: *p = value != 0.0; return;
      default: throw std::logic_error("TestTensor: unsupported dtype");
    }
  }

  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  std::vector<uint8_t> bytes_;
  double empty_storage_ = 0;  // a valid pointer for tensors with no elements
};

}  // namespace dmattn::test
