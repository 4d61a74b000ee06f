// cuda/codecs: every GPU codec kernel against its CPU twin in comm/codecs/, byte for byte.
#ifdef TROUPE_HAVE_CUDA

#include "cuda/codecs.h"

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/codecs/half.h"
#include "comm/codecs/minmax.h"
#include "comm/codecs/sign.h"
#include "comm/codecs/sparse.h"
#include "comm/cpu_features.h"
#include "comm/reduce.h"
#include "cuda/reduce.h"
#include "tests/support/cuda_stream.h"
#include "tests/support/random_floats.h"
#include "tests/support/skip.h"

namespace {

namespace gpu = troupe::cuda;
namespace cpu = troupe::comm;

using troupe::test::Stream;

/// A device allocation of `count` T freed on scope exit.
template <class T>
class Device {
 public:
  explicit Device(size_t count) : count_(count) {
    CHECK_CUDA(cudaMalloc(&data_, count * sizeof(T) + 1));  // + 1: never a null buffer
  }
  explicit Device(const std::vector<T>& host) : Device(host.size()) { upload(host); }
  ~Device() { cudaFree(data_); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  T* get() const { return data_; }
  void upload(const std::vector<T>& host) {
    troupe::test::upload(data_, host.data(), host.size() * sizeof(T));
  }
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    troupe::test::download(host.data(), data_, count * sizeof(T));
    return host;
  }
  std::vector<T> download() const { return download(count_); }

 private:
  T* data_ = nullptr;
  size_t count_;
};

/// Index of the first element whose bytes differ (sizes must match), or -1.
template <class T>
long first_mismatch(const std::vector<T>& got, const std::vector<T>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) return static_cast<long>(i);
  return -1;
}
#define CHECK_SAME_BYTES(got, want) CHECK(first_mismatch(got, want) == -1)

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

using troupe::test::uniform_floats;
using troupe::test::wide_floats;

/// Awkward sizes around `block`: empty, one element, either side of a block, and large.
std::vector<size_t> sizes_around(size_t block) {
  return {0, 1, block - 1, block, block + 1, 100003};
}

bool skip_without_device() {
  if (gpu::device_available()) return false;
  troupe::test::skip_case("no CUDA device in this process: skipping the GPU case");
  return true;
}

}  // namespace

TEST_CASE("fp16 and bf16 casts on the GPU give the CPU's bytes and floats, NaN and inf included") {
  if (skip_without_device()) return;
  Stream stream;
  // The CPU encodes fp16 with F16C, but its scalar tail (the last n % 8 elements) canonicalises
  // NaN payloads: NaNs go where F16C encodes them, and only where the processor has it.
  const bool f16c = troupe::comm::cpu_features().f16c;
  for (size_t n : sizes_around(4096)) {
    for (float scale : {1.0f, 0.125f, 3.0f}) {
      CAPTURE(n);
      CAPTURE(scale);
      std::vector<float> src = wide_floats(n, 1 + static_cast<uint32_t>(n));
      const size_t vector_part = n - n % 8;
      for (size_t i = 0; i < n; i += 97) src[i] = i % 2 ? 65519.0f : -65520.0f;  // half's edge
      for (size_t i = 5; i < n; i += 101) src[i] = -std::numeric_limits<float>::infinity();
      for (size_t i = 7; f16c && i < vector_part; i += 103)
        src[i] = from_bits(i % 3 ? 0x7fc01234u : 0xff812345u);  // a quiet and a signalling NaN
      Device<float> d_src(src);
      Device<uint16_t> d_wire(n);
      Device<float> d_back(n);
      std::vector<uint16_t> wire(n);
      std::vector<float> back(n);

      cpu::encode_half(src.data(), n, scale, wire.data());
      gpu::encode_half(d_src.get(), n, scale, d_wire.get(), stream.handle());
      CHECK_SAME_BYTES(d_wire.download(), wire);
      cpu::decode_half(wire.data(), n, 1.0f / scale, back.data());
      gpu::decode_half(d_wire.get(), n, 1.0f / scale, d_back.get(), stream.handle());
      CHECK_SAME_BYTES(d_back.download(), back);

      cpu::encode_bfloat16(src.data(), n, scale, wire.data());
      gpu::encode_bfloat16(d_src.get(), n, scale, d_wire.get(), stream.handle());
      CHECK_SAME_BYTES(d_wire.download(), wire);
      cpu::decode_bfloat16(wire.data(), n, 1.0f / scale, back.data());
      gpu::decode_bfloat16(d_wire.get(), n, 1.0f / scale, d_back.get(), stream.handle());
      CHECK_SAME_BYTES(d_back.download(), back);
    }
  }
  // Every 16-bit pattern decodes to the CPU's float, NaNs with their payloads.
  std::vector<uint16_t> all(65536);
  for (size_t h = 0; h < all.size(); ++h) all[h] = static_cast<uint16_t>(h);
  Device<uint16_t> d_all(all);
  Device<float> d_out(all.size());
  std::vector<float> out(all.size());
  cpu::decode_half(all.data(), all.size(), 0.5f, out.data());
  gpu::decode_half(d_all.get(), all.size(), 0.5f, d_out.get(), stream.handle());
  CHECK_SAME_BYTES(d_out.download(), out);
  cpu::decode_bfloat16(all.data(), all.size(), 0.5f, out.data());
  gpu::decode_bfloat16(d_all.get(), all.size(), 0.5f, d_out.get(), stream.handle());
  CHECK_SAME_BYTES(d_out.download(), out);
}

