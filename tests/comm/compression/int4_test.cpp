// Int4Quantization: the 4-bit codec against its closed-form error bound, the reduction on thread
// ranks against a single-process computation of the same quantisation written here, its bytes on
// the wire against float32's, and the settings it refuses.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "comm/codecs/minmax.h"
#include "comm/collectives/communicator.h"
#include "comm/compression/algorithms.h"
#include "comm/compression/settings.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/padded_bucket.h"

using namespace troupe;
using Vec = std::vector<float>;

namespace {

Vec random_values(size_t n, unsigned seed, float spread) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Vec x(n);
  for (size_t i = 0; i < n; ++i) x[i] = u(gen) * spread * (1.0f + static_cast<float>(i % 7));
  return x;
}

// The decoded value of x[i] under the quantisation the header describes, written from its text:
// per block, codes round((x - min) / (max - min) * 15) to nearest, decoded as min + code * step.
Vec reference_round_trip(const Vec& x, size_t block) {
  Vec out(x.size());
  for (size_t begin = 0; begin < x.size(); begin += block) {
    const size_t end = std::min(x.size(), begin + block);
    const float lo =
        *std::min_element(x.begin() + static_cast<long>(begin), x.begin() + static_cast<long>(end));
    const float hi =
        *std::max_element(x.begin() + static_cast<long>(begin), x.begin() + static_cast<long>(end));
    const float inv = hi > lo ? static_cast<float>(15.0 / (static_cast<double>(hi) - lo)) : 0.0f;
    const float step = static_cast<float>((static_cast<double>(hi) - lo) / 15.0);
    for (size_t i = begin; i < end; ++i) {
      const int code = std::min(15, static_cast<int>((x[i] - lo) * inv + 0.5f));
      out[i] = lo + step * static_cast<float>(code);
    }
  }
  return out;
}

// A bucket of two tensors with a gap of padding between them and after them.
const std::vector<comm::TensorSlot> kTensors = {{0, 301, 7}, {304, 77, 1}};
constexpr size_t kCount = 400;
constexpr float kPadding = test::kStalePadding;

bool in_tensor(size_t i) { return test::in_tensor(kTensors, i); }

Vec gradient(int rank, uint32_t step) {
  Vec g = random_values(kCount, static_cast<unsigned>(rank * 131 + step * 7 + 3), 0.7f);
  for (size_t i = 0; i < kCount; ++i)
    if (!in_tensor(i)) g[i] = kPadding;
  return g;
}

struct RankRun {
  std::vector<Vec> buckets;  // after each step's reduction
  std::vector<comm::Communicator::Traffic> traffic;
};

// `steps` steps of `algorithm` on `world` thread ranks over Communicator::run_stages.
std::vector<RankRun> run(const comm::Compression& algorithm, int world, uint32_t steps,
                         size_t count, const std::vector<comm::TensorSlot>& tensors,
                         const std::function<Vec(int, uint32_t)>& input) {
  comm::InprocFabric fabric(world);
  std::vector<std::future<RankRun>> futures;
  for (int r = 0; r < world; ++r)
    futures.push_back(std::async(std::launch::async, [&, r] {
      comm::Communicator comm(fabric.transport(r), {}, std::chrono::seconds(30));
      Vec data(count);
      auto reduction = comm::make_reduction(
          algorithm, comm::BucketBuffer{0, data.data(), count, comm::DataType::float32, tensors});
      RankRun out;
      for (uint32_t s = 0; s < steps; ++s) {
        const Vec g = input(r, s);
        std::copy(g.begin(), g.end(), data.begin());
        comm::ReduceStep step;
        step.group = comm::Group{r, world};
        step.step = s;
        step.scale = 1.0 / world;
        out.traffic.push_back(comm.run_stages(reduction->stages(step), "int4 test"));
        out.buckets.push_back(data);
      }
      return out;
    }));
  std::vector<RankRun> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

}  // namespace

