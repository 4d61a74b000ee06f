// cuda/minmax_codes.h on the CPU: the GPU min-max kernels' arithmetic (the min/max picks by
// priority, the rounding, the packing of 4- and 8-bit codes, decoding) driven as the kernels drive
// it, a warp or a CTA of emulated threads per block, and compared byte for byte with
// comm::minmax_encode. It needs no GPU and no CUDA, so it runs wherever the CPU suite does; the
// kernels themselves are checked against the CPU in codecs_test.cpp where a GPU is.
#include "cuda/minmax_codes.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "comm/codecs/minmax.h"
#include "cuda/codecs.h"
#include "tests/support/random_floats.h"

namespace {

namespace mm = troupe::cuda::minmax;
namespace cpu = troupe::comm;

// The GPU's width is the CPU's, value for value (callers convert one to the other with a cast).
static_assert(static_cast<int>(troupe::cuda::MinMaxBits::four) ==
              static_cast<int>(cpu::MinMaxBits::four));
static_assert(static_cast<int>(troupe::cuda::MinMaxBits::eight) ==
              static_cast<int>(cpu::MinMaxBits::eight));

// codecs.cu's shapes: 256 threads a CTA, a warp per block below 2048 elements, the CTA from there.
constexpr size_t kThreads = 256, kWarp = 32, kCtaBlock = 2048;

/// A block's {min, max} as codecs.cu's block_range finds them: `group` threads each offer the
/// elements rank, rank + group, ...; each warp folds its lanes as the shuffles do (lane r takes
/// lane r + delta for delta 16, 8, 4, 2, 1, a lane past the warp giving its own value back), then
/// the warps' results are folded in order.
void block_range(const float* x, size_t len, size_t group, float& lo_value, float& hi_value) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<mm::Pick> lo(group, {inf, ~uint64_t{0}}), hi(group, {-inf, ~uint64_t{0}});
  for (size_t r = 0; r < group; ++r)
    for (size_t j = r; j < len; j += group) mm::offer(x[j], j, len, lo[r], hi[r]);
  for (size_t warp = 0; warp < group; warp += kWarp) {
    for (size_t delta = kWarp / 2; delta > 0; delta /= 2) {
      const std::vector<mm::Pick> lo_before(lo), hi_before(hi);
      for (size_t r = warp; r < warp + kWarp; ++r) {
        const size_t from = r + delta < warp + kWarp ? r + delta : r;
        lo[r] = mm::better<false>(lo_before[r], lo_before[from]);
        hi[r] = mm::better<true>(hi_before[r], hi_before[from]);
      }
    }
  }
  mm::Pick l = lo[0], h = hi[0];
  for (size_t warp = kWarp; warp < group; warp += kWarp) {
    l = mm::better<false>(l, lo[warp]);
    h = mm::better<true>(h, hi[warp]);
  }
  lo_value = l.value;
  hi_value = h.value;
}

size_t group_for(size_t block) { return block >= kCtaBlock ? kThreads : kWarp; }

/// codecs.cu's minmax_encode_kernel, its threads one after the other.
template <int kBits>
std::vector<uint8_t> gpu_encode(const std::vector<float>& src, size_t block) {
  using C = mm::Codes<kBits>;
  const size_t n = src.size(), blocks = (n + block - 1) / block;
  std::vector<uint8_t> out(blocks * 2 * sizeof(float) + mm::code_bytes<C>(n));
  uint8_t* codes = out.data() + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block, len = std::min(block, n - begin);
    const float* x = src.data() + begin;
    float range[2];
    block_range(x, len, group_for(block), range[0], range[1]);
    std::memcpy(out.data() + b * sizeof(range), range, sizeof(range));
    const float inv = mm::inverse_step<C::kMaxCode>(range[0], range[1]);
    for (size_t u = 0; u < mm::code_bytes<C>(len); ++u)
      codes[begin / C::kCodesPerByte + u] = C::encode_byte(x, len, u, range[0], inv);
  }
  return out;
}

/// codecs.cu's minmax_decode_kernel, into (kAdd: onto) dst.
template <int kBits, bool kAdd>
void gpu_decode(const std::vector<uint8_t>& in, size_t block, std::vector<float>& dst) {
  using C = mm::Codes<kBits>;
  const size_t n = dst.size(), blocks = (n + block - 1) / block;
  const uint8_t* codes = in.data() + blocks * 2 * sizeof(float);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block, len = std::min(block, n - begin);
    float range[2];
    std::memcpy(range, in.data() + b * sizeof(range), sizeof(range));
    const float step = mm::step<C::kMaxCode>(range[0], range[1]);
    for (size_t u = 0; u < mm::code_bytes<C>(len); ++u)
      C::template decode_byte<kAdd>(codes[begin / C::kCodesPerByte + u], len, u, range[0], step,
                                    dst.data() + begin);
  }
}