namespace {

/// Blocks whose min or max is a zero, with +0 and -0 mixed, so the header's zero signs depend on
/// the CPU's reduction order; every third block is all zeros.
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

/// The GPU's min-max encoding of src at `bits` against the CPU's, written `misalign` bytes into
/// its buffer; then the GPU decoding the CPU's bytes, alone and added to a buffer.
void check_minmax(gpu::MinMaxBits bits, const std::vector<float>& src, size_t block,
                  size_t misalign, Stream& stream) {
  const auto cpu_bits = static_cast<cpu::MinMaxBits>(bits);
  const size_t n = src.size(), bytes = cpu::minmax_bytes(cpu_bits, n, block);
  CAPTURE(static_cast<int>(bits));
  CAPTURE(n);
  CAPTURE(block);
  CAPTURE(misalign);
  REQUIRE(gpu::minmax_bytes(bits, n, block) == bytes);
  std::vector<uint8_t> want(bytes);
  cpu::minmax_encode(cpu_bits, src.data(), n, block, want.data());

  // The encoding may start at any byte (a slot in a message); nothing is written past it.
  Device<float> d_src(src);
  Device<uint8_t> d_out(bytes + misalign + 1);
  troupe::test::fill(d_out.get(), 0xab, bytes + misalign + 1);
  gpu::minmax_encode(bits, d_src.get(), n, block, d_out.get() + misalign, stream.handle());
  const std::vector<uint8_t> all = d_out.download(bytes + misalign + 1);
  CHECK_SAME_BYTES(std::vector<uint8_t>(all.begin() + misalign, all.end() - 1), want);
  CHECK(all.back() == 0xab);

  Device<uint8_t> d_in(want);
  std::vector<float> decoded(n), sum = uniform_floats(n, -1.0f, 1.0f, 3);
  Device<float> d_decoded(n), d_sum(sum);
  cpu::minmax_decode(cpu_bits, want.data(), n, block, decoded.data());
  cpu::minmax_decode_add(cpu_bits, want.data(), n, block, sum.data());
  gpu::minmax_decode(bits, d_in.get(), n, block, d_decoded.get(), stream.handle());
  gpu::minmax_decode_add(bits, d_in.get(), n, block, d_sum.get(), stream.handle());
  CHECK_SAME_BYTES(d_decoded.download(), decoded);
  CHECK_SAME_BYTES(d_sum.download(), sum);
}

void check_minmax_blocks(gpu::MinMaxBits bits, std::initializer_list<size_t> blocks) {
  Stream stream;
  for (size_t block : blocks) {
    for (size_t n : sizes_around(block)) {
      check_minmax(bits, uniform_floats(n, -1.0f, 3.0f, 11 + static_cast<uint32_t>(n)), block, 0,
                   stream);
      check_minmax(bits, wide_floats(n, 12), block, 1, stream);
      check_minmax(bits, signed_zero_floats(n, block, 13), block, 3, stream);
    }
  }
}

}  // namespace

