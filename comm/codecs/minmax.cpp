#include "comm/codecs/minmax.h"

#include <string>

#include "comm/codecs/minmax_common.h"
#include "comm/status.h"

namespace troupe::comm {
namespace {

// One byte per element.
struct Codes8 {
  static constexpr int kMaxCode = 255;
  static constexpr size_t kCodesPerByte = 1;

  static TROUPE_INLINE void encode_block(const float* x, size_t len, float lo, float inv,
                                         uint8_t* q) {
    for (size_t j = 0; j < len; ++j)
      q[j] = static_cast<uint8_t>(minmax::code_of<kMaxCode>(x[j], lo, inv));
  }

  template <bool kAdd>
  static TROUPE_INLINE void decode_block(const uint8_t* q, size_t len, float lo, float step,
                                         float* d) {
    for (size_t j = 0; j < len; ++j) {
      float v = lo + step * static_cast<float>(q[j]);
      if (kAdd)
        d[j] += v;
      else
        d[j] = v;
    }
  }
};

// Two codes a byte, the low nibble for the even element; an odd block's last byte has a zero
// high nibble.
struct Codes4 {
  static constexpr int kMaxCode = 15;
  static constexpr size_t kCodesPerByte = 2;

  static TROUPE_INLINE void encode_block(const float* x, size_t len, float lo, float inv,
                                         uint8_t* q) {
    const size_t pairs = len / 2;
    for (size_t j = 0; j < pairs; ++j)
      q[j] = static_cast<uint8_t>(minmax::code_of<kMaxCode>(x[2 * j], lo, inv) |
                                  minmax::code_of<kMaxCode>(x[2 * j + 1], lo, inv) << 4);
    if (len % 2) q[pairs] = static_cast<uint8_t>(minmax::code_of<kMaxCode>(x[len - 1], lo, inv));
  }

  template <bool kAdd>
  static TROUPE_INLINE void decode_block(const uint8_t* q, size_t len, float lo, float step,
                                         float* d) {
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
      if (kAdd)
        d[len - 1] += last;
      else
        d[len - 1] = last;
    }
  }
};

// Calls use(Codes4{}) or use(Codes8{}): the bit width is chosen once per call, the block loops
// are each codec's own.
template <class Use>
auto with_codes(MinMaxBits bits, Use&& use) {
  switch (bits) {
    case MinMaxBits::four:
      return use(Codes4{});
    case MinMaxBits::eight:
      return use(Codes8{});
  }
  throw Error("min-max codec: bits = " + std::to_string(static_cast<int>(bits)) +
              ", expected 4 or 8");
}

}  // namespace

size_t minmax_bytes(MinMaxBits bits, size_t n, size_t block) {
  return with_codes(bits,
                    [&](auto codes) { return minmax::encoded_bytes<decltype(codes)>(n, block); });
}

void minmax_encode(MinMaxBits bits, const float* src, size_t n, size_t block, uint8_t* out) {
  with_codes(bits, [&](auto codes) {
    minmax::MinMaxKernels<decltype(codes)>::encode(src, n, block, out);
  });
}

void minmax_decode(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst) {
  with_codes(
      bits, [&](auto codes) { minmax::MinMaxKernels<decltype(codes)>::decode(in, n, block, dst); });
}

void minmax_decode_add(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst) {
  with_codes(bits, [&](auto codes) {
    minmax::MinMaxKernels<decltype(codes)>::decode_add(in, n, block, dst);
  });
}

}  // namespace troupe::comm
