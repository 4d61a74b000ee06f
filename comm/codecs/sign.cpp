#include "comm/codecs/sign.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/cpu_features.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

// SSE vectors are wide enough for these memory-bound loops; only sign_pack has an AVX2 build.

// The eight values (+1 or -1) that each byte of sign bits stands for, so that unpacking is a
// multiply by a contiguous row: a loop GCC vectorises without variable shifts.
struct SignTable {
  float row[256][8];
};
constexpr SignTable make_sign_table() {
  SignTable t{};
  for (int b = 0; b < 256; ++b)
    for (int l = 0; l < 8; ++l) t.row[b][l] = (b >> l) & 1 ? -1.0f : 1.0f;
  return t;
}
constexpr SignTable kSigns = make_sign_table();

// The bits of the last, partial byte (n % 8 elements, the high bits 0).
TROUPE_INLINE uint8_t pack_tail(const float* src, size_t n) {
  uint32_t byte = 0;
  for (size_t l = 0; l < n; ++l) byte |= static_cast<uint32_t>(src[l] < 0.0f) << l;
  return static_cast<uint8_t>(byte);
}

// SSE2 (baseline on x86-64): a compare and a movemask give four bits at a time.
void pack_generic(const float* src, size_t n, uint8_t* bits) {
  const __m128 zero = _mm_setzero_ps();
  const size_t full = n / 8;
  for (size_t b = 0; b < full; ++b) {
    int lo = _mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(src + 8 * b), zero));
    int hi = _mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(src + 8 * b + 4), zero));
    bits[b] = static_cast<uint8_t>(lo | hi << 4);
  }
  if (n % 8) bits[full] = pack_tail(src + 8 * full, n % 8);
}

__attribute__((target("avx2"))) void pack_avx2(const float* src, size_t n, uint8_t* bits) {
  const __m256 zero = _mm256_setzero_ps();
  const size_t full = n / 8;
  size_t b = 0;
  for (; b + 4 <= full; b += 4) {
    const float* x = src + 8 * b;
    uint32_t word = 0;
    for (int j = 0; j < 4; ++j) {
      uint32_t m = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8 * j), zero, _CMP_LT_OQ)));
      word |= m << (8 * j);
    }
    std::memcpy(bits + b, &word, 4);  // little-endian: byte b first
  }
  for (; b < full; ++b)
    bits[b] = static_cast<uint8_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(src + 8 * b), zero, _CMP_LT_OQ)));
  if (n % 8) bits[full] = pack_tail(src + 8 * full, n % 8);
}

typedef float Float4 __attribute__((vector_size(16)));

TROUPE_INLINE Float4 load4(const float* x) {
  Float4 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

template <bool kAdd>
TROUPE_INLINE void unpack_loop(const uint8_t* bits, size_t n, float scale, float* dst) {
  const size_t full = n / 8;
  // On GCC vectors: as a plain loop GCC would not vectorise, since a store to dst (float) might
  // change bits (uint8_t may alias anything).
  for (size_t b = 0; b < full; ++b) {
    const float* row = kSigns.row[bits[b]];
    float* d = dst + 8 * b;
    Float4 lo = scale * load4(row), hi = scale * load4(row + 4);
    if (kAdd) {
      lo += load4(d);
      hi += load4(d + 4);
    }
    std::memcpy(d, &lo, sizeof(lo));
    std::memcpy(d + 4, &hi, sizeof(hi));
  }
  const float* row = kSigns.row[n % 8 ? bits[full] : 0];
  for (size_t l = 0; l < n % 8; ++l) {
    if (kAdd)
      dst[8 * full + l] += scale * row[l];
    else
      dst[8 * full + l] = scale * row[l];
  }
}

typedef uint32_t Bits4 __attribute__((vector_size(16)));

TROUPE_INLINE Float4 abs4(const float* x) {
  Bits4 v;
  std::memcpy(&v, x, sizeof(v));
  v &= 0x7fffffffu;
  Float4 f;
  std::memcpy(&f, &v, sizeof(f));
  return f;
}

}  // namespace

void sign_pack(const float* src, size_t n, uint8_t* bits) {
  if (have_avx2())
    pack_avx2(src, n, bits);
  else
    pack_generic(src, n, bits);
}

void sign_unpack_add(const uint8_t* bits, size_t n, float scale, float* dst) {
  unpack_loop<true>(bits, n, scale, dst);
}

void sign_unpack(const uint8_t* bits, size_t n, float scale, float* dst) {
  unpack_loop<false>(bits, n, scale, dst);
}

float mean_abs(const float* src, size_t n) {
  if (n == 0) return 0.0f;
  // Sixteen float lanes over chunks of 1024 elements (64 additions a lane), each chunk's sum
  // in double: vectorised, and accurate however long the buffer. The chunks' sums are added by
  // groups of 64, level after level (the definition in sign.h).
  static_assert(kMeanAbsChunk == 1024 && kMeanAbsGroup == 64);
  const size_t chunks = n / kMeanAbsChunk;
  thread_local std::vector<double> sums;
  sums.resize(chunks);
  for (size_t k = 0; k < chunks; ++k) {
    const float* x = src + k * kMeanAbsChunk;
    Float4 a{}, b{}, c{}, d{};
    for (size_t j = 0; j < kMeanAbsChunk; j += 16) {
      a += abs4(x + j);
      b += abs4(x + j + 4);
      c += abs4(x + j + 8);
      d += abs4(x + j + 12);
    }
    Float4 s = (a + b) + (c + d);
    sums[k] = static_cast<double>(s[0] + s[1]) + static_cast<double>(s[2] + s[3]);
  }
  size_t m = chunks;
  while (m > 1) {
    const size_t groups = (m + kMeanAbsGroup - 1) / kMeanAbsGroup;
    for (size_t g = 0; g < groups; ++g) {
      double sum = 0.0;
      for (size_t j = g * kMeanAbsGroup; j < std::min(m, (g + 1) * kMeanAbsGroup); ++j)
        sum += sums[j];
      sums[g] = sum;  // g <= g * 64: read before it is written
    }
    m = groups;
  }
  double total = m ? sums[0] : 0.0;
  float rest = 0.0f;
  for (size_t i = chunks * kMeanAbsChunk; i < n; ++i) rest += src[i] < 0.0f ? -src[i] : src[i];
  total += rest;
  return static_cast<float>(total / static_cast<double>(n));
}

void sign_in_place(float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = data[i];
    data[i] = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
  }
}

}  // namespace troupe::comm
