#pragma once
// The arithmetic of one min-max block on the GPU, written once for the kernels of codecs.cu and
// for tests/cuda/minmax_codes_test.cpp, which runs it on the CPU against comm::minmax_encode (no
// GPU needed): each element's rank in the CPU's min/max search (which decides the sign of a zero
// in the header), the rounding of a value to its code, the packing of codes into bytes at each
// width, and decoding. What the kernels add around it is only the mapping of threads to bytes.
// Internal to cuda/: plain C++ when the compiler is not nvcc.
#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define TROUPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_HOST_DEVICE
#endif

namespace troupe::cuda::minmax {

// Float operations whose rounding is named: on the device nvcc never fuses __fmul_rn and
// __fadd_rn into a multiply-add (GCC builds comm/ for x86-64 without FMA, so the CPU rounds each
// operation); on the host they are the plain operations, compiled as comm/'s are.
TROUPE_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TROUPE_HOST_DEVICE inline float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TROUPE_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The CPU finds a block's min and max with sixteen lanes (element j in lane j % 16 while
// j < 16 * (len / 16)), merges the lanes in a fixed tree and then scans the tail; ties keep
// whichever element that order meets first. Equal floats differ in their bits only as +0 and -0,
// so only the sign of a zero min or max depends on it. Each element's rank in that order (its
// "priority") is computable on its own; the GPU keeps, among equal values, the one of lowest
// priority, which makes its result independent of its own reduction order and equal to the CPU's.

/// Priority of element j of a block of len for the min: x[0] first, then lane (a, c) = (k / 4,
/// k % 4) for k = j % 16 in the order lv[c] picks it (c ascending; a descending, since min4 keeps
/// its second operand on a tie; within a lane the first element), then the tail in order.
TROUPE_HOST_DEVICE inline uint64_t min_priority(uint64_t j, uint64_t len) {
  if (j == 0) return 0;
  const uint64_t lanes = len / 16, vector_end = 16 * lanes;
  if (j >= vector_end) return 1 + j;
  const uint64_t k = j % 16, a = k / 4, c = k % 4, t = j / 16;
  return 1 + c * 4 * lanes + (3 - a) * lanes + t;
}

/// The same for the max: max4 keeps its first operand on a tie (a ascending) and a lane keeps its
/// last element (t descending).
TROUPE_HOST_DEVICE inline uint64_t max_priority(uint64_t j, uint64_t len) {
  if (j == 0) return 0;
  const uint64_t lanes = len / 16, vector_end = 16 * lanes;
  if (j >= vector_end) return 1 + j;
  const uint64_t k = j % 16, a = k / 4, c = k % 4, t = j / 16;
  return 1 + c * 4 * lanes + a * lanes + (lanes - 1 - t);
}

/// A candidate for a block's min or max: a value and its priority. Before any element, the min's
/// is (+inf, max priority) and the max's (-inf, max priority).
struct Pick {
  float value;
  uint64_t priority;
};

/// The better candidate for the min (kMax false) or the max: the smaller (larger) value, and among
/// equal values the lower priority. Associative and commutative on a block's candidates (their
/// priorities differ), so any tree of threads gives the CPU's pick.
template <bool kMax>
TROUPE_HOST_DEVICE inline Pick better(Pick a, Pick b) {
  const bool b_wins = (kMax ? b.value > a.value : b.value < a.value) ||
                      (b.value == a.value && b.priority < a.priority);
  return b_wins ? b : a;
}

/// Offers element j of a block of len, of value v, to one thread's candidates.
TROUPE_HOST_DEVICE inline void offer(float v, uint64_t j, uint64_t len, Pick& lo, Pick& hi) {
  // Priorities only matter between equal values.
  if (v <= lo.value) {
    const uint64_t p = min_priority(j, len);
    if (v < lo.value || p < lo.priority) lo = {v, p};
  }
  if (v >= hi.value) {
    const uint64_t p = max_priority(j, len);
    if (v > hi.value || p < hi.priority) hi = {v, p};
  }
}

/// The encoder's scale kMaxCode / (max - min), in double as comm's inverse_step_of; 0 for a
/// constant block, whose codes are all 0.
template <int kMaxCode>
TROUPE_HOST_DEVICE inline float inverse_step(float lo, float hi) {
  return hi > lo ? static_cast<float>(static_cast<double>(kMaxCode) /
                                      (static_cast<double>(hi) - static_cast<double>(lo)))
                 : 0.0f;
}

/// The decoder's step (max - min) / kMaxCode, in double as comm's step_of.
template <int kMaxCode>
TROUPE_HOST_DEVICE inline float step(float lo, float hi) {
  return static_cast<float>((static_cast<double>(hi) - static_cast<double>(lo)) /
                            static_cast<double>(kMaxCode));
}

/// comm's code_of: t = (x - min) * inv + 0.5 >= 0.5, clamped at kMaxCode, truncated.
template <int kMaxCode>
TROUPE_HOST_DEVICE inline uint32_t code_of(float x, float lo, float inv) {
  constexpr float kTop = static_cast<float>(kMaxCode);
  float t = add_rn(mul_rn(sub_rn(x, lo), inv), 0.5f);
  t = t < kTop ? t : kTop;
  return static_cast<uint32_t>(static_cast<int32_t>(t));
}

/// The decoded value of a code, lo + step * q.
TROUPE_HOST_DEVICE inline float value_of(uint32_t q, float lo, float step) {
  return add_rn(lo, mul_rn(step, static_cast<float>(q)));
}

template <bool kAdd>
TROUPE_HOST_DEVICE inline void put(float* d, float v) {
  if (kAdd)
    *d = add_rn(*d, v);
  else
    *d = v;
}

/// The packing of one code width: a block's codes are bytes u = 0, 1, ... each holding
/// kCodesPerByte codes; encode_byte computes byte u of a block of len elements x[0, len), and
/// decode_byte writes (or adds) the elements byte u holds.
template <int kBits>
struct Codes;

/// One byte per element.
template <>
struct Codes<8> {
  static constexpr int kMaxCode = 255;
  static constexpr size_t kCodesPerByte = 1;

