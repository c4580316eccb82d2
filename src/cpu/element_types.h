// Element types of the CPU backend: the accumulator for each input type, loads into the
// accumulator, saturating stores out of it, and the runtime-dtype -> template dispatch.
#pragma once

#include <cfloat>
#include <type_traits>

#include "cpu/half_convert.h"
#include "dmattn/error.h"
#include "dmattn/types.h"

namespace dmattn::cpu {

// fp64 inputs accumulate in fp64 (so gradcheck can pass); everything else in fp32, as
// docs/semantics.md requires of every backend.
template <typename T>
using AccumulatorOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

// ---------------------------------------------------------------------------------------------
// Loads: element -> accumulator
// ---------------------------------------------------------------------------------------------

template <typename Acc>
inline Acc load_as(float x) { return static_cast<Acc>(x); }
template <typename Acc>
inline Acc load_as(double x) { return static_cast<Acc>(x); }
template <typename Acc>
inline Acc load_as(Half x) { return static_cast<Acc>(half_to_float(x)); }
template <typename Acc>
inline Acc load_as(BFloat16 x) { return static_cast<Acc>(bfloat16_to_float(x)); }

// ---------------------------------------------------------------------------------------------
// Stores: accumulator -> element, rounding to nearest even, never producing Inf from a finite
// value (clamped to the largest finite value of the destination type).
// ---------------------------------------------------------------------------------------------

inline void store_saturating(double* dst, double x) { *dst = x; }
inline void store_saturating(double* dst, float x) { *dst = x; }
inline void store_saturating(float* dst, float x) { *dst = x; }
inline void store_saturating(float* dst, double x) {
  // A float64 accumulator only reaches a float32 destination for an fp32 bias of fp64 inputs.
  if (x > FLT_MAX && x <= DBL_MAX) x = FLT_MAX;
  if (x < -FLT_MAX && x >= -DBL_MAX) x = -FLT_MAX;
  *dst = static_cast<float>(x);
}
inline void store_saturating(Half* dst, float x) { *dst = float_to_half_saturate(x); }
inline void store_saturating(BFloat16* dst, float x) { *dst = float_to_bfloat16_saturate(x); }

// ---------------------------------------------------------------------------------------------
// Dispatch: calls fn(TypeTag<Element>{}, TypeTag<BiasElement>{}) for the runtime dtypes.
// ---------------------------------------------------------------------------------------------

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename Fn, typename T>
void dispatch_bias_type(DType bias_dtype, Fn&& fn, TypeTag<T> element) {
  // The bias is either q's dtype or float32 (make_params checked it; no bias reads as q's).
  if (bias_dtype == DType::kFloat32) return fn(element, TypeTag<float>{});
  return fn(element, TypeTag<T>{});
}

template <typename Fn>
void dispatch_element_types(DType dtype, DType bias_dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return dispatch_bias_type(bias_dtype, fn, TypeTag<float>{});
    case DType::kFloat16: return dispatch_bias_type(bias_dtype, fn, TypeTag<Half>{});
    case DType::kBFloat16: return dispatch_bias_type(bias_dtype, fn, TypeTag<BFloat16>{});
    case DType::kFloat64: return dispatch_bias_type(bias_dtype, fn, TypeTag<double>{});
    default:
      fail(ErrorKind::kType,
           "q: the CPU backend supports float32, float16, bfloat16 and float64, got ",
           dtype_name(dtype));
  }
}

}  // namespace dmattn::cpu
