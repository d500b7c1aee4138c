// bfloat16 <-> float32 conversion of ffi/common/bf16.h against a reference that rounds by comparing distances in
// double precision (round to nearest, ties to the even mantissa), plus NaN, infinities and subnormals.
#include "common/bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace jodc {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

bool IsNanBf16(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0; }

// Reference rounding of a non-NaN float: the two bf16 candidates are the truncation and the next value away from
// zero; pick the nearer (exact in double), on a tie the one with an even last mantissa bit.
uint16_t ReferenceF32ToBf16(float f) {
  const uint32_t bits = Bits(f);
  const uint16_t down = static_cast<uint16_t>(bits >> 16);
  if ((bits & 0xffffu) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);  // next magnitude (0x7f7f + 1 = infinity)
  const double x = std::fabs(static_cast<double>(f));
  const double lo = std::fabs(static_cast<double>(FromBits(static_cast<uint32_t>(down) << 16)));
  const double hi_f = static_cast<double>(FromBits(static_cast<uint32_t>(up) << 16));
  // Infinity as the upper candidate: it stands at max_finite + one bf16 ulp (2^128) for the distance test.
  const double hi = std::isinf(hi_f) ? std::ldexp(1.0, 128) : std::fabs(hi_f);
  const double d_lo = x - lo, d_hi = hi - x;
  if (d_lo < d_hi) return down;
  if (d_hi < d_lo) return up;
  return (down & 1u) == 0 ? down : up;
}

TEST(Bf16, ToF32IsExactForEveryPattern) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    ASSERT_EQ(Bits(f), h << 16) << "bf16 0x" << std::hex << h;
  }
}

TEST(Bf16, RoundTripOfEveryBf16Value) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t back = F32ToBf16(Bf16ToF32(static_cast<uint16_t>(h)));
    if (IsNanBf16(static_cast<uint16_t>(h))) {
      ASSERT_TRUE(IsNanBf16(back)) << "NaN 0x" << std::hex << h << " became 0x" << back;
    } else {
      ASSERT_EQ(back, h) << "bf16 0x" << std::hex << h << " did not survive a round trip";
    }
  }
}

TEST(Bf16, RoundsToNearestEvenAgainstReference) {
  // Every sign/exponent/upper-mantissa pattern, with low halves at and around the halfway point 0x8000.
  const uint32_t lows[] = {0x0000, 0x0001, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xbfff, 0xfffe, 0xffff};
  int64_t checked = 0;
  for (uint32_t high = 0; high <= 0xffffu; ++high) {
    for (uint32_t low : lows) {
      const uint32_t bits = (high << 16) | low;
      const float f = FromBits(bits);
      if (std::isnan(f)) continue;
      ASSERT_EQ(F32ToBf16(f), ReferenceF32ToBf16(f)) << "f32 bits 0x" << std::hex << bits << " (" << f << ")";
      ++checked;
    }
  }
  EXPECT_GT(checked, 500000);
}

TEST(Bf16, TiesGoToEven) {
  // 1 + 2^-8 lies halfway between bf16 1.0 (0x3f80, even) and 1.0078125 (0x3f81): rounds down to even.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808000u)), 0x3f80);
  // Halfway between 0x3f81 (odd) and 0x3f82 (even): rounds up to even.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f818000u)), 0x3f82);
  // Just above halfway always rounds up; just below always down.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(F32ToBf16(FromBits(0x3f817fffu)), 0x3f81);
  // Negative values round by magnitude the same way.
  EXPECT_EQ(F32ToBf16(FromBits(0xbf808000u)), 0xbf80);
  EXPECT_EQ(F32ToBf16(FromBits(0xbf818000u)), 0xbf82);
}

TEST(Bf16, InfinitiesAndOverflow) {
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(F32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // FLT_MAX is above bf16's largest finite value by more than half an ulp: it rounds to infinity.
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);
  // bf16's largest finite value stays finite.
  EXPECT_EQ(F32ToBf16(FromBits(0x7f7f0000u)), 0x7f7f);
}

TEST(Bf16, NaNStaysQuietNaN) {
  // Signalling NaNs whose payload sits only in the low 16 bits must not truncate to infinity.
  for (uint32_t bits : {0x7f800001u, 0x7f80ffffu, 0x7fc00000u, 0xff800001u, 0xffffffffu, 0x7fa00000u}) {
    const uint16_t h = F32ToBf16(FromBits(bits));
    EXPECT_TRUE(IsNanBf16(h)) << "f32 0x" << std::hex << bits << " -> 0x" << h;
    EXPECT_NE(h & 0x0040u, 0u) << "not a quiet NaN: f32 0x" << std::hex << bits << " -> 0x" << h;
    EXPECT_EQ(h & 0x8000u, (bits >> 16) & 0x8000u) << "NaN sign lost: f32 0x" << std::hex << bits;
  }
}

TEST(Bf16, SubnormalsAndZeros) {
  EXPECT_EQ(F32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(F32ToBf16(-0.0f), 0x8000);
  // The smallest f32 subnormal is far below half of bf16's smallest subnormal (2^-133): it rounds to zero.
  EXPECT_EQ(F32ToBf16(FromBits(0x00000001u)), 0x0000);
  EXPECT_EQ(F32ToBf16(FromBits(0x80000001u)), 0x8000);
  // bf16 subnormals are exact; halfway cases between subnormals round to even.
  EXPECT_EQ(F32ToBf16(FromBits(0x00010000u)), 0x0001);
  EXPECT_EQ(F32ToBf16(FromBits(0x00018000u)), 0x0002);
  EXPECT_EQ(F32ToBf16(FromBits(0x00008000u)), 0x0000);
  // The largest bf16 subnormal rounds up into the smallest normal.
  EXPECT_EQ(F32ToBf16(FromBits(0x007fc000u)), 0x0080);
  EXPECT_EQ(Bf16ToF32(0x0001), std::ldexp(1.0f, -133));
}

}  // namespace
}  // namespace jodc