/// Index of the first byte that differs (sizes must match), or -1.
long first_mismatch(const void* got, const void* want, size_t bytes) {
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  for (size_t i = 0; i < bytes; ++i)
    if (g[i] != w[i]) return static_cast<long>(i);
  return -1;
}

using troupe::test::uniform_floats;
using troupe::test::wide_floats;

/// Blocks whose min or max is a zero, +0 and -0 mixed, so the header's zero signs depend on the
/// CPU's reduction order; every third block is all zeros.
std::vector<float> signed_zero_floats(size_t n, size_t block, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    const size_t b = i / block;
    const float magnitude = b % 3 == 2 ? 0.0f : static_cast<float>(g() % 4);
    const float sign = b % 3 == 0 ? 1.0f : -1.0f;  // zero is the min, or the max
    v[i] = magnitude == 0.0f ? (g() & 1 ? -0.0f : 0.0f) : sign * magnitude;
  }
  return v;
}

template <int kBits>
void check_against_cpu(const std::vector<float>& src, size_t block) {
  const auto bits = static_cast<cpu::MinMaxBits>(kBits);
  const size_t n = src.size();
  CAPTURE(kBits);
  CAPTURE(n);
  CAPTURE(block);
  std::vector<uint8_t> want(cpu::minmax_bytes(bits, n, block));
  cpu::minmax_encode(bits, src.data(), n, block, want.data());
  const std::vector<uint8_t> got = gpu_encode<kBits>(src, block);
  REQUIRE(got.size() == want.size());
  CHECK(first_mismatch(got.data(), want.data(), want.size()) == -1);

  std::vector<float> decoded(n), want_decoded(n);
  std::vector<float> sum = uniform_floats(n, -1.0f, 1.0f, 3), want_sum = sum;
  cpu::minmax_decode(bits, want.data(), n, block, want_decoded.data());
  cpu::minmax_decode_add(bits, want.data(), n, block, want_sum.data());
  gpu_decode<kBits, false>(want, block, decoded);
  gpu_decode<kBits, true>(want, block, sum);
  CHECK(first_mismatch(decoded.data(), want_decoded.data(), n * sizeof(float)) == -1);
  CHECK(first_mismatch(sum.data(), want_sum.data(), n * sizeof(float)) == -1);
}

template <int kBits>
void check_blocks(std::initializer_list<size_t> blocks) {
  for (size_t block : blocks) {
    // Empty, one element, either side of a block (an odd count at 4 bits), a few blocks and a
    // short one, and 100003 (odd).
    for (size_t n :
         {size_t{0}, size_t{1}, block - 1, block, block + 1, 3 * block + 5, size_t{100003}}) {
      const auto seed = static_cast<uint32_t>(n + block);
      check_against_cpu<kBits>(uniform_floats(n, -1.0f, 3.0f, seed), block);
      check_against_cpu<kBits>(wide_floats(n, seed + 1), block);
      check_against_cpu<kBits>(signed_zero_floats(n, block, seed + 2), block);
    }
  }
}

}  // namespace

// Blocks of 16 and 32: the CPU's sixteen lanes exactly; 18, 254: lanes and a tail; 2048: a CTA.
TEST_CASE("the GPU's 4-bit min-max arithmetic, run on the CPU, gives comm's bytes and floats") {
  check_blocks<4>({2, 16, 18, 32, 254, 2048});
}

TEST_CASE("the GPU's 8-bit min-max arithmetic, run on the CPU, gives comm's bytes and floats") {
  check_blocks<8>({1, 15, 16, 17, 255, 2048});
}

TEST_CASE(
    "4-bit codes pack the even element in the low nibble, an odd count's last high nibble 0") {
  // 0..14 then 15 in one block of 16: min 0, max 15, step 1, so code i is i.
  std::vector<float> x(16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  const std::vector<uint8_t> even = gpu_encode<4>(x, 16);
  REQUIRE(even.size() == 8 + 8);
  CHECK(even[8] == 0x10);   // elements 0 (low) and 1 (high)
  CHECK(even[15] == 0xfe);  // elements 14 and 15
  // 15 elements, 0..14 (max 14, so code i is round(i * 15 / 14)): the last byte holds element 14
  // alone, code 15, high nibble 0.
  x.pop_back();
  const std::vector<uint8_t> odd = gpu_encode<4>(x, 16);
  REQUIRE(odd.size() == 8 + 8);
  CHECK(odd[15] == 0x0f);
}
