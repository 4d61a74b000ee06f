#pragma once
// What the min-max codecs of minmax.cpp (8- and 4-bit codes) share: the layout (every block's
// {min, max} float32 pair first, then the codes), the vectorised block range, the rounding of a
// value to its code, and the block loops with their baseline and AVX2 builds. Internal: included
// only by minmax.cpp, which is compiled at -O3 (comm/CMakeLists.txt) so that the loops vectorise.
//
// A codec is a policy type with
//   static constexpr int kMaxCode;         // 2^bits - 1
//   static constexpr size_t kCodesPerByte;  // 8 / bits
//   static void encode_block(const float* x, size_t len, float lo, float inv, uint8_t* q);
//   template <bool kAdd>
//   static void decode_block(const uint8_t* q, size_t len, float lo, float step, float* d);
// the per-element loops of one block, which stay in minmax.cpp; MinMaxKernels<Codec> runs
// them over the blocks.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "comm/cpu_features.h"

#ifndef TROUPE_INLINE
#define TROUPE_INLINE inline __attribute__((always_inline))
#endif

namespace troupe::comm::minmax {

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

// The step between codes, (max - min) / kMaxCode, in double so that a range wider than float's
// maximum still gives a finite step.
template <int kMaxCode>
TROUPE_INLINE float step_of(float lo, float hi) {
  return static_cast<float>((static_cast<double>(hi) - static_cast<double>(lo)) /
                            static_cast<double>(kMaxCode));
}

// kMaxCode / (max - min), the encoder's scale. A constant block has inv == 0: every code is 0 and
// decodes to min exactly.
template <int kMaxCode>
TROUPE_INLINE float inverse_step_of(float lo, float hi) {
  return hi > lo
             ? static_cast<float>(static_cast<double>(kMaxCode) / (static_cast<double>(hi) - lo))
             : 0.0f;
}

// x >= lo, so t >= 0.5 and truncation rounds to nearest; the clamp guards the rounding of
// (max - min) * inv just above kMaxCode.
template <int kMaxCode>
TROUPE_INLINE uint32_t code_of(float x, float lo, float inv) {
  constexpr float kTop = static_cast<float>(kMaxCode);
  float t = (x - lo) * inv + 0.5f;
  t = t < kTop ? t : kTop;
  return static_cast<uint32_t>(static_cast<int32_t>(t));
}

/// Blocks of `block` elements in n (the last may be shorter).
inline size_t block_count(size_t n, size_t block) { return (n + block - 1) / block; }

/// Bytes of the encoding of n elements in blocks of `block`: the headers, then the codes.
template <class Codec>
size_t encoded_bytes(size_t n, size_t block) {
  return block_count(n, block) * 2 * sizeof(float) +
         (n + Codec::kCodesPerByte - 1) / Codec::kCodesPerByte;
}

template <class Codec>
TROUPE_INLINE void encode_blocks(const float* src, size_t n, size_t block, uint8_t* out) {
  const size_t blocks = block_count(n, block);
  uint8_t* codes = out + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block;
    const size_t len = n - begin < block ? n - begin : block;
    const float* x = src + begin;
    float range[2];
    block_range(x, len, range[0], range[1]);
    std::memcpy(out + b * sizeof(range), range, sizeof(range));
    Codec::encode_block(x, len, range[0], inverse_step_of<Codec::kMaxCode>(range[0], range[1]),
                        codes + begin / Codec::kCodesPerByte);
  }
}

template <class Codec, bool kAdd>
TROUPE_INLINE void decode_blocks(const uint8_t* in, size_t n, size_t block, float* dst) {
  const size_t blocks = block_count(n, block);
  const uint8_t* codes = in + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block;
    const size_t len = n - begin < block ? n - begin : block;
    float range[2];
    std::memcpy(range, in + b * sizeof(range), sizeof(range));
    Codec::template decode_block<kAdd>(codes + begin / Codec::kCodesPerByte, len, range[0],
                                       step_of<Codec::kMaxCode>(range[0], range[1]), dst + begin);
  }
}

/// A codec's entry points: the block loops built twice, for the x86-64 baseline and for AVX2,
/// and the one this CPU runs.
template <class Codec>
struct MinMaxKernels {
  static void encode(const float* src, size_t n, size_t block, uint8_t* out) {
    if (have_avx2())
      encode_avx2(src, n, block, out);
    else
      encode_blocks<Codec>(src, n, block, out);
  }
  static void decode(const uint8_t* in, size_t n, size_t block, float* dst) {
    if (have_avx2())
      decode_avx2<false>(in, n, block, dst);
    else
      decode_blocks<Codec, false>(in, n, block, dst);
  }
  static void decode_add(const uint8_t* in, size_t n, size_t block, float* dst) {
    if (have_avx2())
      decode_avx2<true>(in, n, block, dst);
    else
      decode_blocks<Codec, true>(in, n, block, dst);
  }

 private:
  __attribute__((target("avx2"))) static void encode_avx2(const float* src, size_t n, size_t block,
                                                          uint8_t* out) {
    encode_blocks<Codec>(src, n, block, out);
  }
  template <bool kAdd>
  __attribute__((target("avx2"))) static void decode_avx2(const uint8_t* in, size_t n, size_t block,
                                                          float* dst) {
    decode_blocks<Codec, kAdd>(in, n, block, dst);
  }
};

}  // namespace troupe::comm::minmax
