// Names and sizes of the core's enums, and TensorDesc helpers.
#include <sstream>

#include "dmattn/error.h"
#include "dmattn/types.h"

namespace dmattn {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kBool: return "bool";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    default: return "an unsupported dtype";
  }
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kFloat64: case DType::kInt64: return 8;
    case DType::kBool: return 1;
    default: return 0;
  }
}

const char* device_name(DeviceKind device) {
  switch (device) {
    case DeviceKind::kCPU: return "cpu";
    case DeviceKind::kCUDA: return "cuda";
    default: return "an unsupported device";
  }
}

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

ShapeText TensorDesc::shape_text() const { return ShapeText{shape}; }

std::ostream& operator<<(std::ostream& os, const ShapeText& text) {
  os << "(";
  for (size_t i = 0; i < text.shape.size(); ++i) os << (i ? ", " : "") << text.shape[i];
  if (text.shape.size() == 1) os << ",";
  return os << ")";
}

std::ostream& operator<<(std::ostream& os, const QDtypeOrFloat32Text& text) {
  os << dtype_name(text.q) << " (like q)";
  return text.q == DType::kFloat32 ? os : os << " or float32";
}

const char* Error::python_kind() const {
  switch (kind_) {
    case ErrorKind::kValue: return "ValueError";
    case ErrorKind::kType: return "TypeError";
    case ErrorKind::kNotImplemented: return "NotImplementedError";
    default: return "RuntimeError";
  }
}

}  // namespace dmattn
