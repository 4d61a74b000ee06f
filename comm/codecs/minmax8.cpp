#include "comm/codecs/minmax8.h"

#include "comm/codecs/minmax_common.h"

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
      if (kAdd) d[j] += v;
      else d[j] = v;
    }
  }
};

using Kernels = minmax::MinMaxKernels<Codes8>;

}  // namespace

size_t minmax8_bytes(size_t n, size_t block) { return minmax::encoded_bytes<Codes8>(n, block); }

void minmax8_encode(const float* src, size_t n, size_t block, uint8_t* out) {
  Kernels::encode(src, n, block, out);
}

void minmax8_decode(const uint8_t* in, size_t n, size_t block, float* dst) {
  Kernels::decode(in, n, block, dst);
}

void minmax8_decode_add(const uint8_t* in, size_t n, size_t block, float* dst) {
  Kernels::decode_add(in, n, block, dst);
}

}  // namespace troupe::comm
