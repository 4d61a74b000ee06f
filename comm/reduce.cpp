#include "comm/reduce.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "comm/cpu_features.h"
#include "comm/status.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

constexpr size_t kLineBytes = 64;

struct Sum {
  template <class T>
  TROUPE_INLINE T operator()(T x, T y) const {
    return x + y;
  }
};
struct Min {
  template <class T>
  TROUPE_INLINE T operator()(T x, T y) const {
    return y < x ? y : x;
  }
};
struct Max {
  template <class T>
  TROUPE_INLINE T operator()(T x, T y) const {
    return x < y ? y : x;
  }
};

template <class T, class F>
TROUPE_INLINE void apply(T* dst, const T* a, const T* b, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
}

template <class T>
TROUPE_INLINE void apply_op(T* dst, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      apply(dst, a, b, n, Sum{});
      break;
    case ReduceOp::min:
      apply(dst, a, b, n, Min{});
      break;
    case ReduceOp::max:
      apply(dst, a, b, n, Max{});
      break;
  }
}

// bfloat16 <-> float are bit shifts, which vectorise on any x86-64.
TROUPE_INLINE float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
TROUPE_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <class F>
TROUPE_INLINE void apply_bf16(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(f(bf16_to_f32(a[i]), bf16_to_f32(b[i])));
}

template <class F>
TROUPE_INLINE void apply_f16_scalar(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n,
                                    F f) {
  for (size_t i = 0; i < n; ++i)
    dst[i] = float_to_half(f(half_to_float(a[i]), half_to_float(b[i])));
}

// F16C converts 8 halves at a time; the tail goes through the scalar conversion.
__attribute__((target("avx2,f16c"))) void apply_f16_f16c(uint16_t* d, const uint16_t* x,
                                                         const uint16_t* y, size_t n, ReduceOp op) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 u = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    __m256 r = op == ReduceOp::min   ? _mm256_min_ps(v, u)
               : op == ReduceOp::max ? _mm256_max_ps(v, u)
                                     : _mm256_add_ps(u, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  if (op == ReduceOp::min)
    apply_f16_scalar(d + i, x + i, y + i, n - i, Min{});
  else if (op == ReduceOp::max)
    apply_f16_scalar(d + i, x + i, y + i, n - i, Max{});
  else
    apply_f16_scalar(d + i, x + i, y + i, n - i, Sum{});
}

// Every (type, op) loop; inlined into one plain and one AVX2 build below.
template <bool kF16c>
TROUPE_INLINE void reduce_all(void* dst, const void* a, const void* b, size_t n, DataType t,
                              ReduceOp op) {
  auto* d16 = static_cast<uint16_t*>(dst);
  auto* a16 = static_cast<const uint16_t*>(a);
  auto* b16 = static_cast<const uint16_t*>(b);
  switch (t) {
    case DataType::float32:
      apply_op(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b),
               n, op);
      break;
    case DataType::float64:
      apply_op(static_cast<double*>(dst), static_cast<const double*>(a),
               static_cast<const double*>(b), n, op);
      break;
    case DataType::int32:
      apply_op(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
               static_cast<const int32_t*>(b), n, op);
      break;
    case DataType::int64:
      apply_op(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
               static_cast<const int64_t*>(b), n, op);
      break;
    case DataType::bfloat16:
      if (op == ReduceOp::min)
        apply_bf16(d16, a16, b16, n, Min{});
      else if (op == ReduceOp::max)
        apply_bf16(d16, a16, b16, n, Max{});
      else
        apply_bf16(d16, a16, b16, n, Sum{});
      break;
    case DataType::float16:
      if (kF16c)
        apply_f16_f16c(d16, a16, b16, n, op);
      else if (op == ReduceOp::min)
        apply_f16_scalar(d16, a16, b16, n, Min{});
      else if (op == ReduceOp::max)
        apply_f16_scalar(d16, a16, b16, n, Max{});
      else
        apply_f16_scalar(d16, a16, b16, n, Sum{});
      break;
  }
}

void reduce_generic(void* dst, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  reduce_all<false>(dst, a, b, n, t, op);
}

