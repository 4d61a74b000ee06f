// The CPU reduction kernels and the half / bfloat16 conversions.
#include <doctest/doctest.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "comm/cpu_features.h"
#include "comm/reduce.h"

using namespace troupe::comm;

namespace {
__attribute__((target("f16c"))) float hw_half_to_float(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hw_float_to_half(float f) {
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
}  // namespace

TEST_CASE("half conversions agree with the processor's F16C for every half and many floats") {
  if (!troupe::comm::cpu_features().f16c) {
    MESSAGE("no F16C on this processor: skipped");
    return;
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    float want = hw_half_to_float(static_cast<uint16_t>(h));
    float got = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
      continue;
    }
    REQUIRE(std::memcmp(&got, &want, 4) == 0);
  }
  uint32_t bits = 12345;
  for (int i = 0; i < 2000000; ++i) {
    bits = bits * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    CAPTURE(f);
    REQUIRE(float_to_half(f) == hw_float_to_half(f));
  }
}

TEST_CASE("bfloat16 rounds to nearest even and keeps NaN") {
  CHECK(float_to_bfloat16(1.0f) == 0x3f80);
  // 1 + 2^-8 is halfway between two bfloat16 values: ties go to the even one (1.0).
  CHECK(float_to_bfloat16(1.00390625f) == 0x3f80);
  CHECK(float_to_bfloat16(1.01171875f) == 0x3f82);  // 1 + 3 * 2^-8 rounds up to even
  CHECK(std::isnan(bfloat16_to_float(float_to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(bfloat16_to_float(float_to_bfloat16(-2.5f)) == -2.5f);
}

TEST_CASE("reduce computes sum, min and max for every dtype, in place and out of place") {
  const size_t n = 1031;  // not a multiple of any vector width
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
    b[i] = static_cast<float>(static_cast<int>(i % 13) - 6);
  }
  for (auto op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max}) {
    auto want = [&](size_t i) {
      return op == ReduceOp::sum   ? a[i] + b[i]
             : op == ReduceOp::min ? std::min(a[i], b[i])
                                   : std::max(a[i], b[i]);
    };
    std::vector<double> da(a.begin(), a.end()), db(b.begin(), b.end()), dd(n);
    reduce(dd.data(), da.data(), db.data(), n, DataType::float64, op);
    std::vector<int64_t> la(a.begin(), a.end()), lb(b.begin(), b.end());
    reduce(la.data(), la.data(), lb.data(), n, DataType::int64, op);  // in place
    std::vector<int32_t> ia(a.begin(), a.end()), ib(b.begin(), b.end()), id(n);
    reduce(id.data(), ia.data(), ib.data(), n, DataType::int32, op);
    std::vector<uint16_t> ha(n), hb(n), hd(n), ba(n), bb(n), bd(n);
    for (size_t i = 0; i < n; ++i) {
      ha[i] = float_to_half(a[i]);
      hb[i] = float_to_half(b[i]);
      ba[i] = float_to_bfloat16(a[i]);
      bb[i] = float_to_bfloat16(b[i]);
    }
    reduce(hd.data(), ha.data(), hb.data(), n, DataType::float16, op);
    reduce(bd.data(), ba.data(), bb.data(), n, DataType::bfloat16, op);
    std::vector<float> fd = a;
    reduce(fd.data(), fd.data(), b.data(), n, DataType::float32, op);
    for (size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      REQUIRE(fd[i] == want(i));
      REQUIRE(dd[i] == want(i));
      REQUIRE(la[i] == static_cast<int64_t>(want(i)));
      REQUIRE(id[i] == static_cast<int32_t>(want(i)));
      REQUIRE(half_to_float(hd[i]) == want(i));
      REQUIRE(bfloat16_to_float(bd[i]) == want(i));
    }
  }
}

TEST_CASE("divide truncates integers toward zero and rejects a divisor below 1") {
  std::vector<int32_t> v = {7, -7, 3};
  divide(v.data(), 3, DataType::int32, 2);
  CHECK(v == std::vector<int32_t>{3, -3, 1});
  std::vector<float> f = {3.0f};
  divide(f.data(), 1, DataType::float32, 4);
  CHECK(f[0] == 0.75f);
  CHECK_THROWS_WITH(divide(f.data(), 1, DataType::float32, 0),
                    doctest::Contains("divisor 0 is not >= 1"));
}

TEST_CASE(
    "divide by a power of two matches the quotient bit for bit, subnormals and NaN included") {
  std::vector<float> f = {1.0f,
                          3.0f,
                          -7.5f,
                          1e-38f,
                          3e-45f,
                          1.1754942e-38f,
                          3.4028235e38f,
                          0.1f,
                          -0.0f,
                          std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  std::vector<double> d = {1.0, 3.0, -7.5, 1e-308, 5e-324, 0.1, 1.7976931348623157e308};
  for (uint32_t bits = 1; bits < 0x7f800000u; bits += 0x00731234u) {  // a spread of floats
    float x;
    std::memcpy(&x, &bits, 4);
    f.push_back(x);
    f.push_back(-x);
  }
  for (int divisor : {2, 3, 4, 8, 64, 1024, 6}) {
    CAPTURE(divisor);
    auto fs = f;
    divide(fs.data(), fs.size(), DataType::float32, divisor);
    for (size_t i = 0; i < f.size(); ++i) {
      const float expected = f[i] / static_cast<float>(divisor);
      CHECK(std::memcmp(&fs[i], &expected, 4) == 0);
    }
    auto ds = d;
    divide(ds.data(), ds.size(), DataType::float64, divisor);
    for (size_t i = 0; i < d.size(); ++i) {
      const double expected = d[i] / static_cast<double>(divisor);
      CHECK(std::memcmp(&ds[i], &expected, 8) == 0);
    }
  }
}

TEST_CASE(
    "reduce_to_two writes a + b (divided for avg) into both outputs, bit for bit the separate "
    "passes") {
  // Values across many binades, negative zero, subnormals and infinities among them.
  std::vector<float> base;
  for (int i = 0; i < 4099; ++i) {
    const float magnitude = std::ldexp(1.0f + static_cast<float>(i % 97) / 97.0f, i % 300 - 150);
    base.push_back((i % 3 == 0 ? -1.0f : 1.0f) * magnitude);
  }
  base[5] = -0.0f;
  base[6] = std::numeric_limits<float>::denorm_min();
  base[7] = std::numeric_limits<float>::infinity();
  for (size_t n : {size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1000}, base.size() - 1}) {
    for (int divisor : {1, 2, 3, 4, 6}) {
      CAPTURE(n);
      CAPTURE(divisor);
      std::vector<float> a(base.begin(), base.begin() + static_cast<long>(n)), b(n);
      for (size_t i = 0; i < n; ++i) b[i] = base[(i * 7 + 3) % base.size()] * 0.75f;
      // float32 sum and avg against the closed form, out of place and in place both ways.
      for (auto op : {ReduceOp::sum, ReduceOp::avg}) {
        std::vector<float> want(n);
        for (size_t i = 0; i < n; ++i) {
          const float s = a[i] + b[i];
          want[i] = op == ReduceOp::avg ? s / static_cast<float>(divisor) : s;
        }
        std::vector<float> o1(n, 9.0f), o2(n, 9.0f);
        reduce_to_two(o1.data(), o2.data(), a.data(), b.data(), n, DataType::float32, op, divisor);
        CHECK(std::memcmp(o1.data(), want.data(), n * 4) == 0);
        CHECK(std::memcmp(o2.data(), want.data(), n * 4) == 0);
        auto x = a, y = b;
        reduce_to_two(x.data(), y.data(), x.data(), y.data(), n, DataType::float32, op, divisor);
        CHECK(std::memcmp(x.data(), want.data(), n * 4) == 0);
        CHECK(std::memcmp(y.data(), want.data(), n * 4) == 0);
        x = a, y = b;
        reduce_to_two(y.data(), x.data(), x.data(), y.data(), n, DataType::float32, op, divisor);
        CHECK(std::memcmp(x.data(), want.data(), n * 4) == 0);
        CHECK(std::memcmp(y.data(), want.data(), n * 4) == 0);
      }
      // Every other type and op: the same bits as reduce(), divide() and a copy.
      std::vector<double> da(a.begin(), a.end()), db(b.begin(), b.end());
      std::vector<int32_t> ia(n), ib(n);
      for (size_t i = 0; i < n; ++i) {
        ia[i] = static_cast<int32_t>(i * 2654435761u) / 3;
        ib[i] = static_cast<int32_t>(i * 40503u) - 7;
      }
      for (auto op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max}) {
        CAPTURE(op);
        auto check = [&](auto x, auto y, DataType type) {
          auto want = x;
          reduce(want.data(), x.data(), y.data(), n, type, op);
          if (op == ReduceOp::avg) divide(want.data(), n, type, divisor);
          const size_t bytes = n * element_size(type);
          auto o1 = x, o2 = y;
          reduce_to_two(o1.data(), o2.data(), x.data(), y.data(), n, type, op, divisor);
          CHECK(std::memcmp(o1.data(), want.data(), bytes) == 0);
          CHECK(std::memcmp(o2.data(), want.data(), bytes) == 0);
          reduce_to_two(x.data(), y.data(), x.data(), y.data(), n, type, op, divisor);
          CHECK(std::memcmp(x.data(), want.data(), bytes) == 0);
          CHECK(std::memcmp(y.data(), want.data(), bytes) == 0);
        };
        if (op == ReduceOp::min || op == ReduceOp::max) check(a, b, DataType::float32);
        check(da, db, DataType::float64);
        check(ia, ib, DataType::int32);
      }
    }
  }
  float one = 1.0f;
  CHECK_THROWS_WITH(reduce_to_two(&one, &one, &one, &one, 1, DataType::float32, ReduceOp::avg, 0),
                    "reduce_to_two: divisor 0 is not >= 1");
}

namespace {

// Copies with `copy_fn` at every size, source offset and destination offset given: every byte
// arrives and nothing around the destination changes.
template <class CopyFn>
void check_copies(CopyFn copy_fn, const std::vector<size_t>& sizes,
                  const std::vector<size_t>& froms, const std::vector<size_t>& tos) {
  const size_t most = *std::max_element(sizes.begin(), sizes.end());
  std::vector<unsigned char> src(most + 64), dst(most + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + i / 251);
  for (size_t bytes : sizes) {
    for (size_t from : froms) {
      for (size_t to : tos) {
        std::fill(dst.begin(), dst.end(), 0xA5);
        copy_fn(dst.data() + to, src.data() + from, bytes);
        INFO("bytes " << bytes << ", source offset " << from << ", destination offset " << to);
        CHECK(std::memcmp(dst.data() + to, src.data() + from, bytes) == 0);
        size_t outside = 0;
        for (size_t i = 0; i < dst.size(); ++i)
          if ((i < to || i >= to + bytes) && dst[i] != 0xA5) ++outside;
        CHECK(outside == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("copy moves every byte of every size and alignment, and nothing around it") {
  // Sizes across the memcpy fallback (below 1 KiB), the vector loop's four-vector steps and its
  // one-vector and byte tails; source and destination at every offset within a cache line, so
  // that dst - src covers the small distances modulo 4 KiB that copy() exists for.
  check_copies(copy, {0, 1, 31, 1023, 1024, 1025, 1088, 4095, 4096 + 16, 65536 + 63},
               {0, 1, 16, 33, 63}, {0, 7, 16, 48, 64});
}

TEST_CASE("stream_copy moves every byte above and below its threshold, at every alignment") {
  // Around kStreamCopyBytes (below it stream_copy is copy()), with the destination at offsets
  // that leave unaligned heads of every length before its non-temporal middle and tails after it.
  check_copies(stream_copy,
               {0, 4096, kStreamCopyBytes - 1, kStreamCopyBytes, kStreamCopyBytes + 1,
                kStreamCopyBytes + 255, kStreamCopyBytes + 4096},
               {0, 4, 33}, {0, 4, 16, 63, 64});
}