TEST_CASE("4-bit codes decode within half a step, (max - min) / 30, of each block's values") {
  for (size_t block : {2, 8, 64, 512})
    for (size_t n : {1, 2, 7, 64, 1001, 4096}) {
      CAPTURE(block);
      CAPTURE(n);
      Vec x = random_values(n, static_cast<unsigned>(block * 31 + n), 3.0f);
      if (n >= 64) std::fill(x.begin(), x.begin() + 16, 0.25f);  // a constant stretch
      std::vector<uint8_t> code(comm::minmax_bytes(comm::MinMaxBits::four, n, block) + 1, 0xab);
      CHECK(comm::minmax_bytes(comm::MinMaxBits::four, n, block) ==
            (n + block - 1) / block * 8 + (n + 1) / 2);
      comm::minmax_encode(comm::MinMaxBits::four, x.data(), n, block, code.data());
      CHECK(code.back() == 0xab);                           // nothing written past the encoding
      if (n % 2) CHECK((code[code.size() - 2] >> 4) == 0);  // the unused nibble
      Vec y(n);
      comm::minmax_decode(comm::MinMaxBits::four, code.data(), n, block, y.data());
      const Vec want = reference_round_trip(x, block);
      double worst_ratio = 0;  // the largest error over the bound, to see how close it comes
      for (size_t begin = 0; begin < n; begin += block) {
        const size_t end = std::min(n, begin + block);
        const float lo = *std::min_element(x.begin() + static_cast<long>(begin),
                                           x.begin() + static_cast<long>(end));
        const float hi = *std::max_element(x.begin() + static_cast<long>(begin),
                                           x.begin() + static_cast<long>(end));
        const double bound = (double(hi) - lo) / 30;
        const double slack = 1e-6 * std::max(std::abs(double(lo)), std::abs(double(hi)));
        for (size_t i = begin; i < end; ++i) {
          const double error = std::abs(double(x[i]) - y[i]);
          if (error > bound + slack) {
            FAIL_CHECK("element " << i << ": |" << x[i] << " - " << y[i] << "| > " << bound);
            break;
          }
          if (bound > 0) worst_ratio = std::max(worst_ratio, error / bound);
          if (hi == lo) CHECK(y[i] == x[i]);  // a constant block decodes exactly
          CHECK(y[i] == want[i]);
        }
      }
      // Nearest rounding comes close to its bound on random data (truncation would double it).
      if (n >= 64 && block >= 64) CHECK(worst_ratio > 0.8);
      Vec sum(n, 1.0f);
      comm::minmax_decode_add(comm::MinMaxBits::four, code.data(), n, block, sum.data());
      for (size_t i = 0; i < n; ++i) CHECK(sum[i] == 1.0f + y[i]);
    }
}

TEST_CASE("int4 leaves every rank the same values, those of a single-process 4-bit reduction") {
  const size_t block = 16;
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    const uint32_t steps = 2;
    auto out = run(comm::Int4Quantization{block}, world, steps, kCount, kTensors, gradient);
    for (uint32_t s = 0; s < steps; ++s) {
      CAPTURE(s);
      // The reference: each rank's chunk j quantised, summed in fp32 by rank j in rank order,
      // scaled, quantised again, and decoded by everyone.
      Vec want(kCount), exact(kCount, 0.0f);
      for (int r = 0; r < world; ++r) {
        const Vec g = gradient(r, s);
        for (size_t i = 0; i < kCount; ++i)
          if (in_tensor(i)) exact[i] += g[i] / static_cast<float>(world);
      }
      for (int j = 0; j < world; ++j) {
        const comm::Range chunk = comm::block_range(kCount, world, j);
        Vec sum(chunk.size(), 0.0f);
        for (int r = 0; r < world; ++r) {
          Vec g = gradient(r, s);
          for (size_t i = 0; i < kCount; ++i)
            if (!in_tensor(i)) g[i] = 0.0f;
          const Vec part(g.begin() + static_cast<long>(chunk.begin),
                         g.begin() + static_cast<long>(chunk.end));
          const Vec decoded = reference_round_trip(part, block);
          for (size_t i = 0; i < chunk.size(); ++i) sum[i] += decoded[i];
        }
        for (float& v : sum) v *= static_cast<float>(1.0 / world);
        const Vec decoded = reference_round_trip(sum, block);
        std::copy(decoded.begin(), decoded.end(), want.begin() + static_cast<long>(chunk.begin));
      }
      for (int r = 0; r < world; ++r)
        for (size_t i = 0; i < kCount; ++i) {
          if (!in_tensor(i)) continue;
          const float got = out[static_cast<size_t>(r)].buckets[s][i];
          if (got != out[0].buckets[s][i] ||
              std::abs(got - want[i]) > 1e-6f * std::max(1.0f, std::abs(want[i]))) {
            FAIL_CHECK("rank " << r << " element " << i << ": " << got << ", rank 0 "
                               << out[0].buckets[s][i] << ", reference " << want[i]);
            break;
          }
          // Two quantisations, each within (max - min) / 30 of a block spanning at most
          // [-4.9, 4.9] (inputs are within 0.7 * 7 of 0, their average too).
          if (!(std::abs(got - exact[i]) <= 2 * 9.8 / 30 + 1e-5)) {
            FAIL_CHECK("element " << i << ": got " << got << ", exact " << exact[i]);
            break;
          }
        }
    }
  }
}

