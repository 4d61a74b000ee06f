// The codec kernels (comm/codecs/), each against a naive reference written here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "comm/codecs/half.h"
#include "comm/codecs/low_rank.h"
#include "comm/codecs/minmax.h"
#include "comm/codecs/sign.h"
#include "comm/codecs/sparse.h"
#include "comm/reduce.h"
#include "tests/support/random_floats.h"

using namespace troupe::comm;

namespace {

// Sizes around every vector width and unrolling, so that tails are exercised.
const size_t kSizes[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1001, 4099};

using troupe::test::uniform;
using troupe::test::uniform_floats;

// Floats from random bit patterns (every exponent), NaN excluded.
std::vector<float> any_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    do {
      uint32_t bits = g();
      std::memcpy(&x, &bits, 4);
    } while (std::isnan(x));
  }
  return v;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// float16 / bfloat16

TEST_CASE("fp16 round-trips every value in range exactly") {
  std::vector<uint16_t> halves;
  for (uint32_t h = 0; h < 65536; ++h)
    if (!std::isnan(half_to_float(static_cast<uint16_t>(h))))
      halves.push_back(static_cast<uint16_t>(h));
  REQUIRE(halves.size() % 2 == 0);
  halves.pop_back();  // an odd count, for the tail
  const size_t n = halves.size();
  std::vector<float> values(n), scaled(n), decoded(n);
  for (size_t i = 0; i < n; ++i) {
    values[i] = half_to_float(halves[i]);
    scaled[i] = values[i] * 4.0f;  // exact: a power of two, far from float's limits
  }
  std::vector<uint16_t> encoded(n);
  encode_half(values.data(), n, 1.0f, encoded.data());
  for (size_t i = 0; i < n; ++i) REQUIRE(encoded[i] == halves[i]);

  // The scale applies before the cast: (4x) * 0.25 encodes as x.
  std::fill(encoded.begin(), encoded.end(), 0);
  encode_half(scaled.data(), n, 0.25f, encoded.data());
  for (size_t i = 0; i < n; ++i) REQUIRE(encoded[i] == halves[i]);

  decode_half(halves.data(), n, 1.0f, decoded.data());
  for (size_t i = 0; i < n; ++i) REQUIRE(bits_of(decoded[i]) == bits_of(values[i]));
  decode_half(halves.data(), n, 4.0f, decoded.data());
  for (size_t i = 0; i < n; ++i) REQUIRE(bits_of(decoded[i]) == bits_of(scaled[i]));
}

TEST_CASE("fp16 encoding agrees with the scalar float_to_half on random floats of every size") {
  for (size_t n : kSizes) {
    CAPTURE(n);
    // Magnitudes from far below half's subnormals to far above its maximum.
    std::mt19937 g(static_cast<uint32_t>(n));
    std::vector<float> src(n);
    for (auto& x : src) x = std::ldexp(uniform(g, -1.0f, 1.0f), static_cast<int>(g() % 60) - 35);
    for (float scale : {1.0f, 0.5f, 3.0f}) {
      std::vector<uint16_t> got(n + 1, 0xabcd);
      encode_half(src.data(), n, scale, got.data());
      for (size_t i = 0; i < n; ++i) {
        CAPTURE(src[i]);
        REQUIRE(got[i] == float_to_half(src[i] * scale));
      }
      CHECK(got[n] == 0xabcd);  // nothing written past n
    }
    std::vector<uint16_t> halves(n);
    for (auto& h : halves) h = static_cast<uint16_t>(g());
    std::vector<float> dec(n + 1, 7.0f);
    decode_half(halves.data(), n, 0.5f, dec.data());
    for (size_t i = 0; i < n; ++i) {
      float want = half_to_float(halves[i]) * 0.5f;
      if (std::isnan(want))
        REQUIRE(std::isnan(dec[i]));
      else
        REQUIRE(bits_of(dec[i]) == bits_of(want));
    }
    CHECK(dec[n] == 7.0f);
  }
}

TEST_CASE("fp16 encoding turns values beyond half's range into infinity, like a cast") {
  const float src[] = {65504.0f, 65519.0f, 65520.0f,
                       70000.0f, -1e10f,   std::numeric_limits<float>::infinity(),
                       1e-10f,   -3e38f,   20000.0f};
  const size_t n = sizeof(src) / sizeof(src[0]);
  uint16_t got[n];
  encode_half(src, n, 1.0f, got);
  CHECK(got[0] == 0x7bff);  // the largest half
  CHECK(got[1] == 0x7bff);  // rounds down to it
  CHECK(got[2] == 0x7c00);  // rounds up to infinity
  CHECK(got[3] == 0x7c00);
  CHECK(got[4] == 0xfc00);
  CHECK(got[5] == 0x7c00);
  CHECK(got[6] == 0x0000);  // below half's smallest subnormal
  CHECK(got[7] == 0xfc00);
  CHECK(got[8] == float_to_half(20000.0f));
  // Scaling first: 20000 * 4 overflows half although 20000 does not.
  encode_half(src, n, 4.0f, got);
  CHECK(got[8] == 0x7c00);
}

