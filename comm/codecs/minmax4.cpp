#include "comm/codecs/minmax4.h"

#include <cstring>

#include "comm/cpu_features.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

typedef float Float4 __attribute__((vector_size(16)));

TROUPE_INLINE Float4 load4(const float* x) {
  Float4 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

TROUPE_INLINE Float4 min4(Float4 a, Float4 b) { return a < b ? a : b; }
TROUPE_INLINE Float4 max4(Float4 a, Float4 b) { return a < b ? b : a; }

// The minimum and maximum of x[0, n), n >= 1, on vectors with four accumulators each (GCC does
// not vectorise a float min/max reduction without -ffast-math); as minmax8.cpp.
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

// The step between codes, (max - min) / 15, in double so that a range wider than float's maximum
// still gives a finite step.
TROUPE_INLINE float step_of(float lo, float hi) {
  return static_cast<float>((static_cast<double>(hi) - static_cast<double>(lo)) / 15.0);
}

// x >= lo, so t >= 0.5 and truncation rounds to nearest; the clamp guards the rounding of
// (max - min) * inv just above 15.
TROUPE_INLINE uint32_t code_of(float x, float lo, float inv) {
  float t = (x - lo) * inv + 0.5f;
  t = t < 15.0f ? t : 15.0f;
  return static_cast<uint32_t>(static_cast<int32_t>(t));
}

TROUPE_INLINE void encode_blocks(const float* src, size_t n, size_t block, uint8_t* out) {
  const size_t blocks = (n + block - 1) / block;
  uint8_t* codes = out + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block;
    const size_t len = n - begin < block ? n - begin : block;
    const float* x = src + begin;
    uint8_t* q = codes + begin / 2;
    float range[2];
    block_range(x, len, range[0], range[1]);
    std::memcpy(out + b * sizeof(range), range, sizeof(range));
    const float lo = range[0];
    // A constant block has inv == 0: every code is 0 and decodes to min exactly.
    const float inv =
        range[1] > lo ? static_cast<float>(15.0 / (static_cast<double>(range[1]) - lo)) : 0.0f;
    const size_t pairs = len / 2;
    for (size_t j = 0; j < pairs; ++j)
      q[j] = static_cast<uint8_t>(code_of(x[2 * j], lo, inv) |
                                  code_of(x[2 * j + 1], lo, inv) << 4);
    if (len % 2) q[pairs] = static_cast<uint8_t>(code_of(x[len - 1], lo, inv));
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
    const uint8_t* q = codes + begin / 2;
    float* d = dst + begin;
    const size_t pairs = len / 2;
    for (size_t j = 0; j < pairs; ++j) {
      const float even = lo + step * static_cast<float>(q[j] & 15);
      const float odd = lo + step * static_cast<float>(q[j] >> 4);
      if (kAdd) {
        d[2 * j] += even;
        d[2 * j + 1] += odd;
      } else {
        d[2 * j] = even;
        d[2 * j + 1] = odd;
      }
    }
    if (len % 2) {
      const float last = lo + step * static_cast<float>(q[pairs] & 15);
      if (kAdd) d[len - 1] += last;
      else d[len - 1] = last;
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

size_t minmax4_bytes(size_t n, size_t block) {
  return (n + block - 1) / block * 2 * sizeof(float) + (n + 1) / 2;
}

void minmax4_encode(const float* src, size_t n, size_t block, uint8_t* out) {
  if (have_avx2()) encode_avx2(src, n, block, out);
  else encode_generic(src, n, block, out);
}

void minmax4_decode(const uint8_t* in, size_t n, size_t block, float* dst) {
  if (have_avx2()) decode_avx2(in, n, block, dst);
  else decode_generic(in, n, block, dst);
}

void minmax4_decode_add(const uint8_t* in, size_t n, size_t block, float* dst) {
  if (have_avx2()) decode_add_avx2(in, n, block, dst);
  else decode_add_generic(in, n, block, dst);
}

}  // namespace troupe::comm