TEST_CASE("int4 sends about 8x fewer bytes than a float32 allreduce, as its closed form says") {
  const int world = 4;
  const size_t count = 4 * 8192, block = 512;
  const std::vector<comm::TensorSlot> one = {{0, count, 1}};
  auto input = [&](int r, uint32_t) {
    return random_values(count, static_cast<unsigned>(r + 1), 1.0f);
  };
  auto int4 = run(comm::Int4Quantization{block}, world, 1, count, one, input);
  auto full = run(comm::GradientAllReduce{}, world, 1, count, one, input);
  // Alltoall then allgather, each sending the W - 1 other chunks' slots: a slot is one chunk of
  // count / W elements as codes (half a byte each) and a {min, max} pair per block.
  const size_t slot = ((count / world + block - 1) / block * 8 + count / world / 2 + 3) / 4 * 4;
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto& sent = int4[static_cast<size_t>(r)].traffic[0];
    CHECK(sent.sent == 2 * (world - 1) * slot);
    CHECK(sent.received == 2 * (world - 1) * slot);
    const double ratio = double(full[static_cast<size_t>(r)].traffic[0].sent) / double(sent.sent);
    CAPTURE(full[static_cast<size_t>(r)].traffic[0].sent);
    CHECK(ratio > 7.5);  // 8x less the blocks' headers (8 bytes per 256 of codes)
    CHECK(ratio < 8.0);
  }
}

TEST_CASE("int4 is named on the command line and refuses bad settings and non-float32 buckets") {
  auto c = std::get<comm::Int4Quantization>(comm::parse_compression("int4:block=64"));
  CHECK(c.block == 64);
  CHECK(std::get<comm::Int4Quantization>(comm::parse_compression("int4")).block == 512);
  CHECK(comm::algorithm_name(c) == "int4");
  CHECK(comm::compression_entry(c).name == "int4");
  CHECK_THROWS_WITH(comm::parse_compression("int4:block=1"),
                    "--algorithm int4: block=1: expected an integer >= 2");
  CHECK_THROWS_WITH(
      comm::parse_compression("int4:block=7"),
      "Int4Quantization.block=7 (expected an even number of elements >= 2 per block)");
  CHECK_THROWS_WITH(comm::parse_compression("int4:bits=2"),
                    "--algorithm int4: unknown key 'bits' (allowed for int4: block)");
  comm::BucketBuffer bucket{3, nullptr, 10, comm::DataType::float32, {{0, 10, 1}}};
  CHECK_THROWS_WITH(
      comm::make_reduction(comm::Int4Quantization{0}, bucket),
      "Int4Quantization.block=0 (expected an even number of elements >= 2 per block)");
  comm::BucketBuffer doubles{3, nullptr, 10, comm::DataType::float64, {{0, 10, 1}}};
  CHECK_THROWS_WITH(comm::make_reduction(comm::Int4Quantization{}, doubles),
                    "int4 compresses float32 gradients; bucket 3 holds float64 (use "
                    "GradientAllReduce for other types)");
  comm::BucketBuffer halves{3, nullptr, 10, comm::DataType::float16, {{0, 10, 1}}};
  CHECK_THROWS_AS(comm::make_reduction(comm::Int4Quantization{}, halves), comm::Error);
}