TEST_CASE("bf16 round-trips every bfloat16 value exactly") {
  std::vector<uint16_t> values;
  for (uint32_t b = 0; b < 65536; ++b)
    if (!std::isnan(bfloat16_to_float(static_cast<uint16_t>(b))))
      values.push_back(static_cast<uint16_t>(b));
  values.pop_back();
  const size_t n = values.size();
  std::vector<float> floats(n);
  decode_bfloat16(values.data(), n, 1.0f, floats.data());
  for (size_t i = 0; i < n; ++i)
    REQUIRE(bits_of(floats[i]) == bits_of(bfloat16_to_float(values[i])));
  std::vector<uint16_t> back(n);
  encode_bfloat16(floats.data(), n, 1.0f, back.data());
  for (size_t i = 0; i < n; ++i) REQUIRE(back[i] == values[i]);
}

TEST_CASE("bf16 encoding agrees with the scalar float_to_bfloat16 on random floats of every size") {
  for (size_t n : kSizes) {
    CAPTURE(n);
    std::vector<float> src = any_floats(n, 11 + static_cast<uint32_t>(n));
    if (n > 2) {
      src[0] = std::numeric_limits<float>::quiet_NaN();
      src[1] = 1.00390625f;  // a tie: rounds to even (1.0)
    }
    for (float scale : {1.0f, 0.125f}) {
      std::vector<uint16_t> got(n + 1, 0xabcd);
      encode_bfloat16(src.data(), n, scale, got.data());
      for (size_t i = 0; i < n; ++i) {
        CAPTURE(src[i]);
        uint16_t want = float_to_bfloat16(src[i] * scale);
        if (std::isnan(src[i]))
          REQUIRE(std::isnan(bfloat16_to_float(got[i])));
        else
          REQUIRE(got[i] == want);
      }
      CHECK(got[n] == 0xabcd);
    }
    if (n > 2) {
      std::vector<uint16_t> one(1);
      encode_bfloat16(&src[1], 1, 1.0f, one.data());
      CHECK(one[0] == 0x3f80);
    }
    std::vector<uint16_t> b16(n);
    encode_bfloat16(src.data(), n, 1.0f, b16.data());
    std::vector<float> dec(n);
    decode_bfloat16(b16.data(), n, 2.0f, dec.data());
    for (size_t i = 0; i < n; ++i) {
      float want = bfloat16_to_float(b16[i]) * 2.0f;
      if (std::isnan(want))
        REQUIRE(std::isnan(dec[i]));
      else
        REQUIRE(bits_of(dec[i]) == bits_of(want));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 8-bit min-max

namespace {

// Decodes src through minmax8 and checks every element against its block's bound.
void check_minmax8(const std::vector<float>& src, size_t block) {
  const size_t n = src.size();
  const size_t blocks = (n + block - 1) / block;
  REQUIRE(minmax_bytes(MinMaxBits::eight, n, block) == blocks * 8 + n);
  std::vector<uint8_t> enc(minmax_bytes(MinMaxBits::eight, n, block) + 1, 0x5a);
  minmax_encode(MinMaxBits::eight, src.data(), n, block, enc.data());
  CHECK(enc.back() == 0x5a);
  std::vector<float> dec(n, -1.0f);
  minmax_decode(MinMaxBits::eight, enc.data(), n, block, dec.data());
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * block, end = std::min(n, begin + block);
    const float lo = *std::min_element(src.begin() + begin, src.begin() + end);
    const float hi = *std::max_element(src.begin() + begin, src.begin() + end);
    float header[2];
    std::memcpy(header, enc.data() + 8 * b, 8);
    REQUIRE(header[0] == lo);
    REQUIRE(header[1] == hi);
    const double bound = (static_cast<double>(hi) - lo) / 510.0 +
                         1e-6 * (std::fabs(lo) + std::fabs(hi) + (static_cast<double>(hi) - lo));
    for (size_t i = begin; i < end; ++i) {
      CAPTURE(b);
      CAPTURE(i);
      REQUIRE(std::fabs(static_cast<double>(dec[i]) - src[i]) <= bound);
      if (hi == lo) REQUIRE(dec[i] == src[i]);
    }
  }
}

}  // namespace

TEST_CASE("8-bit min-max decodes every element within (max - min) / 510 of its block") {
  struct Case {
    size_t n, block;
  };
  for (Case c : {Case{1000, 64}, Case{1001, 7}, Case{5, 16}, Case{1, 1}, Case{17, 1},
                 Case{4096, 4096}, Case{10000, 1000}, Case{4099, 256}, Case{33, 8}}) {
    CAPTURE(c.n);
    CAPTURE(c.block);
    std::vector<float> src = uniform_floats(c.n, -1.0f, 1.0f, static_cast<uint32_t>(c.n));
    // Each block on its own scale and offset, so a shared range would not pass.
    for (size_t i = 0; i < c.n; ++i) {
      size_t b = i / c.block;
      src[i] = src[i] * std::ldexp(1.0f, static_cast<int>(b % 9) - 4) + static_cast<float>(b % 5);
    }
    check_minmax8(src, c.block);
  }
}

TEST_CASE("8-bit min-max hits the bound on codes that fall half-way between two steps") {
  // min 0, max 255: steps of 1, so x = q + 0.5 - tiny decodes exactly 0.5 - tiny away; a codec
  // that truncated instead of rounding would be ~1 away and fail.
  std::vector<float> src(256);
  for (size_t i = 0; i < 256; ++i) src[i] = static_cast<float>(i);
  src[10] = 10.49f;
  src[20] = 20.51f;
  std::vector<uint8_t> enc(minmax_bytes(MinMaxBits::eight, 256, 256));
  minmax_encode(MinMaxBits::eight, src.data(), 256, 256, enc.data());
  std::vector<float> dec(256);
  minmax_decode(MinMaxBits::eight, enc.data(), 256, 256, dec.data());
  CHECK(dec[10] == 10.0f);
  CHECK(dec[20] == 21.0f);
  for (size_t i = 0; i < 256; ++i)
    if (i != 10 && i != 20) REQUIRE(dec[i] == src[i]);
}

TEST_CASE("8-bit min-max decodes constant blocks exactly") {
  std::vector<float> src(100, 3.14159f);
  for (size_t i = 32; i < 64; ++i) src[i] = -1e-7f;
  for (size_t i = 64; i < 96; ++i) src[i] = static_cast<float>(i);  // one varying block
  check_minmax8(src, 32);
  std::vector<uint8_t> enc(minmax_bytes(MinMaxBits::eight, src.size(), 32));
  minmax_encode(MinMaxBits::eight, src.data(), src.size(), 32, enc.data());
  std::vector<float> dec(src.size());
  minmax_decode(MinMaxBits::eight, enc.data(), src.size(), 32, dec.data());
  for (size_t i = 0; i < 64; ++i) REQUIRE(dec[i] == src[i]);
  for (size_t i = 96; i < 100; ++i) REQUIRE(dec[i] == src[i]);  // the short last block
}

TEST_CASE("8-bit min-max decode_add adds the decoded values to the destination") {
  for (size_t n : kSizes) {
    CAPTURE(n);
    std::vector<float> src = uniform_floats(n, -5.0f, 2.0f, 3);
    std::vector<float> base = uniform_floats(n, -1.0f, 1.0f, 4);
    std::vector<uint8_t> enc(minmax_bytes(MinMaxBits::eight, n, 10));
    minmax_encode(MinMaxBits::eight, src.data(), n, 10, enc.data());
    std::vector<float> dec(n), sum = base;
    minmax_decode(MinMaxBits::eight, enc.data(), n, 10, dec.data());
    minmax_decode_add(MinMaxBits::eight, enc.data(), n, 10, sum.data());
    for (size_t i = 0; i < n; ++i) REQUIRE(sum[i] == base[i] + dec[i]);
    check_minmax8(src, 10);
  }
}

TEST_CASE("8-bit min-max of zero elements is zero bytes and touches nothing") {
  CHECK(minmax_bytes(MinMaxBits::eight, 0, 1) == 0);
  CHECK(minmax_bytes(MinMaxBits::eight, 0, 4096) == 0);
  uint8_t out = 0x77;
  float x = 1.0f, dst = 2.0f;
  minmax_encode(MinMaxBits::eight, &x, 0, 8, &out);
  minmax_decode(MinMaxBits::eight, &out, 0, 8, &dst);
  minmax_decode_add(MinMaxBits::eight, &out, 0, 8, &dst);
  CHECK(out == 0x77);
  CHECK(dst == 2.0f);
}

// ---------------------------------------------------------------------------------------------
// Sign

TEST_CASE("sign_pack sets one bit per negative element, least significant first") {
  for (size_t n : kSizes) {
    CAPTURE(n);
    std::vector<float> src = uniform_floats(n, -1.0f, 1.0f, 5 + static_cast<uint32_t>(n));
    for (size_t i = 0; i < n; i += 5) src[i] = 0.0f;
    for (size_t i = 2; i < n; i += 7) src[i] = -0.0f;  // not negative: zero counts as positive
    if (n > 4) src[4] = -std::numeric_limits<float>::quiet_NaN();  // not < 0 either
    std::vector<uint8_t> want(sign_bytes(n), 0);
    for (size_t i = 0; i < n; ++i)
      if (src[i] < 0.0f) want[i / 8] = static_cast<uint8_t>(want[i / 8] | 1u << (i % 8));
    std::vector<uint8_t> got(sign_bytes(n) + 1, 0xff);  // high bits must be cleared
    sign_pack(src.data(), n, got.data());
    for (size_t b = 0; b < want.size(); ++b) {
      CAPTURE(b);
      REQUIRE(got[b] == want[b]);
    }
    CHECK(got[sign_bytes(n)] == 0xff);
  }
  CHECK(sign_bytes(0) == 0);
  CHECK(sign_bytes(8) == 1);
  CHECK(sign_bytes(9) == 2);
}

TEST_CASE("sign_unpack and sign_unpack_add give -scale for a set bit and +scale otherwise") {
  for (size_t n : kSizes) {
    CAPTURE(n);
    std::mt19937 g(static_cast<uint32_t>(n) + 100);
    std::vector<uint8_t> bits(sign_bytes(n));
    for (auto& b : bits) b = static_cast<uint8_t>(g());
    std::vector<float> got(n + 1, 9.0f);
    sign_unpack(bits.data(), n, 0.75f, got.data());
    std::vector<float> base = uniform_floats(n + 1, -2.0f, 2.0f, 6);
    std::vector<float> sum = base;
    sign_unpack_add(bits.data(), n, 0.75f, sum.data());
    for (size_t i = 0; i < n; ++i) {
      const float want = (bits[i / 8] >> (i % 8)) & 1 ? -0.75f : 0.75f;
      REQUIRE(got[i] == want);
      REQUIRE(sum[i] == base[i] + want);
    }
    CHECK(got[n] == 9.0f);
    CHECK(sum[n] == base[n]);
  }
}

TEST_CASE("sign_pack then sign_unpack recovers each element's sign") {
  std::vector<float> src = uniform_floats(1001, -3.0f, 3.0f, 8);
  std::vector<uint8_t> bits(sign_bytes(src.size()));
  sign_pack(src.data(), src.size(), bits.data());
  std::vector<float> out(src.size());
  sign_unpack(bits.data(), src.size(), 2.0f, out.data());
  for (size_t i = 0; i < src.size(); ++i) REQUIRE(out[i] == (src[i] < 0 ? -2.0f : 2.0f));
}

TEST_CASE("mean_abs is the mean of the absolute values, and 0 for no elements") {
  CHECK(mean_abs(nullptr, 0) == 0.0f);
  for (size_t n : {size_t{1}, size_t{5}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{4099},
                   size_t{100003}}) {
    CAPTURE(n);
    std::vector<float> src = uniform_floats(n, -3.0f, 1.0f, 9);
    double want = 0.0;
    for (float x : src) want += std::fabs(x);
    want /= static_cast<double>(n);
    CHECK(mean_abs(src.data(), n) == doctest::Approx(want).epsilon(1e-6));
  }
  const float mixed[] = {-1.0f, 2.0f, -3.0f, 0.0f};
  CHECK(mean_abs(mixed, 4) == 1.5f);
}

// comm::mean_abs's order of additions as sign.h defines it, written out plainly: what the GPU's
// mean_abs must reproduce bit for bit.
static float mean_abs_as_defined(const std::vector<float>& x) {
  const size_t n = x.size();
  if (n == 0) return 0.0f;
  std::vector<double> level;
  for (size_t c = 0; c + 1024 <= n; c += 1024) {
    float lane[16] = {};
    for (size_t t = 0; t < 64; ++t)
      for (size_t l = 0; l < 16; ++l) lane[l] += std::fabs(x[c + 16 * t + l]);
    float s[4];
    for (size_t k = 0; k < 4; ++k) s[k] = (lane[k] + lane[4 + k]) + (lane[8 + k] + lane[12 + k]);
    level.push_back(static_cast<double>(s[0] + s[1]) + static_cast<double>(s[2] + s[3]));
  }
  while (level.size() > 1) {
    std::vector<double> up;
    for (size_t g = 0; g < level.size(); g += 64) {
      double sum = 0.0;
      for (size_t j = g; j < std::min(level.size(), g + 64); ++j) sum += level[j];
      up.push_back(sum);
    }
    level = up;
  }
  double total = level.empty() ? 0.0 : level[0];
  float rest = 0.0f;
  for (size_t i = n / 1024 * 1024; i < n; ++i) rest += std::fabs(x[i]);
  total += rest;
  return static_cast<float>(total / static_cast<double>(n));
}

TEST_CASE("mean_abs adds in the order sign.h defines: lanes, a tree of 64-wide groups, the tail") {
  // Chunks: one group, 65 (a short second group), 4097 (three levels).
  for (size_t n :
       {size_t{1000}, size_t{64 * 1024}, size_t{65 * 1024 + 3}, size_t{4097 * 1024 + 11}}) {
    CAPTURE(n);
    const std::vector<float> src = troupe::test::wide_floats(n, 41 + static_cast<uint32_t>(n));
    const float got = mean_abs(src.data(), n), want = mean_abs_as_defined(src);
    CHECK(std::memcmp(&got, &want, sizeof(float)) == 0);
  }
  // Where the order shows in the float (a chain over the chunks would give 4).
  const std::vector<float> tie = troupe::test::mean_abs_tie();
  CHECK(mean_abs(tie.data(), tie.size()) == troupe::test::kTreeMeanAbs);
  CHECK(mean_abs_as_defined(tie) == troupe::test::kTreeMeanAbs);
}

TEST_CASE("sign_in_place maps negatives to -1, positives to +1 and zeros to 0") {
  for (size_t n : kSizes) {
    std::vector<float> data = uniform_floats(n, -2.0f, 2.0f, 10);
    for (size_t i = 0; i < n; i += 3) data[i] = 0.0f;
    for (size_t i = 1; i < n; i += 11) data[i] = -0.0f;
    std::vector<float> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = data[i] > 0 ? 1.0f : data[i] < 0 ? -1.0f : 0.0f;
    sign_in_place(data.data(), n);
    for (size_t i = 0; i < n; ++i) REQUIRE(data[i] == want[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Sparsification

namespace {

// The k largest |x| by a full sort (ties to the lower index), returned in ascending order.
std::vector<uint32_t> top_k_by_sort(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

void check_top_k(const std::vector<float>& x, size_t k) {
  CAPTURE(x.size());
  CAPTURE(k);
  std::vector<uint32_t> got(k + 1, 0xdeadbeef);
  top_k(x.data(), x.size(), k, got.data());
  CHECK(got[k] == 0xdeadbeef);
  got.resize(k);
  REQUIRE(got == top_k_by_sort(x, k));
}

}  // namespace

TEST_CASE("top_k returns exactly the k largest magnitudes, in ascending index order") {
  for (size_t n : {size_t{1}, size_t{2}, size_t{10}, size_t{1000}, size_t{4099}}) {
    std::vector<float> x = uniform_floats(n, -1.0f, 1.0f, 12 + static_cast<uint32_t>(n));
    for (size_t k : {size_t{0}, size_t{1}, n / 100, n / 10, n / 2, n - 1, n}) check_top_k(x, k);
  }
  // Magnitudes spread over many exponents, so the selection crosses many histogram bins.
  std::vector<float> wide = any_floats(5000, 13);
  for (auto& v : wide)
    if (std::isinf(v)) v = 1.0f;
  for (size_t k : {1, 50, 2500, 4999}) check_top_k(wide, k);
}

TEST_CASE("top_k is exact on large buffers: spread, sparse, tied and periodic magnitudes") {
  // Large enough that top_k first guesses a bound from a sample; every layout below must come out
  // exactly as the full sort says, whether the guess holds or top_k falls back to all elements.
  const size_t n = size_t{1} << 17;
  std::vector<float> normal(n);
  random_normal(5, normal.data(), n);
  for (size_t k : {size_t{1}, size_t{100}, n / 100, n / 10, n / 3, n - 1}) check_top_k(normal, k);

  std::vector<float> spikes(n, 0.0f);  // 300 non-zeros: the sample sees almost none of them
  std::mt19937 g(15);
  for (int s = 0; s < 300; ++s) spikes[g() % n] = uniform(g, -1.0f, 1.0f);
  for (size_t k : {size_t{10}, size_t{299}, size_t{1000}}) check_top_k(spikes, k);

  std::vector<float> tied(n);  // magnitudes 0, 1, 2: the guessed bound is itself a tie
  for (auto& v : tied) v = static_cast<float>(static_cast<int>(g() % 5) - 2);
  for (size_t k : {size_t{1000}, n / 5, n / 2}) check_top_k(tied, k);

  std::vector<float> rows = normal;  // rows of 1024 whose first 8 columns are 100x larger
  for (size_t i = 0; i < n; i += 1024)
    for (size_t j = 0; j < 8; ++j) rows[i + j] *= 100.0f;
  for (size_t k : {n / 200, n / 100, n / 20}) check_top_k(rows, k);
}

TEST_CASE("top_k breaks ties towards the lower index") {
  // Few distinct magnitudes, signs mixed, +0 and -0: nearly every threshold is a tie.
  std::mt19937 g(14);
  std::vector<float> x(3001);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(g() % 7) - 3);
  for (size_t i = 0; i < x.size(); i += 13) x[i] = -0.0f;
  for (size_t k = 0; k <= x.size(); k += 97) check_top_k(x, k);
  check_top_k(x, x.size());
  std::vector<float> same(100, -2.5f);
  check_top_k(same, 37);
  std::vector<uint32_t> got(37);
  top_k(same.data(), same.size(), 37, got.data());
  CHECK(got.front() == 0);
  CHECK(got.back() == 36);
}

namespace {

void check_random_k(size_t n, size_t k, uint64_t seed) {
  CAPTURE(n);
  CAPTURE(k);
  std::vector<uint32_t> a(k + 1, 0xdeadbeef), b(k, 0);
  random_k(seed, n, k, a.data());
  CHECK(a[k] == 0xdeadbeef);
  a.resize(k);
  for (size_t j = 0; j < k; ++j) {
    REQUIRE(a[j] < n);
    if (j > 0) REQUIRE(a[j - 1] < a[j]);  // ascending and distinct
  }
  random_k(seed, n, k, b.data());
  REQUIRE(a == b);
  if (k > 0 && k < n) {
    random_k(seed + 1, n, k, b.data());
    CHECK(a != b);
  }
}

// Draws `rounds` samples of k from n, counts picks per bucket of n / buckets indices, and returns
// Pearson's chi-square statistic against the uniform expectation.
double random_k_chi_square(size_t n, size_t k, size_t buckets, size_t rounds) {
  std::vector<double> counts(buckets, 0.0);
  std::vector<uint32_t> idx(k);
  for (size_t r = 0; r < rounds; ++r) {
    random_k(1000 + r, n, k, idx.data());
    for (uint32_t i : idx) counts[i * buckets / n] += 1.0;
  }
  const double expected = static_cast<double>(rounds * k) / static_cast<double>(buckets);
  double chi = 0.0;
  for (double c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

}  // namespace

TEST_CASE("random_k draws k distinct sorted indices in range, the same for the same seed") {
  check_random_k(1000000, 100, 1);  // k small against n: hash-set path
  check_random_k(3000000, 1, 2);
  check_random_k(1000, 500, 3);  // k large against n: bitmap path
  check_random_k(100000, 99000, 4);
  check_random_k(65, 33, 5);
  check_random_k(10, 0, 6);
  check_random_k(10, 10, 7);
  check_random_k(1, 1, 8);
}

TEST_CASE("random_k is uniform over indices on both of its paths") {
  // 99 degrees of freedom: mean 99, standard deviation 14; 200 is over 7 deviations out, while
  // a bias of a few percent between buckets gives thousands.
  CHECK(random_k_chi_square(100, 10, 100, 20000) < 200.0);
  CHECK(random_k_chi_square(1000, 700, 100, 300) < 200.0);
  CHECK(random_k_chi_square(200000, 40, 100, 5000) < 200.0);
  // The first and last positions of the ordered sample cover all their range too.
  std::vector<uint32_t> idx(2);
  size_t low_first = 0;
  for (uint64_t s = 0; s < 2000; ++s) {
    random_k(s, 100, 2, idx.data());
    low_first += idx[0] < 29;  // P(min < 29) = 1 - (71*70)/(100*99) = 0.498
  }
  CHECK(low_first > 880);
  CHECK(low_first < 1110);
}

TEST_CASE("gather reads values by index and scatter_add accumulates repeated indices") {
  const std::vector<float> src = {10, 11, 12, 13, 14, 15};
  const std::vector<uint32_t> idx = {5, 0, 3, 3, 1};
  std::vector<float> values(idx.size());
  gather(src.data(), idx.data(), idx.size(), values.data());
  CHECK(values == std::vector<float>{15, 10, 13, 13, 11});
  std::vector<float> dst(6, 1.0f);
  scatter_add(idx.data(), values.data(), idx.size(), 0.5f, dst.data());
  CHECK(dst == std::vector<float>{6, 6.5f, 1, 14, 1, 8.5f});
  gather(src.data(), idx.data(), 0, values.data());  // k == 0 is a no-op
  scatter_add(idx.data(), values.data(), 0, 1.0f, dst.data());
  CHECK(dst == std::vector<float>{6, 6.5f, 1, 14, 1, 8.5f});
}

// ---------------------------------------------------------------------------------------------
// Low rank

TEST_CASE("low-rank project, back_project and expand match naive triple loops") {
  struct Shape {
    size_t rows, cols, r;
  };
  for (Shape s : {Shape{1, 1, 1}, Shape{7, 13, 3}, Shape{33, 70, 5}, Shape{64, 64, 4},
                  Shape{5, 9, 8}, Shape{20, 3, 2}, Shape{9, 100, 7}, Shape{4, 6, 0}}) {
    CAPTURE(s.rows);
    CAPTURE(s.cols);
    CAPTURE(s.r);
    const std::vector<float> m = uniform_floats(s.rows * s.cols, -1.0f, 1.0f, 20);
    const std::vector<float> qt = uniform_floats(s.r * s.cols, -1.0f, 1.0f, 21);
    const std::vector<float> p0 = uniform_floats(s.rows * s.r, -1.0f, 1.0f, 22);

    std::vector<float> p(s.rows * s.r + 1, 5.0f);
    low_rank_project(m.data(), s.rows, s.cols, qt.data(), s.r, p.data());
    for (size_t i = 0; i < s.rows; ++i)
      for (size_t k = 0; k < s.r; ++k) {
        double want = 0.0, mag = 0.0;
        for (size_t j = 0; j < s.cols; ++j) {
          want += static_cast<double>(m[i * s.cols + j]) * qt[k * s.cols + j];
          mag += std::fabs(static_cast<double>(m[i * s.cols + j]) * qt[k * s.cols + j]);
        }
        REQUIRE(std::fabs(p[i * s.r + k] - want) <= 1e-6 * mag + 1e-30);
      }
    CHECK(p.back() == 5.0f);

    std::vector<float> q(s.r * s.cols + 1, 5.0f);
    low_rank_back_project(m.data(), s.rows, s.cols, p0.data(), s.r, q.data());
    for (size_t k = 0; k < s.r; ++k)
      for (size_t j = 0; j < s.cols; ++j) {
        double want = 0.0, mag = 0.0;
        for (size_t i = 0; i < s.rows; ++i) {
          want += static_cast<double>(p0[i * s.r + k]) * m[i * s.cols + j];
          mag += std::fabs(static_cast<double>(p0[i * s.r + k]) * m[i * s.cols + j]);
        }
        REQUIRE(std::fabs(q[k * s.cols + j] - want) <= 1e-6 * mag + 1e-30);
      }
    CHECK(q.back() == 5.0f);

    std::vector<float> out(s.rows * s.cols + 1, 5.0f);
    low_rank_expand(p0.data(), qt.data(), s.rows, s.cols, s.r, -0.5f, out.data());
    for (size_t i = 0; i < s.rows; ++i)
      for (size_t j = 0; j < s.cols; ++j) {
        double want = 0.0, mag = 0.0;
        for (size_t k = 0; k < s.r; ++k) {
          want += static_cast<double>(p0[i * s.r + k]) * qt[k * s.cols + j];
          mag += std::fabs(static_cast<double>(p0[i * s.r + k]) * qt[k * s.cols + j]);
        }
        REQUIRE(std::fabs(out[i * s.cols + j] - (-0.5 * want)) <= 1e-6 * mag + 1e-30);
      }
    CHECK(out.back() == 5.0f);
  }
}

TEST_CASE(
    "low-rank add_project (in place or from elsewhere), expand_error (from the matrix or from "
    "the memory) and settle_add_project give the bits of the separate passes they fuse") {
  struct Shape {
    size_t rows, cols, r;
  };
  for (Shape s : {Shape{1, 1, 1}, Shape{7, 13, 3}, Shape{33, 70, 5}, Shape{64, 64, 4},
                  Shape{9, 100, 7}, Shape{4, 6, 0}}) {
    CAPTURE(s.rows);
    CAPTURE(s.cols);
    CAPTURE(s.r);
    const std::vector<float> m = uniform_floats(s.rows * s.cols, -1.0f, 1.0f, 30);
    const std::vector<float> add = uniform_floats(s.rows * s.cols, -0.1f, 0.1f, 31);
    const std::vector<float> qt = uniform_floats(s.r * s.cols, -1.0f, 1.0f, 32);
    const std::vector<float> p0 = uniform_floats(s.rows * s.r, -1.0f, 1.0f, 33);

    // m + add, then the projection of the sum.
    std::vector<float> summed = m, want_p(s.rows * s.r + 1, 5.0f);
    for (size_t i = 0; i < summed.size(); ++i) summed[i] += add[i];
    low_rank_project(summed.data(), s.rows, s.cols, qt.data(), s.r, want_p.data());
    std::vector<float> fused = m, p(s.rows * s.r + 1, 5.0f);
    low_rank_add_project(fused.data(), add.data(), s.rows, s.cols, qt.data(), s.r, p.data());
    CHECK(fused == summed);
    CHECK(p == want_p);
    // The same from a matrix elsewhere: m is written, `from` left as it was.
    std::vector<float> from = m, into(m.size(), 9.0f), p_from(s.rows * s.r + 1, 5.0f);
    low_rank_add_project_from(from.data(), into.data(), add.data(), s.rows, s.cols, qt.data(), s.r,
                              p_from.data());
    CHECK(into == summed);
    CHECK(p_from == want_p);
    CHECK(from == m);

    // The copy to e, the expansion, then e -= expansion * back.
    const float scale = -0.5f, back = 1.0f / (4.0f * scale);
    std::vector<float> want_m = m, want_e = m;
    low_rank_expand(p0.data(), qt.data(), s.rows, s.cols, s.r, scale, want_m.data());
    for (size_t i = 0; i < want_e.size(); ++i) want_e[i] -= want_m[i] * back;
    std::vector<float> got_m = m, got_e(m.size(), 7.0f);
    low_rank_expand_error(p0.data(), qt.data(), s.rows, s.cols, s.r, scale, back, got_m.data(),
                          got_e.data());
    CHECK(got_m == want_m);
    CHECK(got_e == want_e);

    // PowerSGD's memory holding M: the sum written over `add` itself, then the expansion from it.
    std::vector<float> memory = add, p_memory(s.rows * s.r + 1, 5.0f);
    low_rank_add_project_from(m.data(), memory.data(), memory.data(), s.rows, s.cols, qt.data(),
                              s.r, p_memory.data());
    CHECK(memory == summed);
    CHECK(p_memory == want_p);
    std::vector<float> held = m, out(m.size() + 1, 7.0f);
    low_rank_expand_from_error(p0.data(), qt.data(), s.rows, s.cols, s.r, scale, back, held.data(),
                               out.data());
    CHECK(held == want_e);
    CHECK(std::equal(want_m.begin(), want_m.end(), out.begin()));
    CHECK(out.back() == 7.0f);

    // The next step's sum with the error settled on the way (PowerSGD's deferred memory): from a
    // gradient elsewhere plus the error the expansion above left, projected onto another Q of
    // another rank (the new r may differ from the expansion's only where a bucket changes; here
    // r + 1 against r), against the expansion's error, then add_project_from.
    const size_t r2 = s.r + 1;
    const std::vector<float> grad = uniform_floats(s.rows * s.cols, -0.2f, 0.2f, 34);
    const std::vector<float> qt2 = uniform_floats(r2 * s.cols, -1.0f, 1.0f, 35);
    std::vector<float> two_pass = want_e, want_p2(s.rows * r2 + 1, 3.0f);
    low_rank_add_project_from(grad.data(), two_pass.data(), two_pass.data(), s.rows, s.cols,
                              qt2.data(), r2, want_p2.data());
    std::vector<float> settled = m, p2(s.rows * r2 + 1, 3.0f);
    low_rank_settle_add_project(grad.data(), settled.data(), p0.data(), qt.data(), s.r, scale, back,
                                s.rows, s.cols, qt2.data(), r2, p2.data());
    CHECK(settled == two_pass);
    CHECK(p2 == want_p2);
  }
}

namespace {

// max |P^T P - I| over the columns that are not zero (a zero column must be zero entirely).
double orthonormality_error(const std::vector<float>& p, size_t rows, size_t r) {
  double worst = 0.0;
  for (size_t a = 0; a < r; ++a)
    for (size_t b = 0; b < r; ++b) {
      double dot = 0.0;
      for (size_t i = 0; i < rows; ++i) dot += static_cast<double>(p[i * r + a]) * p[i * r + b];
      worst = std::max(worst, std::fabs(dot - (a == b ? 1.0 : 0.0)));
    }
  return worst;
}

// max over the columns of a of |a_k - P P^T a_k| / |a_k|: 0 when P's columns span each a_k.
double span_residual(const std::vector<float>& a, const std::vector<float>& p, size_t rows,
                     size_t r) {
  double worst = 0.0;
  for (size_t k = 0; k < r; ++k) {
    std::vector<double> res(rows);
    double norm = 0.0;
    for (size_t i = 0; i < rows; ++i) {
      res[i] = a[i * r + k];
      norm += res[i] * res[i];
    }
    for (size_t l = 0; l < r; ++l) {
      double dot = 0.0;
      for (size_t i = 0; i < rows; ++i) dot += static_cast<double>(p[i * r + l]) * a[i * r + k];
      for (size_t i = 0; i < rows; ++i) res[i] -= dot * p[i * r + l];
    }
    double rn = 0.0;
    for (double v : res) rn += v * v;
    worst = std::max(worst, std::sqrt(rn / norm));
  }
  return worst;
}

}  // namespace

TEST_CASE("orthogonalize_columns gives orthonormal columns that span the same space") {
  const size_t rows = 200, r = 6;
  const std::vector<float> a = uniform_floats(rows * r, -1.0f, 1.0f, 30);
  std::vector<float> p = a;
  orthogonalize_columns(p.data(), rows, r);
  CHECK(orthonormality_error(p, rows, r) < 1e-5);
  CHECK(span_residual(a, p, rows, r) < 1e-5);
  // Gram-Schmidt keeps the first column's direction.
  for (size_t i = 0; i < rows; ++i) REQUIRE(p[i * r] * a[i * r] >= 0.0f);
}

TEST_CASE("orthogonalize_columns stays orthonormal when columns are nearly dependent") {
  // Column 1 is column 0 plus 1e-4 of noise: one float Gram-Schmidt pass leaves its dot with
  // column 0 around 1e-3; the second pass brings it back to rounding.
  const size_t rows = 500, r = 3;
  std::vector<float> a = uniform_floats(rows * r, -1.0f, 1.0f, 31);
  const std::vector<float> noise = uniform_floats(rows, -1.0f, 1.0f, 32);
  for (size_t i = 0; i < rows; ++i) a[i * r + 1] = a[i * r] + 1e-4f * noise[i];
  std::vector<float> p = a;
  orthogonalize_columns(p.data(), rows, r);
  CHECK(orthonormality_error(p, rows, r) < 1e-5);
}

TEST_CASE("orthogonalize_columns sets a zero or dependent column to zero") {
  // Columns: e0 * 2, then 3 times column 0 (exactly dependent: the residue is exactly 0), then a
  // zero column, then a random one.
  const size_t rows = 50, r = 4;
  std::vector<float> p(rows * r, 0.0f);
  const std::vector<float> rnd = uniform_floats(rows, -1.0f, 1.0f, 33);
  p[0 * r + 0] = 2.0f;
  p[0 * r + 1] = 6.0f;
  for (size_t i = 0; i < rows; ++i) p[i * r + 3] = rnd[i];
  orthogonalize_columns(p.data(), rows, r);
  CHECK(p[0] == 1.0f);
  for (size_t i = 0; i < rows; ++i) {
    REQUIRE(p[i * r + 1] == 0.0f);
    REQUIRE(p[i * r + 2] == 0.0f);
    REQUIRE(std::isfinite(p[i * r + 3]));
  }
  CHECK(p[3] == 0.0f);  // orthogonal to e0
  double norm = 0.0;
  for (size_t i = 0; i < rows; ++i) norm += static_cast<double>(p[i * r + 3]) * p[i * r + 3];
  CHECK(norm == doctest::Approx(1.0).epsilon(1e-6));
}

TEST_CASE("random_normal gives mean 0 and variance 1, the same for the same seed") {
  const size_t n = 100000;
  std::vector<float> x(n), y(n), z(n);
  random_normal(42, x.data(), n);
  random_normal(42, y.data(), n);
  random_normal(43, z.data(), n);
  CHECK(x == y);
  CHECK(x != z);
  double sum = 0.0, sum_sq = 0.0;
  size_t tails = 0;
  for (float v : x) {
    REQUIRE(std::isfinite(v));
    sum += v;
    sum_sq += static_cast<double>(v) * v;
    tails += std::fabs(v) > 1.959964f;
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  // Standard errors: 0.0032 for the mean, 0.0045 for the variance, 0.0007 for the tail share.
  CHECK(std::fabs(mean) < 0.02);
  CHECK(std::fabs(var - 1.0) < 0.03);
  CHECK(std::fabs(static_cast<double>(tails) / n - 0.05) < 0.004);
  // Each element depends on its position alone: a shorter draw is a prefix, odd n included.
  std::vector<float> prefix(999);
  random_normal(42, prefix.data(), prefix.size());
  CHECK(std::equal(prefix.begin(), prefix.end(), x.begin()));
}