__attribute__((target("avx2,fma,f16c"))) void reduce_avx2(void* dst, const void* a, const void* b,
                                                          size_t n, DataType t, ReduceOp op) {
  reduce_all<true>(dst, a, b, n, t, op);
}

// x / 2^k and x * 2^-k are the same real number, rounded alike, for every x (subnormal results,
// infinities and NaN included): a power-of-two world divides with a multiply, several times
// faster than a divide, bit for bit the same.
template <class T>
void divide_float(T* p, size_t n, int divisor) {
  if ((divisor & (divisor - 1)) == 0) {
    const T reciprocal = T(1) / static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) p[i] *= reciprocal;
  } else {
    const T d = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) p[i] /= d;
  }
}

// reduce_to_two's float32 sum: r = a + b, then r * k (kMul: a power-of-two divisor's exact
// reciprocal, as divide_float does) or r / k (kDiv), or r as it is (kPlain).
enum SumMode { kPlain, kMul, kDiv };

TROUPE_INLINE float finish(float r, SumMode mode, float k) {
  return mode == kPlain ? r : mode == kMul ? r * k : r / k;
}

TROUPE_INLINE void sum_to_two_tail(float* o1, float* o2, const float* a, const float* b, size_t i,
                                   size_t n, SumMode mode, float k) {
  for (; i < n; ++i) {
    const float r = finish(a[i] + b[i], mode, k);
    o1[i] = r;
    o2[i] = r;
  }
}

// The vector loop on GCC vectors of `sizeof(V) / 4` floats, built once per instruction set.
template <class V>
TROUPE_INLINE void sum_to_two(float* o1, float* o2, const float* a, const float* b, size_t n,
                              SumMode mode, float k) {
  constexpr size_t kLanes = sizeof(V) / sizeof(float);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    V x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    V r = x + y;
    if (mode == kMul)
      r *= k;
    else if (mode == kDiv)
      r /= k;
    std::memcpy(o1 + i, &r, sizeof r);
    std::memcpy(o2 + i, &r, sizeof r);
  }
  sum_to_two_tail(o1, o2, a, b, i, n, mode, k);
}

typedef float Float8 __attribute__((vector_size(32)));
typedef float Float16 __attribute__((vector_size(64)));

// copy()'s loop: four vectors loaded, then stored, per iteration; the tail through memcpy (below
// a vector: no rep movsb). The empty asm keeps GCC from turning the loop back into a memcpy call.
template <class V>
TROUPE_INLINE void copy_vectors(char* dst, const char* src, size_t n) {
  constexpr size_t k = sizeof(V);
  size_t i = 0;
  for (; i + 4 * k <= n; i += 4 * k) {
    V a, b, c, d;
    std::memcpy(&a, src + i, k);
    std::memcpy(&b, src + i + k, k);
    std::memcpy(&c, src + i + 2 * k, k);
    std::memcpy(&d, src + i + 3 * k, k);
    std::memcpy(dst + i, &a, k);
    std::memcpy(dst + i + k, &b, k);
    std::memcpy(dst + i + 2 * k, &c, k);
    std::memcpy(dst + i + 3 * k, &d, k);
    asm volatile("" ::: "memory");
  }
  for (; i + k <= n; i += k) {
    V a;
    std::memcpy(&a, src + i, k);
    std::memcpy(dst + i, &a, k);
  }
  std::memcpy(dst + i, src + i, n - i);
}

