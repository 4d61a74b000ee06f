#include "comm/codecs/half.h"

#include <immintrin.h>

#include <cstring>

#include "comm/cpu_features.h"
#include "comm/reduce.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

// The same bit operations as comm/reduce.cpp's bfloat16 conversions (round to nearest even, NaN
// kept quiet), written as selects so that the loops below vectorise.
TROUPE_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
TROUPE_INLINE float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TROUPE_INLINE void encode_bf16_loop(const float* src, size_t n, float scale, uint16_t* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i] * scale);
}
TROUPE_INLINE void decode_bf16_loop(const uint16_t* src, size_t n, float scale, float* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]) * scale;
}

// Without F16C: the scalar conversions of comm/reduce.cpp, which define the rounding.
void encode_half_generic(const float* src, size_t n, float scale, uint16_t* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i] * scale);
}
void decode_half_generic(const uint16_t* src, size_t n, float scale, float* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]) * scale;
}

// F16C converts 8 values at a time (the same rounding as float_to_half, which the tests check);
// the tail goes through the scalar conversion.
__attribute__((target("avx2,f16c"))) void encode_half_f16c(const float* src, size_t n, float scale,
                                                           uint16_t* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(src + i), s);
    __m256 b = _mm256_mul_ps(_mm256_loadu_ps(src + i + 8), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 8),
                     _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(src + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
  }
  encode_half_generic(src + i, n - i, scale, dst + i);
}
__attribute__((target("avx2,f16c"))) void decode_half_f16c(const uint16_t* src, size_t n,
                                                           float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(a, s));
    _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(b, s));
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(a, s));
  }
  decode_half_generic(src + i, n - i, scale, dst + i);
}

void encode_bf16_generic(const float* src, size_t n, float scale, uint16_t* dst) {
  encode_bf16_loop(src, n, scale, dst);
}
void decode_bf16_generic(const uint16_t* src, size_t n, float scale, float* dst) {
  decode_bf16_loop(src, n, scale, dst);
}
__attribute__((target("avx2"))) void encode_bf16_avx2(const float* src, size_t n, float scale,
                                                      uint16_t* dst) {
  encode_bf16_loop(src, n, scale, dst);
}
__attribute__((target("avx2"))) void decode_bf16_avx2(const uint16_t* src, size_t n, float scale,
                                                      float* dst) {
  decode_bf16_loop(src, n, scale, dst);
}

bool have_f16c() { return have_avx2() && cpu_features().f16c; }

}  // namespace

void encode_half(const float* src, size_t n, float scale, uint16_t* dst) {
  if (have_f16c())
    encode_half_f16c(src, n, scale, dst);
  else
    encode_half_generic(src, n, scale, dst);
}

void decode_half(const uint16_t* src, size_t n, float scale, float* dst) {
  if (have_f16c())
    decode_half_f16c(src, n, scale, dst);
  else
    decode_half_generic(src, n, scale, dst);
}

void encode_bfloat16(const float* src, size_t n, float scale, uint16_t* dst) {
  if (have_f16c())
    encode_bf16_avx2(src, n, scale, dst);
  else
    encode_bf16_generic(src, n, scale, dst);
}

void decode_bfloat16(const uint16_t* src, size_t n, float scale, float* dst) {
  if (have_f16c())
    decode_bf16_avx2(src, n, scale, dst);
  else
    decode_bf16_generic(src, n, scale, dst);
}

}  // namespace troupe::comm