TEST_CASE("8-bit min-max on the GPU gives the CPU's bytes, signed zeros of the header included") {
  if (skip_without_device()) return;
  // 16 and 255: the CPU's sixteen lanes and its tail; 2048 and 4096: a CTA per block.
  check_minmax_blocks(gpu::MinMaxBits::eight, {1, 16, 255, 2048, 4096});
}

TEST_CASE(
    "4-bit min-max on the GPU gives the CPU's bytes, nibble order and odd last byte included") {
  if (skip_without_device()) return;
  // Even blocks only; block - 1 and block + 1 leave an odd count, whose last byte has one code.
  check_minmax_blocks(gpu::MinMaxBits::four, {2, 16, 254, 2048, 4096});
}

TEST_CASE("sign_pack on the GPU packs the CPU's bits, and unpacking applies the CPU's scale") {
  if (skip_without_device()) return;
  Stream stream;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{31}, size_t{33},
                   size_t{100003}}) {
    CAPTURE(n);
    std::vector<float> src = uniform_floats(n, -1.0f, 1.0f, 21 + static_cast<uint32_t>(n));
    for (size_t i = 0; i < n; i += 5) src[i] = -0.0f;  // not negative
    for (size_t i = 3; i < n; i += 17) src[i] = -std::numeric_limits<float>::quiet_NaN();
    const size_t bytes = cpu::sign_bytes(n);
    REQUIRE(gpu::sign_bytes(n) == bytes);
    std::vector<uint8_t> bits(bytes);
    cpu::sign_pack(src.data(), n, bits.data());
    Device<float> d_src(src);
    Device<uint8_t> d_bits(bytes + 1);
    troupe::test::fill(d_bits.get(), 0xff, bytes + 1);
    gpu::sign_pack(d_src.get(), n, d_bits.get(), stream.handle());
    std::vector<uint8_t> got = d_bits.download(bytes + 1);
    CHECK(got.back() == 0xff);  // nothing written past the last byte
    got.pop_back();
    CHECK_SAME_BYTES(got, bits);

    // A host scale, and a scale in device memory times a factor (a message's scale).
    std::vector<float> out(n), sum = uniform_floats(n, -2.0f, 2.0f, 22);
    Device<float> d_out(n), d_sum(sum), d_scale(std::vector<float>{0.3f});
    cpu::sign_unpack(bits.data(), n, 0.75f, out.data());
    cpu::sign_unpack_add(bits.data(), n, 0.3f * 0.125f, sum.data());
    gpu::sign_unpack(d_bits.get(), n, 0.75f, d_out.get(), stream.handle());
    gpu::sign_unpack_add(d_bits.get(), n, gpu::Scale(d_scale.get(), 0.125f), d_sum.get(),
                         stream.handle());
    CHECK_SAME_BYTES(d_out.download(), out);
    CHECK_SAME_BYTES(d_sum.download(), sum);

    std::vector<float> votes = uniform_floats(n, -2.0f, 2.0f, 23);
    for (size_t i = 0; i < n; i += 4) votes[i] = i % 8 ? 0.0f : -0.0f;
    Device<float> d_votes(votes);
    cpu::sign_in_place(votes.data(), n);
    gpu::sign_in_place(d_votes.get(), n, stream.handle());
    CHECK_SAME_BYTES(d_votes.download(), votes);
  }
}

