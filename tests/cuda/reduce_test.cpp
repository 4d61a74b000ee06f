// cuda/reduce: every dtype x op on the GPU against a CPU computation of the same rounding.
#ifdef TROUPE_HAVE_CUDA

#include "comm/reduce.h"
#include "cuda/reduce.h"
#include "tests/support/cuda_stream.h"
#include "tests/support/skip.h"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using troupe::cuda::DType;
using troupe::cuda::Op;

using troupe::test::Stream;

// The CPU reference rounds with comm/'s conversions (the CPU twins of the kernels' casts, checked
// bit for bit against the processor's F16C in tests/comm/reduce_test.cpp).
using troupe::comm::bfloat16_to_float;
using troupe::comm::float_to_bfloat16;
using troupe::comm::float_to_half;
using troupe::comm::half_to_float;

/// Host view of a dtype: storage, arithmetic type, conversions and random values.
template <DType D>
struct Host;

template <>
struct Host<DType::float32> {
  using Storage = float;
  using Compute = float;
  static Compute load(Storage x) { return x; }
  static Storage store(Compute x) { return x; }
  static Storage random(std::mt19937_64& rng) {
    return std::uniform_real_distribution<float>(-1000.0f, 1000.0f)(rng);
  }
};
template <>
struct Host<DType::float64> {
  using Storage = double;
  using Compute = double;
  static Compute load(Storage x) { return x; }
  static Storage store(Compute x) { return x; }
  static Storage random(std::mt19937_64& rng) {
    return std::uniform_real_distribution<double>(-1000.0, 1000.0)(rng);
  }
};
template <>
struct Host<DType::float16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute load(Storage x) { return half_to_float(x); }
  static Storage store(Compute x) { return float_to_half(x); }
  // Wide enough in magnitude that sums overflow to infinity and tiny values go subnormal.
  static Storage random(std::mt19937_64& rng) {
    const float exponent = std::uniform_real_distribution<float>(-20.0f, 15.9f)(rng);
    const float sign = rng() & 1 ? -1.0f : 1.0f;
    return float_to_half(sign * std::exp2(exponent));
  }
};
template <>
struct Host<DType::bfloat16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute load(Storage x) { return bfloat16_to_float(x); }
  static Storage store(Compute x) { return float_to_bfloat16(x); }
  static Storage random(std::mt19937_64& rng) {
    return float_to_bfloat16(std::uniform_real_distribution<float>(-1000.0f, 1000.0f)(rng));
  }
};
template <>
struct Host<DType::int32> {
  using Storage = int32_t;
  using Compute = int32_t;
  static Compute load(Storage x) { return x; }
  static Storage store(Compute x) { return x; }
  // The full range, so sums wrap around.
  static Storage random(std::mt19937_64& rng) { return static_cast<int32_t>(rng()); }
};
template <>
struct Host<DType::int64> {
  using Storage = int64_t;
  using Compute = int64_t;
  static Compute load(Storage x) { return x; }
  static Storage store(Compute x) { return x; }
  static Storage random(std::mt19937_64& rng) { return static_cast<int64_t>(rng()); }
};

template <class C>
C add(C x, C y) {
  if constexpr (std::is_integral_v<C>) {
    using U = std::make_unsigned_t<C>;
    return static_cast<C>(static_cast<U>(x) + static_cast<U>(y));
  } else {
    return x + y;
  }
}

template <class C>
C apply(Op op, C x, C y) {
  switch (op) {
    case Op::sum:
    case Op::avg:
      return add(x, y);
    case Op::min:
      return y < x ? y : x;
    case Op::max:
      return x < y ? y : x;
  }
  return x;
}

const char* name(DType t) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64"};
  return names[static_cast<int>(t)];
}
const char* name(Op op) {
  static const char* names[] = {"sum", "avg", "min", "max"};
  return names[static_cast<int>(op)];
}

/// A device allocation freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&data_, bytes)); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
};

/// Index of the first element whose bits differ, or -1 when all match.
template <class T>
long first_mismatch(const std::vector<T>& got, const std::vector<T>& expected) {
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &expected[i], sizeof(T)) != 0) return static_cast<long>(i);
  return -1;
}

// Element counts that give a scalar head, whole vectors and a scalar tail; the offset (in
// elements) misaligns the buffers so the head is not empty, or aligns them differently so the
// kernel must fall back to scalars.
struct Layout {
  size_t count;
  size_t dst_offset, a_offset, b_offset;
};
const Layout kLayouts[] = {
    {1, 0, 0, 0},       {7, 0, 0, 0},    {1000003, 0, 0, 0},
    {1000003, 1, 1, 1}, {4099, 3, 3, 3}, {4099, 0, 1, 2},
};

