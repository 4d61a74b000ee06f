#include "comm/codecs/minmax4.h"

#include "comm/codecs/minmax_common.h"

namespace troupe::comm {
namespace {

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
      if (kAdd) d[len - 1] += last;
      else d[len - 1] = last;
    }
  }
};

using Kernels = minmax::MinMaxKernels<Codes4>;

}  // namespace

size_t minmax4_bytes(size_t n, size_t block) { return minmax::encoded_bytes<Codes4>(n, block); }

void minmax4_encode(const float* src, size_t n, size_t block, uint8_t* out) {
  Kernels::encode(src, n, block, out);
}

void minmax4_decode(const uint8_t* in, size_t n, size_t block, float* dst) {
  Kernels::decode(in, n, block, dst);
}

void minmax4_decode_add(const uint8_t* in, size_t n, size_t block, float* dst) {
  Kernels::decode_add(in, n, block, dst);
}

}  // namespace troupe::comm