TEST_CASE(
    "the casts and sign unpacking give the CPU's bytes at every alignment of their buffers (the "
    "aligned bulk goes four or eight elements a thread, the rest one)") {
  if (skip_without_device()) return;
  Stream stream;
  const size_t n = 1001;
  const std::vector<float> src = uniform_floats(n, -3.0f, 3.0f, 31);
  const std::vector<float> start = uniform_floats(n, -1.0f, 1.0f, 32);
  std::vector<uint8_t> bits(cpu::sign_bytes(n));
  cpu::sign_pack(src.data(), n, bits.data());
  Device<float> d_floats(n + 4), d_back(n + 4);
  Device<uint16_t> d_wire(n + 4);
  Device<uint8_t> d_bits(bits);
  // Elements [at, at + n) of a device buffer of n + 4.
  auto part = [n](const auto& device, size_t at) {
    auto all = device.download(n + 4);
    return std::vector<typename decltype(all)::value_type>(all.begin() + static_cast<long>(at),
                                                           all.begin() + static_cast<long>(at + n));
  };
  for (size_t at : {0, 1, 2, 3}) {         // float elements: 4 bytes each
    for (size_t wire_at : {0, 1, 2, 3}) {  // 16-bit elements
      CAPTURE(at);
      CAPTURE(wire_at);
      troupe::test::upload(d_floats.get() + at, src.data(), n * sizeof(float));
      for (bool bfloat16 : {false, true}) {
        CAPTURE(bfloat16);
        std::vector<uint16_t> wire(n);
        std::vector<float> back(n);
        if (bfloat16) {
          cpu::encode_bfloat16(src.data(), n, 0.5f, wire.data());
          cpu::decode_bfloat16(wire.data(), n, 3.0f, back.data());
          gpu::encode_bfloat16(d_floats.get() + at, n, 0.5f, d_wire.get() + wire_at,
                               stream.handle());
          gpu::decode_bfloat16(d_wire.get() + wire_at, n, 3.0f, d_back.get() + at, stream.handle());
        } else {
          cpu::encode_half(src.data(), n, 0.5f, wire.data());
          cpu::decode_half(wire.data(), n, 3.0f, back.data());
          gpu::encode_half(d_floats.get() + at, n, 0.5f, d_wire.get() + wire_at, stream.handle());
          gpu::decode_half(d_wire.get() + wire_at, n, 3.0f, d_back.get() + at, stream.handle());
        }
        CHECK_SAME_BYTES(part(d_wire, wire_at), wire);
        CHECK_SAME_BYTES(part(d_back, at), back);
      }
    }
    std::vector<float> set(n), added = start;
    cpu::sign_unpack(bits.data(), n, 0.25f, set.data());
    cpu::sign_unpack_add(bits.data(), n, 0.25f, added.data());
    gpu::sign_unpack(d_bits.get(), n, 0.25f, d_back.get() + at, stream.handle());
    CHECK_SAME_BYTES(part(d_back, at), set);
    troupe::test::upload(d_back.get() + at, start.data(), n * sizeof(float));
    gpu::sign_unpack_add(d_bits.get(), n, 0.25f, d_back.get() + at, stream.handle());
    CHECK_SAME_BYTES(part(d_back, at), added);
  }
}

TEST_CASE("mean_abs on the GPU adds in the CPU's order and gives its float bit for bit") {
  if (skip_without_device()) return;
  Stream stream;
  Device<float> d_mean(1);
  // Chunks of 1024: none, one, some, 64 (one group), 65 (a short second group), 4096 and 8192
  // (two and three levels of the tree, the last with short groups).
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{100003},
        size_t{65536}, 65 * size_t{1024} + 3, (size_t{1} << 22) + 7, (size_t{1} << 23) + 5}) {
    CAPTURE(n);
    // Wide magnitudes: any other order of the float additions would round differently.
    const std::vector<float> src = wide_floats(n, 31 + static_cast<uint32_t>(n));
    Device<float> d_src(src);
    gpu::mean_abs(d_src.get(), n, d_mean.get(), stream.handle());
    CHECK_SAME_BYTES(d_mean.download(), std::vector<float>{cpu::mean_abs(src.data(), n)});
  }
  // Where the tree's order shows in the float (tests/support/random_floats.h): one chain over
  // the 4096 chunks would give 4.
  const std::vector<float> tie = troupe::test::mean_abs_tie();
  Device<float> d_tie(tie);
  gpu::mean_abs(d_tie.get(), tie.size(), d_mean.get(), stream.handle());
  CHECK(d_mean.download()[0] == troupe::test::kTreeMeanAbs);
}

TEST_CASE("sign error feedback on the GPU leaves the CPU's memory, from a scale on the device") {
  if (skip_without_device()) return;
  Stream stream;
  for (size_t n : sizes_around(1024)) {
    CAPTURE(n);
    // sign_compression.cpp: x += e; s = mean |x|; pack; e = -s sign(x) + x.
    std::vector<float> x = uniform_floats(n, -1.0f, 1.0f, 41 + static_cast<uint32_t>(n));
    const std::vector<float> e0 = uniform_floats(n, -0.1f, 0.1f, 42);
    Device<float> d_x(x), d_e(e0), d_scale(1);
    for (size_t i = 0; i < n; ++i) x[i] += e0[i];
    const float s = cpu::mean_abs(x.data(), n);
    std::vector<uint8_t> bits(cpu::sign_bytes(n));
    cpu::sign_pack(x.data(), n, bits.data());
    std::vector<float> e(n);
    cpu::sign_unpack(bits.data(), n, -s, e.data());
    for (size_t i = 0; i < n; ++i) e[i] += x[i];

    gpu::reduce(d_x.get(), d_x.get(), d_e.get(), n, gpu::DType::float32, gpu::Op::sum,
                stream.handle());
    gpu::mean_abs(d_x.get(), n, d_scale.get(), stream.handle());
    gpu::sign_error_feedback(d_x.get(), n, gpu::Scale(d_scale.get()), d_e.get(), stream.handle());
    CHECK_SAME_BYTES(d_x.download(), x);
    CHECK_SAME_BYTES(d_e.download(), e);
  }
}

