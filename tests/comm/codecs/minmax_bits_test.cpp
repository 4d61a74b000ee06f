// comm/codecs/minmax.h's one entry point per operation, parameterised by the code width: each
// width gives its own layout, and a width other than 4 or 8 is refused by name.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/codecs/minmax.h"
#include "comm/status.h"

using namespace troupe::comm;

TEST_CASE("min-max bytes are the block headers plus one code per element (8 bits) or per nibble") {
  // 10 elements in blocks of 4: 3 blocks of {min, max} float32, then the codes.
  CHECK(minmax_bytes(MinMaxBits::eight, 10, 4) == 3 * 8 + 10);
  CHECK(minmax_bytes(MinMaxBits::four, 10, 4) == 3 * 8 + 5);
  CHECK(minmax_bytes(MinMaxBits::four, 9, 4) == 3 * 8 + 5);
}

TEST_CASE("min-max codes of 0..15 round-trip exactly at both widths") {
  // A block holding 0..15 has step 1 at 4 bits (15 / 15) and 1/17 at 8 bits (15 / 255): every
  // value is a code at both widths.
  std::vector<float> x(16);
  for (int i = 0; i < 16; ++i) x[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 16);
  for (const auto bits : {MinMaxBits::four, MinMaxBits::eight}) {
    CAPTURE(static_cast<int>(bits));
    std::vector<uint8_t> code(minmax_bytes(bits, x.size(), 16));
    minmax_encode(bits, x.data(), x.size(), 16, code.data());
    std::vector<float> back(x.size()), sum(x.size(), 1.0f);
    minmax_decode(bits, code.data(), x.size(), 16, back.data());
    minmax_decode_add(bits, code.data(), x.size(), 16, sum.data());
    for (size_t i = 0; i < x.size(); ++i) {
      CHECK(back[i] == x[i]);
      CHECK(sum[i] == x[i] + 1.0f);
    }
  }
  // 4 bits: two codes a byte, the even element in the low nibble; x[0] = 0, x[1] = 7.
  std::vector<uint8_t> four(minmax_bytes(MinMaxBits::four, 16, 16));
  minmax_encode(MinMaxBits::four, x.data(), 16, 16, four.data());
  CHECK(four[8] == (0 | 7 << 4));
}

TEST_CASE("a min-max code width other than 4 or 8 bits is refused, naming it") {
  const auto three = static_cast<MinMaxBits>(3);
  float x[4] = {1, 2, 3, 4};
  uint8_t code[64] = {};
  auto says = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string want = "bits = 3, expected 4 or 8";
  CHECK(says([&] { minmax_bytes(three, 4, 4); }).find(want) != std::string::npos);
  CHECK(says([&] { minmax_encode(three, x, 4, 4, code); }).find(want) != std::string::npos);
  CHECK(says([&] { minmax_decode(three, code, 4, 4, x); }).find(want) != std::string::npos);
  CHECK(says([&] { minmax_decode_add(three, code, 4, 4, x); }).find(want) != std::string::npos);
}