// The middle of stream_copy: `n` bytes, a multiple of four vectors, to a vector-aligned dst,
// with non-temporal stores.
__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256 a = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i));
    const __m256 b = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i + 32));
    const __m256 c = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i + 64));
    const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i + 96));
    _mm256_stream_ps(reinterpret_cast<float*>(dst + i), a);
    _mm256_stream_ps(reinterpret_cast<float*>(dst + i + 32), b);
    _mm256_stream_ps(reinterpret_cast<float*>(dst + i + 64), c);
    _mm256_stream_ps(reinterpret_cast<float*>(dst + i + 96), d);
  }
}
__attribute__((target("avx512f"))) void stream_avx512(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 256) {
    const __m512 a = _mm512_loadu_ps(src + i);
    const __m512 b = _mm512_loadu_ps(src + i + 64);
    const __m512 c = _mm512_loadu_ps(src + i + 128);
    const __m512 d = _mm512_loadu_ps(src + i + 192);
    _mm512_stream_ps(reinterpret_cast<float*>(dst + i), a);
    _mm512_stream_ps(reinterpret_cast<float*>(dst + i + 64), b);
    _mm512_stream_ps(reinterpret_cast<float*>(dst + i + 128), c);
    _mm512_stream_ps(reinterpret_cast<float*>(dst + i + 192), d);
  }
}
void stream_sse(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(src + i));
    const __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 16));
    const __m128 c = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 32));
    const __m128 d = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 48));
    _mm_stream_ps(reinterpret_cast<float*>(dst + i), a);
    _mm_stream_ps(reinterpret_cast<float*>(dst + i + 16), b);
    _mm_stream_ps(reinterpret_cast<float*>(dst + i + 32), c);
    _mm_stream_ps(reinterpret_cast<float*>(dst + i + 48), d);
  }
}

__attribute__((target("avx2"))) void copy_avx2(char* dst, const char* src, size_t n) {
  copy_vectors<Float8>(dst, src, n);
}
__attribute__((target("avx512f"))) void copy_avx512(char* dst, const char* src, size_t n) {
  copy_vectors<Float16>(dst, src, n);
}

void sum_to_two_generic(float* o1, float* o2, const float* a, const float* b, size_t n,
                        SumMode mode, float k) {
  sum_to_two_tail(o1, o2, a, b, 0, n, mode, k);
}
__attribute__((target("avx2"))) void sum_to_two_avx2(float* o1, float* o2, const float* a,
                                                     const float* b, size_t n, SumMode mode,
                                                     float k) {
  sum_to_two<Float8>(o1, o2, a, b, n, mode, k);
}
__attribute__((target("avx512f"))) void sum_to_two_avx512(float* o1, float* o2, const float* a,
                                                          const float* b, size_t n, SumMode mode,
                                                          float k) {
  sum_to_two<Float16>(o1, o2, a, b, n, mode, k);
}

// The vector loops below use F16C conversions and FMA beside AVX2.
bool have_vector_loops() {
  static const bool yes = have_avx2() && cpu_features().f16c && cpu_features().fma;
  return yes;
}

}  // namespace

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {                        // below the smallest normal half
    if (abs < 0x33000000u) return sign;           // rounds to zero
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (112 - e) + 1 - 1
    uint32_t half_m = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half_m & 1u))) ++half_m;
    return sign | static_cast<uint16_t>(half_m);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

float bfloat16_to_float(uint16_t b) { return bf16_to_f32(b); }
uint16_t float_to_bfloat16(float f) { return f32_to_bf16(f); }

void reduce(void* dst, const void* a, const void* b, size_t count, DataType type, ReduceOp op) {
  if (count == 0) return;
  if (have_vector_loops())
    reduce_avx2(dst, a, b, count, type, op);
  else
    reduce_generic(dst, a, b, count, type, op);
}

void reduce_to_two(void* out1, void* out2, const void* a, const void* b, size_t count,
                   DataType type, ReduceOp op, int divisor) {
  if (divisor < 1)
    throw Error("reduce_to_two: divisor " + std::to_string(divisor) + " is not >= 1");
  if (count == 0) return;
  if (type == DataType::float32 && (op == ReduceOp::sum || op == ReduceOp::avg)) {
    const int d = op == ReduceOp::avg ? divisor : 1;
    const SumMode mode = d == 1 ? kPlain : (d & (d - 1)) == 0 ? kMul : kDiv;
    const float k = mode == kMul ? 1.0f / static_cast<float>(d) : static_cast<float>(d);
    auto* o1 = static_cast<float*>(out1);
    auto* o2 = static_cast<float*>(out2);
    const auto* x = static_cast<const float*>(a);
    const auto* y = static_cast<const float*>(b);
    if (cpu_features().avx512f)
      sum_to_two_avx512(o1, o2, x, y, count, mode, k);
    else if (have_avx2())
      sum_to_two_avx2(o1, o2, x, y, count, mode, k);
    else
      sum_to_two_generic(o1, o2, x, y, count, mode, k);
    return;
  }
  reduce(out1, a, b, count, type, op);
  if (op == ReduceOp::avg) divide(out1, count, type, divisor);
  if (out2 != out1) copy(out2, out1, count * element_size(type));
}