namespace {

void check_top_k(const std::vector<float>& x, size_t k, Stream& stream) {
  const size_t n = x.size();
  CAPTURE(n);
  CAPTURE(k);
  std::vector<uint32_t> want(k);
  cpu::top_k(x.data(), n, k, want.data());
  Device<float> d_x(x);
  Device<uint32_t> d_indices(k + 1);
  troupe::test::fill(d_indices.get(), 0xff, (k + 1) * sizeof(uint32_t));
  gpu::top_k(d_x.get(), n, k, d_indices.get(), stream.handle());
  std::vector<uint32_t> got = d_indices.download(k + 1);
  CHECK(got.back() == 0xffffffffu);  // exactly k written
  got.pop_back();
  CHECK_SAME_BYTES(got, want);
}

}  // namespace

TEST_CASE("top_k on the GPU returns the CPU's indices, ties broken towards the lower index") {
  if (skip_without_device()) return;
  Stream stream;
  for (size_t n : sizes_around(4096))
    for (size_t k : {size_t{0}, size_t{1}, n / 100, n / 3, n > 0 ? n - 1 : 0, n})
      if (k <= n)
        check_top_k(uniform_floats(n, -1.0f, 1.0f, 51 + static_cast<uint32_t>(n)), k, stream);

  // Ties: seven magnitudes with +0 and -0 (equal), so the k-th is nearly always tied and the
  // radix select must go on into the index bits.
  std::mt19937 g(52);
  std::vector<float> tied(100003);
  for (auto& v : tied) v = static_cast<float>(static_cast<int>(g() % 7) - 3);
  for (size_t i = 0; i < tied.size(); i += 13) tied[i] = -0.0f;
  for (size_t k : {size_t{1}, size_t{1000}, size_t{14286}, size_t{50000}, size_t{99999}})
    check_top_k(tied, k, stream);
  check_top_k(std::vector<float>(5000, -2.5f), 37, stream);

  // Infinities and NaN rank above everything else, NaN above infinity, as the CPU's abs_key.
  std::vector<float> special = wide_floats(100003, 53);
  for (size_t i = 11; i < special.size(); i += 1009)
    special[i] = i % 2 ? std::numeric_limits<float>::infinity() : from_bits(0xffc00001u);
  for (size_t k : {size_t{10}, size_t{99}, size_t{100}, size_t{5000}})
    check_top_k(special, k, stream);
}

TEST_CASE("gather and scatter_add on the GPU match the CPU exactly") {
  if (skip_without_device()) return;
  Stream stream;
  const size_t n = 100003;
  const std::vector<float> x = wide_floats(n, 61);
  for (size_t k : {size_t{0}, size_t{1}, size_t{4095}, size_t{4097}, size_t{30000}}) {
    CAPTURE(k);
    // Distinct indices, as top_k gives them: every sum is one rounding, the CPU's.
    std::vector<uint32_t> indices(k);
    cpu::top_k(x.data(), n, k, indices.data());
    std::vector<float> values(k), dst = uniform_floats(n, -1.0f, 1.0f, 62);
    cpu::gather(x.data(), indices.data(), k, values.data());
    Device<float> d_x(x), d_values(k), d_dst(dst);
    Device<uint32_t> d_indices(indices);
    gpu::gather(d_x.get(), d_indices.get(), k, d_values.get(), stream.handle());
    CHECK_SAME_BYTES(d_values.download(), values);
    cpu::scatter_add(indices.data(), values.data(), k, 0.25f, dst.data());
    gpu::scatter_add(d_indices.get(), d_values.get(), k, 0.25f, d_dst.get(), stream.handle());
    CHECK_SAME_BYTES(d_dst.download(), dst);
  }
  // Repeated indices all count; with small integers the sums are exact in any order.
  std::vector<uint32_t> repeated(20000);
  std::vector<float> ones(repeated.size());
  for (size_t j = 0; j < repeated.size(); ++j) {
    repeated[j] = static_cast<uint32_t>(j % 7);
    ones[j] = static_cast<float>(j % 3);
  }
  std::vector<float> dst(7, 1.0f);
  Device<uint32_t> d_repeated(repeated);
  Device<float> d_ones(ones), d_dst(dst);
  cpu::scatter_add(repeated.data(), ones.data(), repeated.size(), 2.0f, dst.data());
  gpu::scatter_add(d_repeated.get(), d_ones.get(), repeated.size(), 2.0f, d_dst.get(),
                   stream.handle());
  CHECK_SAME_BYTES(d_dst.download(), dst);
}