  TROUPE_HOST_DEVICE static uint8_t encode_byte(const float* x, size_t /*len*/, size_t u, float lo,
                                                float inv) {
    return static_cast<uint8_t>(code_of<kMaxCode>(x[u], lo, inv));
  }
  template <bool kAdd>
  TROUPE_HOST_DEVICE static void decode_byte(uint8_t q, size_t /*len*/, size_t u, float lo,
                                             float step, float* d) {
    put<kAdd>(d + u, value_of(q, lo, step));
  }
};

/// Two codes a byte: element 2u in the low nibble, 2u + 1 in the high one; an odd block's last
/// byte has a zero high nibble.
template <>
struct Codes<4> {
  static constexpr int kMaxCode = 15;
  static constexpr size_t kCodesPerByte = 2;

  TROUPE_HOST_DEVICE static uint8_t encode_byte(const float* x, size_t len, size_t u, float lo,
                                                float inv) {
    const size_t even = 2 * u;
    uint32_t byte = code_of<kMaxCode>(x[even], lo, inv);
    if (even + 1 < len) byte |= code_of<kMaxCode>(x[even + 1], lo, inv) << 4;
    return static_cast<uint8_t>(byte);
  }
  template <bool kAdd>
  TROUPE_HOST_DEVICE static void decode_byte(uint8_t q, size_t len, size_t u, float lo, float step,
                                             float* d) {
    const size_t even = 2 * u;
    put<kAdd>(d + even, value_of(q & 15u, lo, step));
    if (even + 1 < len) put<kAdd>(d + even + 1, value_of(q >> 4, lo, step));
  }
};

/// Bytes of the codes of a block of len elements.
template <class C>
TROUPE_HOST_DEVICE inline size_t code_bytes(size_t len) {
  return (len + C::kCodesPerByte - 1) / C::kCodesPerByte;
}

}  // namespace troupe::cuda::minmax
