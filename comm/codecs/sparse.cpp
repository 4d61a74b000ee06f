#include "comm/codecs/sparse.h"

#include <emmintrin.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <vector>

namespace troupe::comm {
namespace {

// |x| as its bit pattern: for non-negative floats the integer order is the float order, +0 and
// -0 are both 0, and NaN (which a float comparison cannot order) ranks above infinity.
inline uint32_t abs_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u & 0x7fffffffu;
}

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;

// splitmix64's finaliser.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef int32_t Int4 __attribute__((vector_size(16)));

// Calls f(i, key) for every i in [0, n), in order, whose key is at least `low`, until f returns
// false. The selection's passes look for a few percent of the elements: SSE compares find them
// 16 at a time, and only their set bits are visited.
template <class F>
inline void for_each_key_at_least(const float* src, size_t n, uint32_t low, F f) {
  // Keys have 31 bits, so a signed compare orders them; key >= low <=> key > low - 1.
  const Int4 below = Int4{} + (static_cast<int32_t>(low) - 1);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t hits = 0;
    for (int a = 0; a < 4; ++a) {
      Int4 v;
      std::memcpy(&v, src + i + 4 * a, sizeof(v));
      const Int4 hit = (v & 0x7fffffff) > below;
      hits |= static_cast<uint32_t>(_mm_movemask_ps(reinterpret_cast<__m128>(hit))) << (4 * a);
    }
    for (; hits != 0; hits &= hits - 1) {
      const size_t j = i + static_cast<size_t>(__builtin_ctz(hits));
      if (!f(j, abs_key(src[j]))) return;
    }
  }
  for (; i < n; ++i) {
    const uint32_t key = abs_key(src[i]);
    if (key >= low && !f(i, key)) return;
  }
}

// The k-th largest of keys (1 <= k <= keys.size(); keys is reordered), and how many are larger.
void kth_largest(std::vector<uint32_t>& keys, size_t k, uint32_t& key, size_t& larger) {
  std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(k - 1), keys.end(),
                   std::greater<uint32_t>());
  key = keys[k - 1];
  larger = 0;
  for (size_t j = 0; j + 1 < k; ++j) larger += keys[j] > key;
}

constexpr size_t kSample = 4096;

// A key with, very probably, a little over k keys at or above it: the order statistic of a
// sample of kSample elements (one at a pseudo-random offset in each of kSample equal strides,
// so that a periodic layout such as a matrix's rows does not bias it) placed some standard
// deviations past the k-th. 0 (no guess) when n is small or k a large fraction of it.
uint32_t guess_lower_bound(const float* src, size_t n, size_t k, size_t& expected_candidates) {
  if (n < 16 * kSample) return 0;
  const double above = static_cast<double>(k) * kSample / static_cast<double>(n);
  const size_t rank = static_cast<size_t>(above * 1.25 + 4.0 * std::sqrt(above)) + 16;
  if (rank > kSample / 4) return 0;
  std::vector<uint32_t> sample(kSample);
  const size_t stride = n / kSample;
  for (size_t j = 0; j < kSample; ++j)
    sample[j] = abs_key(src[j * stride + static_cast<size_t>(mix64(j) % stride)]);
  std::nth_element(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(rank - 1),
                   sample.end(), std::greater<uint32_t>());
  expected_candidates = rank * stride;
  return sample[rank - 1];
}

// Takes, in index order, every key above the threshold and the first `ties` equal to it.
struct Picker {
  uint32_t threshold;
  size_t ties;
  uint32_t* indices;
  size_t out = 0;
  /// Offers element i; false once the k indices are out.
  bool offer(size_t i, uint32_t key, size_t k) {
    if (key > threshold || (key == threshold && ties > 0)) {
      ties -= key == threshold;
      indices[out++] = static_cast<uint32_t>(i);
    }
    return out < k;
  }
};

// Uniform integers below a bound, from splitmix64 numbers in order: Lemire's multiply-shift with
// rejection (exactly uniform, and the same on every machine, unlike std::uniform_int_distribution).
class UniformDraws {
 public:
  // The seed is mixed first, so that seeds a multiple of the increment apart do not give
  // shifted copies of one stream.
  explicit UniformDraws(uint64_t seed) : key_(mix64(seed)) {}
  /// A uniform integer in [0, bound), bound >= 1.
  uint64_t below(uint64_t bound) {
    unsigned __int128 product = static_cast<unsigned __int128>(next()) * bound;
    uint64_t low = static_cast<uint64_t>(product);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
      while (low < threshold) {
        product = static_cast<unsigned __int128>(next()) * bound;
        low = static_cast<uint64_t>(product);
      }
    }
    return static_cast<uint64_t>(product >> 64);
  }

 private:
  // splitmix64: number `counter` of the stream keyed by the seed.
  uint64_t next() { return mix64(key_ + ++counter_ * kGamma); }
  uint64_t key_;
  uint64_t counter_ = 0;
};

