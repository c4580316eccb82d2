// The fp16/bf16 conversions of src/cpu/half_convert.h: exact round trips, round-to-nearest-even
// against an independent oracle, Inf/NaN handling, and saturation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "cpu/half_convert.h"

namespace dmattn::cpu {
namespace {

bool is_nan_half(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u && (bits & 0x3FFu) != 0; }
bool is_nan_bf16(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu) != 0; }

// Oracle: the nearest of the two representable neighbours (by exact double arithmetic),
// ties to the even pattern. `decode` maps a bit pattern to its value.
template <typename Decode>
uint16_t nearest_even(float f, uint16_t below, Decode decode) {
  const uint16_t above = static_cast<uint16_t>(below + 1);
  const double lo = std::fabs(decode(below)), hi = std::fabs(decode(above)), x = std::fabs(f);
  if (x - lo < hi - x) return below;
  if (x - lo > hi - x) return above;
  return (below & 1u) ? above : below;
}

TEST(HalfConvert, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const Half h{static_cast<uint16_t>(bits)};
    const float f = half_to_float(h);
    if (is_nan_half(h.bits)) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(is_nan_half(float_to_half(f).bits));
      continue;
    }
    EXPECT_EQ(float_to_half(f).bits, h.bits) << std::hex << bits;
  }
}

TEST(HalfConvert, KnownHalfValues) {
  EXPECT_EQ(float_to_half(1.0f).bits, 0x3C00);
  EXPECT_EQ(float_to_half(-2.0f).bits, 0xC000);
  EXPECT_EQ(float_to_half(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(float_to_half(65519.0f).bits, 0x7BFF);  // below the midpoint
  EXPECT_EQ(float_to_half(65520.0f).bits, 0x7C00);  // midpoint ties to even = Inf
  EXPECT_EQ(float_to_half(0x1p-24f).bits, 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(0x1p-25f).bits, 0x0000);  // tie to even = 0
  EXPECT_EQ(float_to_half(0x1.8p-25f).bits, 0x0001);
  EXPECT_EQ(float_to_half(0x1.8p-24f).bits, 0x0002);  // 1.5 ulp ties to even 2
  EXPECT_EQ(float_to_half(-0.0f).bits, 0x8000);
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f).bits, 0x3C00);  // tie, even stays
  EXPECT_EQ(float_to_half(1.0f + 0x1.8p-10f).bits, 0x3C02);  // tie, rounds up to even
  EXPECT_EQ(half_to_float({0x0001}), 0x1p-24f);
  EXPECT_EQ(half_to_float({0x7C00}), std::numeric_limits<float>::infinity());
}

TEST(HalfConvert, RandomFloatsRoundToNearestEvenHalf) {
  std::mt19937 rng(5);
  for (int n = 0; n < 200000; ++n) {
    // Random magnitudes in half's range, subnormals included.
    const float f = std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng),
                               static_cast<int>(rng() % 42) - 26) * (rng() % 2 ? 1 : -1);
    if (std::fabs(f) >= 65504.0f) continue;
    // Truncated pattern of |f| (found by search over the ordered positive patterns).
    uint16_t below = 0;
    for (int bit = 14; bit >= 0; --bit) {
      const uint16_t candidate = static_cast<uint16_t>(below | (1u << bit));
      if (half_to_float({candidate}) <= std::fabs(f)) below = candidate;
    }
    const uint16_t expected = static_cast<uint16_t>(
        nearest_even(f, below, [](uint16_t b) { return static_cast<double>(half_to_float({b})); }) |
        (f < 0 ? 0x8000u : 0u));
    ASSERT_EQ(float_to_half(f).bits, expected) << f;
  }
}

TEST(BFloat16Convert, RandomFloatsRoundToNearestEvenBFloat16) {
  std::mt19937 rng(6);
  for (int n = 0; n < 200000; ++n) {
    const uint32_t bits = rng() & 0x7FFFFFFFu;
    if (bits >= 0x7F800000u) continue;  // Inf/NaN: see SpecialValues
    const float f = bits_to_float(bits);
    const uint16_t below = static_cast<uint16_t>(bits >> 16);
    const uint16_t expected = nearest_even(
        f, below, [](uint16_t b) {
          // Rounding treats the pattern after the largest finite one (Inf) as 2^128.
          return b == 0x7F80 ? 0x1p128 : static_cast<double>(bfloat16_to_float({b}));
        });
    ASSERT_EQ(float_to_bfloat16(f).bits, expected) << std::hex << bits;
  }
}

TEST(BFloat16Convert, SpecialValues) {
  EXPECT_EQ(float_to_bfloat16(1.0f).bits, 0x3F80);
  EXPECT_EQ(float_to_bfloat16(1.0f + 0x1p-8f).bits, 0x3F80);    // tie, even stays
  EXPECT_EQ(float_to_bfloat16(1.0f + 0x1.8p-7f).bits, 0x3F82);  // tie, up to even
  EXPECT_EQ(float_to_bfloat16(std::numeric_limits<float>::max()).bits, 0x7F80);  // IEEE: Inf
  EXPECT_EQ(float_to_bfloat16(-std::numeric_limits<float>::infinity()).bits, 0xFF80);
  EXPECT_TRUE(is_nan_bf16(float_to_bfloat16(std::nanf("")).bits));
  // A NaN whose payload sits only in the low 16 bits must not truncate to Inf.
  EXPECT_TRUE(is_nan_bf16(float_to_bfloat16(bits_to_float(0x7F800001u)).bits));
  EXPECT_TRUE(is_nan_half(float_to_half(bits_to_float(0x7F800001u)).bits));
}

TEST(SaturatingConvert, FiniteNeverBecomesInf) {
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(float_to_half_saturate(1e6f).bits, 0x7BFF);
  EXPECT_EQ(float_to_half_saturate(-65520.0f).bits, 0xFBFF);
  EXPECT_EQ(float_to_half_saturate(big).bits, 0x7BFF);
  EXPECT_EQ(float_to_half_saturate(1.0f).bits, 0x3C00);
  EXPECT_EQ(float_to_bfloat16_saturate(big).bits, 0x7F7F);
  EXPECT_EQ(float_to_bfloat16_saturate(-big).bits, 0xFF7F);
  EXPECT_EQ(float_to_bfloat16_saturate(kBFloat16Max).bits, 0x7F7F);
  // Inf stays Inf, NaN stays NaN.
  EXPECT_EQ(float_to_half_saturate(std::numeric_limits<float>::infinity()).bits, 0x7C00);
  EXPECT_EQ(float_to_bfloat16_saturate(-std::numeric_limits<float>::infinity()).bits, 0xFF80);
  EXPECT_TRUE(is_nan_half(float_to_half_saturate(std::nanf("")).bits));
  EXPECT_TRUE(is_nan_bf16(float_to_bfloat16_saturate(std::nanf("")).bits));
}

}  // namespace
}  // namespace dmattn::cpu
