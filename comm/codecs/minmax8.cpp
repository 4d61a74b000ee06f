#include "comm/codecs/minmax8.h"

#include <cstring>

#include "comm/cpu_features.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

// Four floats as one GCC vector (one SSE register, baseline on x86-64).
typedef float Float4 __attribute__((vector_size(16)));

TROUPE_INLINE Float4 load4(const float* x) {
  Float4 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

TROUPE_INLINE Float4 min4(Float4 a, Float4 b) { return a < b ? a : b; }
TROUPE_INLINE Float4 max4(Float4 a, Float4 b) { return a < b ? b : a; }

// The minimum and maximum of x[0, n), n >= 1. Written on vectors because GCC does not vectorise
// a float min/max reduction without -ffast-math (NaN and signed-zero rules); four independent
// accumulators each, so that the loop is not bound by the latency of one min after another.
TROUPE_INLINE void block_range(const float* x, size_t n, float& lo, float& hi) {
  lo = hi = x[0];
  size_t i = 0;
  if (n >= 16) {
    Float4 l[4] = {load4(x), load4(x + 4), load4(x + 8), load4(x + 12)};
    Float4 h[4] = {l[0], l[1], l[2], l[3]};
    for (i = 16; i + 16 <= n; i += 16) {
      for (int a = 0; a < 4; ++a) {
        const Float4 v = load4(x + i + 4 * a);
        l[a] = min4(v, l[a]);
        h[a] = max4(v, h[a]);
      }
    }
    const Float4 lv = min4(min4(l[0], l[1]), min4(l[2], l[3]));
    const Float4 hv = max4(max4(h[0], h[1]), max4(h[2], h[3]));
    for (int j = 0; j < 4; ++j) {
      lo = lv[j] < lo ? lv[j] : lo;
      hi = hi < hv[j] ? hv[j] : hi;
    }
  }
  for (; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = hi < x[i] ? x[i] : hi;
  }
}

// The step between codes: (max - min) / 255, computed in double so that a range wider than
// float's maximum still gives a finite step.
TROUPE_INLINE float step_of(float lo, float hi) {
  return static_cast<float>((static_cast<double>(hi) - static_cast<double>(lo)) / 255.0);
}

TROUPE_INLINE void encode_blocks(const float* src, size_t n, size_t block, uint8_t* out) {
  const size_t blocks = (n + block - 1) / block;
  uint8_t* codes = out + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block;
    const size_t len = n - begin < block ? n - begin : block;
    const float* x = src + begin;
    uint8_t* q = codes + begin;
    float range[2];
    block_range(x, len, range[0], range[1]);
    std::memcpy(out + b * sizeof(range), range, sizeof(range));
    const float lo = range[0];
    // A constant block has inv == 0: every code is 0 and decodes to min exactly.
    const float inv = range[1] > lo ? static_cast<float>(
                                          255.0 / (static_cast<double>(range[1]) - lo))
                                    : 0.0f;
    for (size_t j = 0; j < len; ++j) {
      // x >= lo, so t >= 0.5 and truncation rounds to nearest; the clamp guards the rounding
      // of (max - min) * inv just above 255.
      float t = (x[j] - lo) * inv + 0.5f;
      t = t < 255.0f ? t : 255.0f;
      q[j] = static_cast<uint8_t>(static_cast<int32_t>(t));
    }
  }
}

template <bool kAdd>
TROUPE_INLINE void decode_blocks(const uint8_t* in, size_t n, size_t block, float* dst) {
  const size_t blocks = (n + block - 1) / block;
  const uint8_t* codes = in + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block;
    const size_t len = n - begin < block ? n - begin : block;
    float range[2];
    std::memcpy(range, in + b * sizeof(range), sizeof(range));
    const float lo = range[0];
    const float step = step_of(lo, range[1]);
    const uint8_t* q = codes + begin;
    float* d = dst + begin;
    for (size_t j = 0; j < len; ++j) {
      float v = lo + step * static_cast<float>(q[j]);
      if (kAdd) d[j] += v;
      else d[j] = v;
    }
  }
}

void encode_generic(const float* src, size_t n, size_t block, uint8_t* out) {
  encode_blocks(src, n, block, out);
}
void decode_generic(const uint8_t* in, size_t n, size_t block, float* dst) {
  decode_blocks<false>(in, n, block, dst);
}
void decode_add_generic(const uint8_t* in, size_t n, size_t block, float* dst) {
  decode_blocks<true>(in, n, block, dst);
}
__attribute__((target("avx2"))) void encode_avx2(const float* src, size_t n, size_t block,
                                                 uint8_t* out) {
  encode_blocks(src, n, block, out);
}
__attribute__((target("avx2"))) void decode_avx2(const uint8_t* in, size_t n, size_t block,
                                                 float* dst) {
  decode_blocks<false>(in, n, block, dst);
}
__attribute__((target("avx2"))) void decode_add_avx2(const uint8_t* in, size_t n, size_t block,
                                                     float* dst) {
  decode_blocks<true>(in, n, block, dst);
}

}  // namespace

size_t minmax8_bytes(size_t n, size_t block) {
  return (n + block - 1) / block * 2 * sizeof(float) + n;
}

void minmax8_encode(const float* src, size_t n, size_t block, uint8_t* out) {
  if (have_avx2()) encode_avx2(src, n, block, out);
  else encode_generic(src, n, block, out);
}

void minmax8_decode(const uint8_t* in, size_t n, size_t block, float* dst) {
  if (have_avx2()) decode_avx2(in, n, block, dst);
  else decode_generic(in, n, block, dst);
}

void minmax8_decode_add(const uint8_t* in, size_t n, size_t block, float* dst) {
  if (have_avx2()) decode_add_avx2(in, n, block, dst);
  else decode_add_generic(in, n, block, dst);
}

}  // namespace troupe::comm
