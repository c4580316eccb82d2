// Element types, devices and a framework-free tensor description.
//
// The binding turns DLPack tensors into TensorDesc; everything below the binding
// (validation, parameter filling, backends, C++ tests) sees only these types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <vector>

namespace dmattn {

enum class DType : int32_t { kFloat32, kFloat16, kBFloat16, kFloat64, kBool, kInt32, kInt64, kOther };

enum class DeviceKind : int32_t { kCPU, kCUDA, kOther };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);
const char* device_name(DeviceKind device);

// A shape as error text, "(2, 16, 128, 64)", formatted only when streamed: the argument checks
// pass it to check(), which builds its message only when the check fails, so that validating a
// call (every call) formats nothing. Refers to the shape: use it within the statement.
struct ShapeText {
  const std::vector<int64_t>& shape;
};
std::ostream& operator<<(std::ostream& os, const ShapeText& text);

// The dtypes an operand may have beside q's as error text: "bfloat16 (like q) or float32", or
// "float32 (like q)" where q's is float32 (one dtype, not two). Streamed lazily like ShapeText.
struct QDtypeOrFloat32Text {
  DType q;
};
std::ostream& operator<<(std::ostream& os, const QDtypeOrFloat32Text& text);

// A strided view of memory, in elements. Rank 0..N; strides may be 0 (broadcast).
struct TensorDesc {
  void* data = nullptr;
  DType dtype = DType::kOther;
  DeviceKind device = DeviceKind::kCPU;
  int32_t device_id = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  // The shape as error text, "(2, 16, 128, 64)" (ShapeText).
  ShapeText shape_text() const;
};

}  // namespace dmattn