TEST_CASE("sparse error feedback on the GPU keeps x with the sent coordinates zeroed") {
  if (skip_without_device()) return;
  Stream stream;
  for (size_t n : sizes_around(4096)) {
    CAPTURE(n);
    const std::vector<float> x = uniform_floats(n, -1.0f, 1.0f, 71 + static_cast<uint32_t>(n));
    const size_t k = n / 10;
    std::vector<uint32_t> indices(k);
    cpu::top_k(x.data(), n, k, indices.data());
    // sparsification.cpp: e = x, then e[indices] = 0.
    std::vector<float> want = x;
    for (uint32_t i : indices) want[i] = 0.0f;
    Device<float> d_x(x), d_e(n);
    Device<uint32_t> d_indices(indices);
    gpu::sparse_error_feedback(d_x.get(), n, d_indices.get(), k, d_e.get(), stream.handle());
    CHECK_SAME_BYTES(d_e.download(), want);
    gpu::sparse_error_feedback(d_x.get(), n, d_indices.get(), k, d_x.get(), stream.handle());
    CHECK_SAME_BYTES(d_x.download(), want);  // in place
  }
}

namespace {

/// Tensors of awkward counts at offsets that leave gaps and break 16-byte alignment; flatten
/// must fill their places and leave the gaps, unflatten must bring every tensor back.
void check_flatten_round_trip(size_t element_bytes, Stream& stream) {
  CAPTURE(element_bytes);
  const std::vector<size_t> counts = {1, 0, 4095, 3, 100003, 4097, 7, 16384};
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<Device<uint8_t>>> owned;
  std::vector<gpu::TensorSpan> spans;
  std::mt19937 g(81 + static_cast<uint32_t>(element_bytes));
  size_t offset = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    offset += i % 3;  // gaps of 0, 1 or 2 elements
    std::vector<uint8_t> bytes(counts[i] * element_bytes);
    for (auto& b : bytes) b = static_cast<uint8_t>(g());
    owned.push_back(std::make_unique<Device<uint8_t>>(bytes));
    host.push_back(bytes);
    spans.push_back({owned.back()->get(), counts[i], offset});
    offset += counts[i];
  }
  const size_t flat_count = offset + 5;
  Device<uint8_t> d_flat(flat_count * element_bytes);
  troupe::test::fill(d_flat.get(), 0x5a, flat_count * element_bytes);
  gpu::flatten(spans.data(), spans.size(), element_bytes, d_flat.get(), flat_count,
               stream.handle());
  std::vector<uint8_t> want(flat_count * element_bytes, 0x5a);
  for (size_t i = 0; i < spans.size(); ++i)
    std::memcpy(want.data() + spans[i].offset * element_bytes, host[i].data(), host[i].size());
  CHECK_SAME_BYTES(d_flat.download(), want);

  for (size_t i = 0; i < spans.size(); ++i) troupe::test::fill(spans[i].data, 0, host[i].size());
  gpu::unflatten(d_flat.get(), flat_count, spans.data(), spans.size(), element_bytes,
                 stream.handle());
  for (size_t i = 0; i < spans.size(); ++i) {
    CAPTURE(i);
    CHECK_SAME_BYTES(owned[i]->download(host[i].size()), host[i]);
  }
}

}  // namespace

TEST_CASE("flatten then unflatten on the GPU round-trips tensors of every alignment") {
  if (skip_without_device()) return;
  Stream stream;
  for (size_t element_bytes : {size_t{1}, size_t{2}, size_t{4}, size_t{8}})
    check_flatten_round_trip(element_bytes, stream);
}

