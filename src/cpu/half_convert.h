// 16-bit float storage types and their conversions to and from float32.
//
// The CPU backend must not depend on compiler support for _Float16 / __bf16 (it differs
// between gcc/clang versions), so both formats are plain 16-bit patterns converted with
// integer arithmetic. Narrowing conversions round to nearest, ties to even, like the GPU's
// cvt.rn; the *_saturate variants additionally clamp finite values to the largest finite
// value of the format, because docs/semantics.md forbids turning a finite fp32 result into Inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dmattn::cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Largest finite values, as float32 (both are exactly representable).
constexpr float kHalfMax = 65504.0f;
constexpr float kBFloat16Max = 0x1.FEp127f;  // bit pattern 0x7F7F

// ---------------------------------------------------------------------------------------------
// float16 (1 sign, 5 exponent bits with bias 15, 10 mantissa bits)
// ---------------------------------------------------------------------------------------------

inline float half_to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = h.bits & 0x3FFu;
  if (exponent == 0x1F) {  // Inf or NaN: keep the payload so a NaN stays a NaN
    return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  }
  if (exponent != 0) {  // normal: rebias 15 -> 127
    return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  // Zero or subnormal: mantissa * 2^-24 is exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

// Round to nearest even. Overflow gives Inf (IEEE behaviour); see float_to_half_saturate.
inline Half float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {  // NaN: force the quiet bit so truncation cannot make it Inf
    return {static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu))};
  }
  if (magnitude >= 0x477FF000u) {  // >= 65520 (the midpoint above 65504) or Inf
    return {static_cast<uint16_t>(sign | 0x7C00u)};
  }
  if (magnitude >= 0x38800000u) {  // >= 2^-14: a normal half
    // Round the 13 dropped mantissa bits to nearest even; a carry correctly bumps the
    // exponent. Then rebias the exponent from 127 to 15.
    const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return {static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)))};
  }
  // Subnormal half: the result is round(value * 2^24) as an integer in [0, 1024]
  // (1024 is the bit pattern of the smallest normal, so a carry is still correct).
  const uint32_t biased_exponent = magnitude >> 23;
  const uint32_t shift = 126u - biased_exponent;  // >= 14 here
  if (shift > 24) return {sign};                   // below 2^-25: rounds to zero
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  uint32_t result = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
  return {static_cast<uint16_t>(sign | result)};
}

// ---------------------------------------------------------------------------------------------
// bfloat16 (the upper half of a float32)
// ---------------------------------------------------------------------------------------------

inline float bfloat16_to_float(BFloat16 b) {
  return bits_to_float(static_cast<uint32_t>(b.bits) << 16);
}

inline BFloat16 float_to_bfloat16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: keep it quiet (truncation could give Inf)
    return {static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);  // nearest even on the low 16 bits
  return {static_cast<uint16_t>(rounded >> 16)};
}

// ---------------------------------------------------------------------------------------------
// Saturating casts: a finite input never becomes Inf; Inf and NaN pass through.
// ---------------------------------------------------------------------------------------------

inline float clamp_finite(float f, float max_finite) {
  if (f > max_finite && f <= 3.4028235e38f) return max_finite;  // finite and too large
  if (f < -max_finite && f >= -3.4028235e38f) return -max_finite;
  return f;
}

inline Half float_to_half_saturate(float f) { return float_to_half(clamp_finite(f, kHalfMax)); }

inline BFloat16 float_to_bfloat16_saturate(float f) {
  return float_to_bfloat16(clamp_finite(f, kBFloat16Max));
}

}  // namespace dmattn::cpu
