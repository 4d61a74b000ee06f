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

}  // namespace troupe::test