void copy(void* dst, const void* src, size_t bytes) {
  // Below 1 KiB glibc copies with vector moves too (its rep movsb starts above 2 KiB).
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (bytes < 1024)
    std::memcpy(d, s, bytes);
  else if (cpu_features().avx512f)
    copy_avx512(d, s, bytes);
  else if (have_avx2())
    copy_avx2(d, s, bytes);
  else
    copy_vectors<__m128>(d, s, bytes);
}

void stream_copy(void* dst, const void* src, size_t bytes) {
  if (bytes < kStreamCopyBytes) {
    copy(dst, src, bytes);
    return;
  }
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Stores of whole lines, aligned as the widest store wants; the ends through copy().
  const size_t vector = cpu_features().avx512f ? 64 : have_avx2() ? 32 : 16;
  const size_t head = (kLineBytes - reinterpret_cast<uintptr_t>(d) % kLineBytes) % kLineBytes;
  const size_t middle = (bytes - head) / (4 * vector) * (4 * vector);
  copy(d, s, head);
  if (vector == 64)
    stream_avx512(d + head, s + head, middle);
  else if (vector == 32)
    stream_avx2(d + head, s + head, middle);
  else
    stream_sse(d + head, s + head, middle);
  copy(d + head + middle, s + head + middle, bytes - head - middle);
  _mm_sfence();  // non-temporal stores are not ordered with later stores without it
}

void divide(void* data, size_t count, DataType type, int divisor) {
  if (divisor < 1) throw Error("divide: divisor " + std::to_string(divisor) + " is not >= 1");
  if (divisor == 1 || count == 0) return;
  switch (type) {
    case DataType::float32:
      divide_float(static_cast<float*>(data), count, divisor);
      break;
    case DataType::float64:
      divide_float(static_cast<double*>(data), count, divisor);
      break;
    case DataType::int32: {
      auto* p = static_cast<int32_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] /= divisor;
      break;
    }
    case DataType::int64: {
      auto* p = static_cast<int64_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] /= divisor;
      break;
    }
    case DataType::float16: {
      auto* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = float_to_half(half_to_float(p[i]) / d);
      break;
    }
    case DataType::bfloat16: {
      auto* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = f32_to_bf16(bf16_to_f32(p[i]) / d);
      break;
    }
  }
}

void scale(void* data, size_t count, DataType type, double factor) {
  switch (type) {
    case DataType::float32: {
      auto* p = static_cast<float*>(data);
      const float f = static_cast<float>(factor);
      for (size_t i = 0; i < count; ++i) p[i] *= f;
      break;
    }
    case DataType::float64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < count; ++i) p[i] *= factor;
      break;
    }
    case DataType::int32: {
      auto* p = static_cast<int32_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] = static_cast<int32_t>(p[i] * factor);
      break;
    }
    case DataType::int64: {
      auto* p = static_cast<int64_t*>(data);
      for (size_t i = 0; i < count; ++i)
        p[i] = static_cast<int64_t>(static_cast<double>(p[i]) * factor);
      break;
    }
    case DataType::float16: {
      auto* p = static_cast<uint16_t*>(data);
      const float f = static_cast<float>(factor);
      for (size_t i = 0; i < count; ++i) p[i] = float_to_half(half_to_float(p[i]) * f);
      break;
    }
    case DataType::bfloat16: {
      auto* p = static_cast<uint16_t*>(data);
      const float f = static_cast<float>(factor);
      for (size_t i = 0; i < count; ++i) p[i] = f32_to_bf16(bf16_to_f32(p[i]) * f);
      break;
    }
  }
}

}  // namespace troupe::comm