template <DType D>
void check_reduce(const Layout& layout, Op op, bool dst_is_a, std::mt19937_64& rng) {
  using H = Host<D>;
  using T = typename H::Storage;
  const size_t n = layout.count;
  std::vector<T> a(n), b(n), expected(n), got(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = H::random(rng);
    // Some equal pairs, so min and max meet ties.
    b[i] = i % 17 == 0 ? a[i] : H::random(rng);
    expected[i] = H::store(apply(op, H::load(a[i]), H::load(b[i])));
  }

  const size_t padding = 8;
  DeviceBuffer a_buffer((n + padding) * sizeof(T));
  DeviceBuffer b_buffer((n + padding) * sizeof(T));
  DeviceBuffer dst_buffer((n + padding) * sizeof(T));
  T* a_device = a_buffer.as<T>() + layout.a_offset;
  T* b_device = b_buffer.as<T>() + layout.b_offset;
  T* dst_device = dst_is_a ? a_device : dst_buffer.as<T>() + layout.dst_offset;
  troupe::test::upload(a_device, a.data(), n * sizeof(T));
  troupe::test::upload(b_device, b.data(), n * sizeof(T));

  Stream stream;
  troupe::cuda::reduce(dst_device, a_device, b_device, n, D, op, stream.handle());
  stream.synchronize();
  troupe::test::download(got.data(), dst_device, n * sizeof(T));

  const long bad = first_mismatch(got, expected);
  INFO(name(D), " ", name(op), " count ", n, " offsets ", layout.dst_offset, "/", layout.a_offset,
       "/", layout.b_offset, dst_is_a ? " dst = a" : "");
  if (bad >= 0) {
    const auto i = static_cast<size_t>(bad);
    INFO("first mismatch at ", i, ": a ", H::load(a[i]), " b ", H::load(b[i]), " got ",
         H::load(got[i]), " expected ", H::load(expected[i]));
    CHECK(bad == -1);
  } else {
    CHECK(bad == -1);
  }
}

template <DType D>
void check_divide(const Layout& layout, int divisor, std::mt19937_64& rng) {
  using H = Host<D>;
  using T = typename H::Storage;
  using C = typename H::Compute;
  const size_t n = layout.count;
  std::vector<T> data(n), expected(n), got(n);
  for (size_t i = 0; i < n; ++i) {
    data[i] = H::random(rng);
    expected[i] = H::store(H::load(data[i]) / static_cast<C>(divisor));
  }
  DeviceBuffer buffer((n + 8) * sizeof(T));
  T* device = buffer.as<T>() + layout.dst_offset;
  troupe::test::upload(device, data.data(), n * sizeof(T));
  Stream stream;
  troupe::cuda::divide(device, n, D, divisor, stream.handle());
  stream.synchronize();
  troupe::test::download(got.data(), device, n * sizeof(T));

  const long bad = first_mismatch(got, expected);
  INFO(name(D), " divide by ", divisor, " count ", n, " offset ", layout.dst_offset);
  if (bad >= 0) {
    const auto i = static_cast<size_t>(bad);
    INFO("first mismatch at ", i, ": data ", H::load(data[i]), " got ", H::load(got[i]),
         " expected ", H::load(expected[i]));
    CHECK(bad == -1);
  } else {
    CHECK(bad == -1);
  }
}

template <DType D>
void check_all_reduces(std::mt19937_64& rng) {
  for (Op op : {Op::sum, Op::avg, Op::min, Op::max}) {
    for (const Layout& layout : kLayouts) check_reduce<D>(layout, op, false, rng);
    check_reduce<D>(kLayouts[3], op, true, rng);
  }
}

template <DType D>
void check_all_divides(std::mt19937_64& rng) {
  for (int divisor : {1, 3, 8})
    for (const Layout& layout : kLayouts) check_divide<D>(layout, divisor, rng);
}

bool skip_without_device() {
  if (troupe::cuda::device_available()) return false;
  troupe::test::skip_case("no CUDA device in this process: skipping the GPU case");
  return true;
}

}  // namespace

TEST_CASE("reduce on the GPU matches the CPU for every dtype and op, aligned or not") {
  if (skip_without_device()) return;
  std::mt19937_64 rng(20240601);
  check_all_reduces<DType::float32>(rng);
  check_all_reduces<DType::float64>(rng);
  check_all_reduces<DType::float16>(rng);
  check_all_reduces<DType::bfloat16>(rng);
  check_all_reduces<DType::int32>(rng);
  check_all_reduces<DType::int64>(rng);
}

TEST_CASE("divide on the GPU rounds floats like the CPU and truncates integers toward zero") {
  if (skip_without_device()) return;
  std::mt19937_64 rng(20240602);
  check_all_divides<DType::float32>(rng);
  check_all_divides<DType::float64>(rng);
  check_all_divides<DType::float16>(rng);
  check_all_divides<DType::bfloat16>(rng);
  check_all_divides<DType::int32>(rng);
  check_all_divides<DType::int64>(rng);
}

TEST_CASE("bad arguments are rejected before any CUDA work, naming the value") {
  // Host pointers stand in for device ones: each call must throw before it touches them.
  float x = 0;
  void* p = &x;
  auto message = [](auto&& call) { return troupe::test::invalid_argument_message(call); };
  CHECK(message([&] {
          troupe::cuda::reduce(p, p, p, 1, static_cast<DType>(42), Op::sum, nullptr);
        }).find("dtype 42") != std::string::npos);
  CHECK(message([&] {
          troupe::cuda::reduce(p, p, p, 1, DType::float32, static_cast<Op>(9), nullptr);
        }).find("op 9") != std::string::npos);
  CHECK(message([&] {
          troupe::cuda::reduce(nullptr, p, p, 5, DType::float32, Op::sum, nullptr);
        }).find("null buffer with count 5") != std::string::npos);
  CHECK(message([&] { troupe::cuda::divide(p, 1, DType::int32, 0, nullptr); }).find("divisor 0") !=
        std::string::npos);
  CHECK(message([&] {
          troupe::cuda::divide(p, 1, static_cast<DType>(-1), 2, nullptr);
        }).find("dtype -1") != std::string::npos);
  // count 0 is nothing to do, even with no buffers.
  CHECK_NOTHROW(troupe::cuda::reduce(nullptr, nullptr, nullptr, 0, DType::int64, Op::max, nullptr));
  CHECK_NOTHROW(troupe::cuda::divide(nullptr, 0, DType::float16, 4, nullptr));
}

#endif  // TROUPE_HAVE_CUDA