TEST_CASE("bad codec arguments are rejected before any CUDA work, naming the value") {
  // Host pointers stand in for device ones: each call must throw before it touches them.
  alignas(16) float x[4] = {};
  alignas(16) uint32_t idx[4] = {};
  uint8_t bytes[16] = {};
  auto message = [](auto&& call) { return troupe::test::invalid_argument_message(call); };
  auto says = [](const std::string& text, const char* part) {
    INFO(text);
    return text.find(part) != std::string::npos;
  };
  const auto four = gpu::MinMaxBits::four, eight = gpu::MinMaxBits::eight;
  CHECK(says(message([&] { gpu::minmax_encode(eight, x, 4, 0, bytes, nullptr); }), "block 0"));
  CHECK(says(message([&] { gpu::minmax_decode(eight, nullptr, 9, 4, x, nullptr); }),
             "in is null with n 9"));
  CHECK(says(message([&] { gpu::minmax_encode(four, x, 4, 3, bytes, nullptr); }),
             "block 3 with 4-bit codes (expected a multiple of 2)"));
  CHECK(says(message([&] { gpu::minmax_decode_add(four, bytes, 4, 5, x, nullptr); }),
             "block 5 with 4-bit codes"));
  CHECK(says(message([&] { gpu::minmax_bytes(four, 4, 0); }), "minmax_bytes: block 0"));
  CHECK(says(message([&] { gpu::minmax_encode(four, nullptr, 3, 2, bytes, nullptr); }),
             "src is null with n 3"));
  CHECK(says(message([&] { gpu::minmax_decode(four, bytes, 3, 2, nullptr, nullptr); }),
             "dst is null with n 3"));
  float* misaligned = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(x) + 1);
  CHECK(says(message([&] { gpu::minmax_decode(four, bytes, 2, 2, misaligned, nullptr); }),
             "is not 4-byte aligned"));
  const auto three = static_cast<gpu::MinMaxBits>(3);
  CHECK(says(message([&] { gpu::minmax_bytes(three, 4, 4); }), "bits 3 (expected 4 or 8)"));
  CHECK(says(message([&] { gpu::minmax_encode(three, x, 4, 4, bytes, nullptr); }),
             "minmax_encode: bits 3"));
  CHECK(says(message([&] {
               gpu::encode_half(reinterpret_cast<float*>(bytes + 1), 2, 1.0f,
                                reinterpret_cast<uint16_t*>(bytes + 8), nullptr);
             }),
             "is not 4-byte aligned"));
  CHECK(says(message([&] { gpu::top_k(x, 4, 5, idx, nullptr); }), "k 5 > n 4"));
  CHECK(says(message([&] { gpu::top_k(x, (size_t{1} << 32) + 1, 1, idx, nullptr); }),
             "n 4294967297"));
  CHECK(says(message([&] { gpu::scatter_add(idx, nullptr, 3, 1.0f, x, nullptr); }),
             "values is null with k 3"));
  CHECK(says(message([&] { gpu::mean_abs(x, 4, nullptr, nullptr); }), "result is null"));
  CHECK(says(message([&] { gpu::sparse_error_feedback(x, 2, idx, 3, x, nullptr); }), "k 3 > n 2"));
  gpu::TensorSpan spans[2] = {{x, 2, 0}, {x, 3, 2}};
  CHECK(says(message([&] { gpu::flatten(spans, 2, 3, bytes, 5, nullptr); }), "element_bytes 3"));
  CHECK(says(message([&] { gpu::flatten(spans, 2, 4, bytes, 4, nullptr); }),
             "tensor 1: elements [2, 5)"));
  spans[1].data = nullptr;
  CHECK(says(message([&] { gpu::unflatten(bytes, 5, spans, 2, 4, nullptr); }),
             "tensor 1: data is null with count 3"));
  // Nothing to do is no error, even with no buffers.
  CHECK_NOTHROW(gpu::sign_pack(nullptr, 0, nullptr, nullptr));
  CHECK_NOTHROW(gpu::top_k(nullptr, 0, 0, nullptr, nullptr));
  CHECK_NOTHROW(gpu::flatten(nullptr, 0, 4, nullptr, 0, nullptr));
}

#endif  // TROUPE_HAVE_CUDA
