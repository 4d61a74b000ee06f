#pragma once
// Test support: reproducible random floats for the codec tests (CPU and CUDA), the same on every
// platform: std::mt19937's raw output is fixed by the standard, its distributions are not.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace troupe::test {

/// One float in [lo, hi) from the generator's top 24 bits.
inline float uniform(std::mt19937& g, float lo, float hi) {
  return lo + (hi - lo) * static_cast<float>(g() >> 8) * (1.0f / 16777216.0f);
}

/// `n` floats in [lo, hi) from a generator seeded with `seed`.
inline std::vector<float> uniform_floats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = uniform(g, lo, hi);
  return v;
}

/// `n` magnitudes 2^-20 .. 2^20 (over many exponents), signs mixed.
inline std::vector<float> wide_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    const float exponent = static_cast<float>(g() % 4000) / 100.0f - 20.0f;
    x = (g() & 1 ? -1.0f : 1.0f) * std::exp2(exponent);
  }
  return v;
}

/// An input on which mean_abs's order of additions shows in its float (comm/codecs/sign.h): 4096
/// chunks of 1024 (4 Mi elements, a power of two: the division is exact). Chunk 0 sums to
/// 2^24 + 1 (lane 0: 64 x 2^18, lane 2: 64 x 1/64), every other chunk to 2^-30 (one element),
/// below half an ulp of 2^24 + 1 in double. One chain over the chunks loses every 2^-30: the mean
/// (2^24 + 1) / 2^22 = 4 + 2^-22 is a tie between floats, which rounds to 4. The tree sums each
/// later group of 64 first (2^-24, kept): the mean lies above the tie and rounds up to
/// kTreeMeanAbs.
inline std::vector<float> mean_abs_tie() {
  std::vector<float> src(size_t{4096} * 1024, 0.0f);
  for (size_t t = 0; t < 64; ++t) {
    src[16 * t] = std::ldexp(1.0f, 18);
    src[16 * t + 2] = 1.0f / 64;
  }
  for (size_t k = 1; k < 4096; ++k) src[k * 1024] = std::ldexp(1.0f, -30);
  return src;
}
inline const float kTreeMeanAbs = 4.0f + std::ldexp(1.0f, -21);

}  // namespace troupe::test