// Membership of sampled indices for Floyd's algorithm when k is small against n: open addressing
// over a table of at least 2k slots.
class IndexSet {
 public:
  explicit IndexSet(size_t k) {
    size_t slots = 16;
    while (slots < 2 * k) slots *= 2;
    slots_.assign(slots, kEmpty);
    mask_ = slots - 1;
  }
  /// Adds i; false if it was already there.
  bool insert(uint64_t i) {
    size_t s = static_cast<size_t>((i * kGamma) >> 32) & mask_;
    while (slots_[s] != kEmpty) {
      if (slots_[s] == i) return false;
      s = (s + 1) & mask_;
    }
    slots_[s] = i;
    return true;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  std::vector<uint64_t> slots_;
  size_t mask_;
};

}  // namespace

void top_k(const float* src, size_t n, size_t k, uint32_t* indices) {
  if (k == 0) return;
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) indices[i] = static_cast<uint32_t>(i);
    return;
  }
  uint32_t threshold;
  size_t larger;
  // Usually: one pass collects the elements at or above a guessed bound (a little over k of
  // them, in index order), and the selection and the picking run on those alone.
  size_t expected = 0;
  if (const uint32_t low = guess_lower_bound(src, n, k, expected); low > 0) {
    std::vector<uint32_t> where, keys;
    where.reserve(expected + expected / 4);
    keys.reserve(expected + expected / 4);
    for_each_key_at_least(src, n, low, [&](size_t i, uint32_t key) {
      where.push_back(static_cast<uint32_t>(i));
      keys.push_back(key);
      return true;
    });
    if (keys.size() >= k) {
      std::vector<uint32_t> scratch = keys;
      kth_largest(scratch, k, threshold, larger);
      Picker pick{threshold, k - larger, indices};
      size_t c = 0;
      while (pick.offer(where[c], keys[c], k)) ++c;
      return;
    }
  }
  // No guess, or it was too high: std::nth_element on a scratch copy of every key, then one pass.
  std::vector<uint32_t> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = abs_key(src[i]);
  kth_largest(keys, k, threshold, larger);
  Picker pick{threshold, k - larger, indices};
  for_each_key_at_least(src, n, threshold,
                        [&](size_t i, uint32_t key) { return pick.offer(i, key, k); });
}

void random_k(uint64_t seed, size_t n, size_t k, uint32_t* indices) {
  if (k == 0) return;
  // Floyd's algorithm: for j = n-k .. n-1, draw t in [0, j] and take t, or j if t is taken.
  // Every k-subset is equally likely, with exactly k draws. Membership is a bitmap when k is a
  // sizeable fraction of n (the bitmap's scan then yields ascending order for free), a hash set
  // otherwise; both take the same draws, so the subset does not depend on the choice.
  UniformDraws draws(seed);
  if (k >= n / 1024) {
    std::vector<uint64_t> taken((n + 63) / 64, 0);
    for (size_t j = n - k; j < n; ++j) {
      uint64_t t = draws.below(j + 1);
      if (taken[t / 64] >> (t % 64) & 1) t = j;
      taken[t / 64] |= uint64_t{1} << (t % 64);
    }
    size_t out = 0;
    for (size_t w = 0; w < taken.size(); ++w) {
      for (uint64_t bits = taken[w]; bits != 0; bits &= bits - 1) {
        const auto bit = static_cast<unsigned>(__builtin_ctzll(bits));
        indices[out++] = static_cast<uint32_t>(w * 64 + bit);
      }
    }
    return;
  }
  IndexSet set(k);
  size_t out = 0;
  for (size_t j = n - k; j < n; ++j) {
    uint64_t t = draws.below(j + 1);
    if (!set.insert(t)) {
      t = j;
      set.insert(t);
    }
    indices[out++] = static_cast<uint32_t>(t);
  }
  std::sort(indices, indices + k);
}

void gather(const float* src, const uint32_t* indices, size_t k, float* values) {
  for (size_t j = 0; j < k; ++j) values[j] = src[indices[j]];
}

void scatter_add(const uint32_t* indices, const float* values, size_t k, float scale, float* dst) {
  for (size_t j = 0; j < k; ++j) dst[indices[j]] += scale * values[j];
}

}  // namespace troupe::comm
