// Small device helpers: cp.async, warp reductions, conversions, fragment layouts.
#pragma once

#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace dmattn::cuda {

// ---- cp.async ------------------------------------------------------------------------------
// Copies src_bytes (0..16) and zero-fills the rest of the 16-byte destination chunk.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
// The same for a chunk read whole (no source size to pass).
__device__ __forceinline__ void cp_async_16_whole(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// x, as a value the compiler cannot see through: what is derived from it is computed where it is
// used, not hoisted out of a loop and held in registers through it.
__device__ __forceinline__ int opaque_int(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// x of lane 0, for a value that every lane of the warp holds alike: the compiler then knows it
// warp-uniform and may keep it, and what derives from it, in uniform registers (which the
// vector registers' budget of a warp-specialized role does not pay for).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffff, x, 0); }

// threadIdx.x read afresh (a volatile read, not merged with an earlier one): for code after a
// register-bound loop, so that the thread's index and what derives from it are not held
// through the loop.
__device__ __forceinline__ int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- fast math ----------------------------------------------------------------------------
// 2^x with one MUFU.EX2 (ex2.approx.ftz: <= 2 ulp, results below 2^-126 flush to 0,
// -inf -> 0, NaN -> NaN).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) with one MUFU.LG2 (lg2.approx.ftz: absolute error below 2^-22 on [1, 2], the gate's
// range; 0 -> -inf, inf -> inf, NaN -> NaN).
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) with one MUFU.TANH (tanh.approx: relative error about 2^-11; +-inf -> +-1, NaN -> NaN).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// min / max that keep a NaN (min / max.NaN, sm_80+, one instruction each; fminf / fmaxf return
// the other operand).
__device__ __forceinline__ float min_keep_nan(float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x != x || y != y ? x + y : fminf(x, y);
#endif
}
__device__ __forceinline__ float max_keep_nan(float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x != x || y != y ? x + y : fmaxf(x, y);
#endif
}

// ---- quad (4 threads sharing an accumulator row) reductions --------------------------------
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

// ---- conversions ---------------------------------------------------------------------------
template <typename T> struct ElemInfo;
template <> struct ElemInfo<cutlass::half_t> {
  using Native2 = __half2;
  static constexpr float kMax = 65504.f;
  __device__ static Native2 pack(float a, float b) { return __floats2half2_rn(a, b); }
  __device__ static float to_float(const void* p) { return __half2float(*static_cast<const __half*>(p)); }
  __device__ static void to_float2(const void* p, float& a, float& b) {
    word_to_float2(*static_cast<const uint32_t*>(p), a, b);
  }
  // Two elements packed in a 32-bit word (the lower-addressed one in the low half).
  __device__ static void word_to_float2(uint32_t w, float& a, float& b) {
    __half2 h;
    memcpy(&h, &w, sizeof(w));
    const float2 f = __half22float2(h); a = f.x; b = f.y;
  }
};
template <> struct ElemInfo<cutlass::bfloat16_t> {
  using Native2 = __nv_bfloat162;
  static constexpr float kMax = 3.38953139e38f;
  __device__ static Native2 pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ static float to_float(const void* p) {
    return __bfloat162float(*static_cast<const __nv_bfloat16*>(p));
  }
  __device__ static void to_float2(const void* p, float& a, float& b) {
    word_to_float2(*static_cast<const uint32_t*>(p), a, b);
  }
  // bf16 is fp32's upper half: one shift or mask an element (__bfloat1622float2 takes a byte
  // permute and a shift for the upper one).
  __device__ static void word_to_float2(uint32_t w, float& a, float& b) {
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
  }
};

// ---- saturation ----------------------------------------------------------------------------
// The saturating stores' clamp to Element's finite range [-kMax, kMax]: no finite fp32 value
// becomes Inf (docs/semantics.md; an infinite one, which only non-finite inputs make, is
// clamped too), and a NaN stays NaN, so that a NaN input reaches the outputs it touches.
// min / max.NaN (sm_80+) cost what fminf / fmaxf cost, which would turn a NaN into -kMax. (A
// clamp of finite values only, Inf passing through, took an extra select per element, which
// spilled registers in the Hopper backward's dK / dV stores and the sm80-class forward.)
template <typename Element>
__device__ __forceinline__ float saturate_keep_nan(float x) {
  constexpr float kMax = ElemInfo<Element>::kMax;
  return min_keep_nan(max_keep_nan(x, -kMax), kMax);
}

// Two fp32 values to an Element pair (a in the low half), rounded to nearest and saturated as
// saturate_keep_nan does: on sm_80+ one conversion, cvt.rn.satfinite (a result beyond the
// finite range, Inf included, becomes the largest finite value of its sign; NaN stays NaN),
// where the clamp before a plain conversion took two more instructions per element (the
// backward's dS tiles convert every score).
template <typename Element>
__device__ __forceinline__ typename ElemInfo<Element>::Native2 pack_saturated(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t w;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>)
    asm("cvt.rn.satfinite.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));
  else
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));
  typename ElemInfo<Element>::Native2 r;
  memcpy(&r, &w, sizeof(w));
  return r;
#else
  return ElemInfo<Element>::pack(saturate_keep_nan<Element>(a), saturate_keep_nan<Element>(b));
#endif
}

// Converts an fp32 fragment to Element pairwise; kSaturate saturates (pack_saturated), so no
// finite fp32 value becomes Inf and a NaN stays NaN.
template <typename Element, bool kSaturate, class TensorF, class TensorE>
__device__ __forceinline__ void convert_fragment(TensorF const& src, TensorE& dst) {
  static_assert(decltype(cute::size(src))::value % 2 == 0);
  using Info = ElemInfo<Element>;
  auto* out = reinterpret_cast<typename Info::Native2*>(dst.data());
  CUTE_UNROLL
  for (int i = 0; i < cute::size(src) / 2; ++i) {
    if constexpr (kSaturate) out[i] = pack_saturated<Element>(src(2 * i), src(2 * i + 1));
    else out[i] = Info::pack(src(2 * i), src(2 * i + 1));
  }
}

// ---- fragment layouts (mma.sync m16n8k16) ---------------------------------------------------
// Accumulator ((2, 2), MMA_M, MMA_N) -> (rows (2, MMA_M), cols (2, MMA_N)).
template <class Layout>
__host__ __device__ constexpr auto acc_rowcol(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<1>(get<0>(l)), get<1>(l)),
                     make_layout(get<0>(get<0>(l)), get<2>(l)));
}

// Accumulator ((2, 2), MMA_M, MMA_N) of a QK^T tile -> A operand ((2, 2, 2), MMA_M, MMA_N / 2)
// for the P V product: two adjacent n8 accumulator tiles form one k16 A tile.
template <class Layout>
__host__ __device__ constexpr auto acc_to_a(Layout const& acc) {
  using namespace cute;
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(get<0>(l)), get<1>(get<0>(l)), get<0>(get<2>(l))),
                     get<1>(l), get<1>(get<2>(l)));
}

}  // namespace dmattn::cuda
