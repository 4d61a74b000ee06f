// Every compressed algorithm, as threads over the inproc transport for several world sizes and
// steps, against a single-process computation of the same algorithm written independently here
// (plain loops, double precision where it matters), error-feedback memory included.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/codecs/low_rank.h"
#include "comm/codecs/minmax.h"
#include "comm/codecs/sign.h"
#include "comm/codecs/sparse.h"
#include "comm/collectives/driver.h"
#include "comm/compression/algorithms.h"
#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/padded_bucket.h"

using namespace troupe;
using namespace std::chrono_literals;
using Vec = std::vector<float>;

namespace {

// A bucket of three tensors with alignment gaps: a 16 x 24 matrix, a vector of 7, a 5 x 40 matrix.
const std::vector<comm::TensorSlot> kTensors = {{0, 384, 16}, {400, 7, 1}, {416, 200, 5}};
constexpr size_t kCount = 624;
constexpr float kPadding = test::kStalePadding;

bool in_tensor(size_t i) { return test::in_tensor(kTensors, i); }

// Rank r's gradient at a step: distinct, non-zero, of mixed magnitudes.
Vec gradient(int rank, uint32_t step) {
  std::mt19937 gen(static_cast<unsigned>(rank * 7919 + step * 104729 + 1));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Vec g(kCount, kPadding);
  for (auto& t : kTensors)
    for (size_t k = 0; k < t.count; ++k) {
      float v = u(gen) * (1.0f + static_cast<float>(k % 5));
      if (std::abs(v) < 1e-3f) v = 1e-3f;
      g[t.offset + k] = v;
    }
  return g;
}

// Runs step `s` of `reduction` as rank `rank` of `world` (each stage under its own key); throws
// the failure's message.
void run_step(comm::Reduction& reduction, comm::BlockingDriver& driver,
              const std::shared_ptr<comm::Transport>& transport, int rank, int world, uint32_t s,
              double scale) {
  comm::ReduceStep step;
  step.group = comm::Group{rank, world};
  step.step = s;
  step.scale = scale;
  auto builders = reduction.stages(step);
  std::vector<comm::Stage> stages;
  for (size_t i = 0; i < builders.size(); ++i)
    stages.push_back({s << 16 | static_cast<uint32_t>(i) << 12, builders[i]});
  auto status = driver.run(std::move(stages), transport, 30s);
  if (!status.ok()) throw comm::Error(status.message());
}

// Runs `steps` steps of `algorithm` on `world` thread ranks; returns out[rank][step] = the bucket
// after the step's reduction.
std::vector<std::vector<Vec>> run(const comm::Compression& algorithm, int world, uint32_t steps,
                                  double scale) {
  comm::InprocFabric fabric(world);
  std::vector<std::future<std::vector<Vec>>> futures;
  for (int r = 0; r < world; ++r)
    futures.push_back(std::async(std::launch::async, [&, r] {
      auto transport = fabric.transport(r);
      Vec data(kCount);
      auto reduction = comm::make_reduction(
          algorithm, comm::BucketBuffer{0, data.data(), kCount, comm::DataType::float32, kTensors});
      comm::BlockingDriver driver;
      std::vector<Vec> out;
      for (uint32_t s = 0; s < steps; ++s) {
        const Vec g = gradient(r, s);
        std::copy(g.begin(), g.end(), data.begin());  // the reduction holds data's address
        run_step(*reduction, driver, transport, r, world, s, scale);
        out.push_back(data);
      }
      return out;
    }));
  std::vector<std::vector<Vec>> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

// The largest |a - b| over tensor elements, relative to max(1, |b|).
double max_error(const Vec& a, const Vec& b) {
  double worst = 0;
  for (size_t i = 0; i < kCount; ++i)
    if (in_tensor(i))
      worst =
          std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  return worst;
}

void check_ranks_agree(const std::vector<std::vector<Vec>>& out) {
  for (size_t r = 1; r < out.size(); ++r)
    for (size_t s = 0; s < out[r].size(); ++s) {
      CAPTURE(r);
      CAPTURE(s);
      CHECK(max_error(out[r][s], out[0][s]) == 0.0);
    }
}

void check_against(const std::vector<std::vector<Vec>>& out, const std::vector<Vec>& reference,
                   double tolerance) {
  for (size_t s = 0; s < reference.size(); ++s) {
    CAPTURE(s);
    CHECK(max_error(out[0][s], reference[s]) <= tolerance);
  }
}

// --- single-process references -------------------------------------------------------------

std::vector<Vec> reference_sum(int world, uint32_t steps, double scale) {
  std::vector<Vec> ref;
  for (uint32_t s = 0; s < steps; ++s) {
    Vec sum(kCount, 0.0f);
    for (int r = 0; r < world; ++r) {
      auto g = gradient(r, s);
      for (size_t i = 0; i < kCount; ++i)
        if (in_tensor(i)) sum[i] += g[i];
    }
    for (auto& v : sum) v = static_cast<float>(v * scale);
    ref.push_back(sum);
  }
  return ref;
}

std::vector<Vec> reference_sign(int world, uint32_t steps, double scale, bool vote, bool ef) {
  std::vector<Vec> error(static_cast<size_t>(world), Vec(kCount, 0.0f));
  std::vector<Vec> ref;
  for (uint32_t s = 0; s < steps; ++s) {
    std::vector<double> acc(kCount, 0.0);
    for (int r = 0; r < world; ++r) {
      auto x = gradient(r, s);
      auto& e = error[static_cast<size_t>(r)];
      for (auto& t : kTensors) {
        double mean = 0;
        for (size_t k = t.offset; k < t.offset + t.count; ++k) {
          if (ef) x[k] += e[k];
          mean += std::abs(x[k]);
        }
        mean /= static_cast<double>(t.count);
        const double m = vote ? 1.0 : mean;
        for (size_t k = t.offset; k < t.offset + t.count; ++k) {
          const double sent = x[k] < 0 ? -m : m;
          acc[k] += vote ? sent : sent * scale;
          if (ef) e[k] = static_cast<float>(x[k] - sent);
        }
      }
    }
    Vec out(kCount, 0.0f);
    for (size_t i = 0; i < kCount; ++i)
      out[i] = vote ? static_cast<float>((acc[i] > 0) - (acc[i] < 0)) : static_cast<float>(acc[i]);
    ref.push_back(out);
  }
  return ref;
}

// The k coordinates of x each mode sends at a step.
std::vector<uint32_t> chosen(const comm::Sparsification& c, const Vec& x, size_t k, uint32_t step) {
  std::vector<uint32_t> idx;
  const uint64_t seed = comm::mix_seed(c.seed, step, 0);
  if (c.mode == comm::SparseMode::top_k) {
    std::vector<uint32_t> all(kCount);
    std::iota(all.begin(), all.end(), 0u);
    std::stable_sort(all.begin(), all.end(),
                     [&](uint32_t a, uint32_t b) { return std::abs(x[a]) > std::abs(x[b]); });
    idx.assign(all.begin(), all.begin() + static_cast<long>(k));
  } else if (c.mode == comm::SparseMode::random_k) {
    idx.resize(k);
    comm::random_k(seed, kCount, k, idx.data());  // its own tests check it draws uniformly
  } else {
    for (size_t j = 0; j < k; ++j)
      idx.push_back(static_cast<uint32_t>((seed % kCount + j) % kCount));
  }
  return idx;
}

std::vector<Vec> reference_sparse(const comm::Sparsification& c, size_t k, int world,
                                  uint32_t steps, double scale) {
  std::vector<Vec> error(static_cast<size_t>(world), Vec(kCount, 0.0f));
  std::vector<Vec> velocity(static_cast<size_t>(world), Vec(kCount, 0.0f));
  std::vector<Vec> ref;
  for (uint32_t s = 0; s < steps; ++s) {
    Vec out(kCount, 0.0f);
    for (int r = 0; r < world; ++r) {
      auto x = gradient(r, s);
      for (size_t i = 0; i < kCount; ++i) x[i] = in_tensor(i) ? x[i] : 0.0f;
      auto& e = error[static_cast<size_t>(r)];
      auto& u = velocity[static_cast<size_t>(r)];
      if (c.momentum > 0) {  // Deep Gradient Compression: u = m u + g, send from e + u
        for (size_t i = 0; i < kCount; ++i) {
          u[i] = static_cast<float>(c.momentum) * u[i] + x[i];
          x[i] = e[i] + u[i];
        }
      } else if (c.error_feedback) {
        for (size_t i = 0; i < kCount; ++i) x[i] += e[i];
      }
      auto idx = chosen(c, x, k, s);
      for (uint32_t i : idx) out[i] += static_cast<float>(scale) * x[i];
      if (c.error_feedback) {
        e = x;
        for (uint32_t i : idx) e[i] = 0.0f;
      }
      for (uint32_t i : idx) u[i] = 0.0f;
    }
    ref.push_back(out);
  }
  return ref;
}

// PowerSGD in double with classical Gram-Schmidt; Q starts from the same seeded normal samples.
std::vector<Vec> reference_power_sgd(const comm::PowerSGD& c, int world, uint32_t steps,
                                     double scale) {
  std::vector<std::vector<double>> error(static_cast<size_t>(world),
                                         std::vector<double>(kCount, 0.0));
  std::vector<std::vector<double>> q(kTensors.size());
  for (size_t t = 0; t < kTensors.size(); ++t) {
    const size_t r = std::min<size_t>(c.rank, std::min(kTensors[t].rows, kTensors[t].cols()));
    Vec init(r * kTensors[t].cols());
    comm::random_normal(comm::mix_seed(c.seed, 0, t), init.data(), init.size());
    q[t].assign(init.begin(), init.end());
  }
  std::vector<Vec> ref;
  for (uint32_t s = 0; s < steps; ++s) {
    std::vector<Vec> g;
    for (int r = 0; r < world; ++r) g.push_back(gradient(r, s));
    Vec out(kCount, 0.0f);
    for (size_t t = 0; t < kTensors.size(); ++t) {
      const auto& slot = kTensors[t];
      const size_t rows = slot.rows, cols = slot.cols();
      if (s < c.start_iter || rows == 1) {  // full allreduce
        for (size_t k = slot.offset; k < slot.offset + slot.count; ++k) {
          double sum = 0;
          for (int r = 0; r < world; ++r) sum += g[static_cast<size_t>(r)][k];
          out[k] = static_cast<float>(sum * scale);
        }
        continue;
      }
      const size_t rk = q[t].size() / cols;
      std::vector<std::vector<double>> m(static_cast<size_t>(world));
      std::vector<double> p(rows * rk, 0.0);
      for (int r = 0; r < world; ++r) {
        auto& mr = m[static_cast<size_t>(r)];
        for (size_t k = 0; k < slot.count; ++k)
          mr.push_back(g[static_cast<size_t>(r)][slot.offset + k] +
                       error[static_cast<size_t>(r)][slot.offset + k]);
        for (size_t i = 0; i < rows; ++i)
          for (size_t j = 0; j < rk; ++j)
            for (size_t l = 0; l < cols; ++l)
              p[i * rk + j] += mr[i * cols + l] * q[t][j * cols + l];
      }
      for (size_t j = 0; j < rk; ++j) {  // classical Gram-Schmidt, column by column
        for (size_t prev = 0; prev < j; ++prev) {
          double dot = 0;
          for (size_t i = 0; i < rows; ++i) dot += p[i * rk + j] * p[i * rk + prev];
          for (size_t i = 0; i < rows; ++i) p[i * rk + j] -= dot * p[i * rk + prev];
        }
        double norm = 0;
        for (size_t i = 0; i < rows; ++i) norm += p[i * rk + j] * p[i * rk + j];
        norm = std::sqrt(norm);
        for (size_t i = 0; i < rows; ++i) p[i * rk + j] = norm > 1e-8 ? p[i * rk + j] / norm : 0.0;
      }
      std::vector<double> qsum(rk * cols, 0.0);
      for (int r = 0; r < world; ++r)
        for (size_t i = 0; i < rows; ++i)
          for (size_t j = 0; j < rk; ++j)
            for (size_t l = 0; l < cols; ++l)
              qsum[j * cols + l] += p[i * rk + j] * m[static_cast<size_t>(r)][i * cols + l];
      for (size_t i = 0; i < rows; ++i)
        for (size_t l = 0; l < cols; ++l) {
          double approx = 0;
          for (size_t j = 0; j < rk; ++j) approx += p[i * rk + j] * qsum[j * cols + l];
          out[slot.offset + i * cols + l] = static_cast<float>(approx * scale);
          for (int r = 0; r < world; ++r)
            error[static_cast<size_t>(r)][slot.offset + i * cols + l] =
                m[static_cast<size_t>(r)][i * cols + l] - approx / world;
        }
      if (c.warm_start)
        for (size_t k = 0; k < qsum.size(); ++k) q[t][k] = qsum[k] / world;
    }
    ref.push_back(out);
  }
  return ref;
}

}  // namespace

TEST_CASE("fp16 and bf16 compression sum exactly when every partial sum is representable") {
  // Values that are multiples of 1/4 below 8: every sum of up to 4 is exact in both formats.
  for (bool bf16 : {false, true})
    for (int world : {1, 2, 3, 4}) {
      CAPTURE(bf16);
      CAPTURE(world);
      comm::InprocFabric fabric(world);
      std::vector<std::future<Vec>> futures;
      for (int r = 0; r < world; ++r)
        futures.push_back(std::async(std::launch::async, [&, r] {
          Vec data(kCount);
          for (size_t i = 0; i < kCount; ++i)
            data[i] = static_cast<float>(int(i * 7 + r * 3) % 29 - 14) / 4;
          auto reduction = comm::make_reduction(
              comm::HalfPrecision{bf16},
              comm::BucketBuffer{0, data.data(), kCount, comm::DataType::float32, kTensors});
          comm::ReduceStep step;
          step.group = {r, world};
          step.scale = 0.5;
          std::vector<comm::Stage> stages;
          for (auto& b : reduction->stages(step)) stages.push_back({0, b});
          comm::BlockingDriver driver;
          auto status = driver.run(std::move(stages), fabric.transport(r), 30s);
          if (!status.ok()) throw comm::Error(status.message());
          return data;
        }));
      for (int r = 0; r < world; ++r) {
        auto got = futures[static_cast<size_t>(r)].get();
        for (size_t i = 0; i < kCount; ++i) {
          float sum = 0;
          for (int k = 0; k < world; ++k)
            sum += static_cast<float>(int(i * 7 + k * 3) % 29 - 14) / 4;
          if (got[i] != sum * 0.5f) {
            FAIL_CHECK("rank " << r << " element " << i << ": " << got[i] << " != " << sum * 0.5f);
            break;
          }
        }
      }
    }
}

TEST_CASE("fp16 compression of random gradients stays within half precision of the exact average") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    auto out = run(comm::HalfPrecision{}, world, 2, 1.0 / world);
    check_ranks_agree(out);
    // Each of up to W-1 additions in half rounds by 2^-11 relative; magnitudes here are <= 5.
    check_against(out, reference_sum(world, 2, 1.0 / world), 5 * world * std::ldexp(1.0, -11));
  }
}

TEST_CASE(
    "ByteGrad leaves every rank the same values, within two quantisation steps of the average") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    auto out = run(comm::ByteGrad{64}, world, 2, 1.0 / world);
    check_ranks_agree(out);
    // Inputs span at most [-5, 5] per block: each quantisation errs by <= 10/510, twice.
    check_against(out, reference_sum(world, 2, 1.0 / world), 2 * 10.0 / 510 + 1e-5);
  }
}

TEST_CASE("scaled sign compression with error feedback matches a single-process EF-SignSGD") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    auto out = run(comm::SignCompression{comm::SignMode::scaled, true}, world, 4, 1.0 / world);
    check_ranks_agree(out);
    check_against(out, reference_sign(world, 4, 1.0 / world, false, true), 1e-5);
  }
  auto no_ef = run(comm::SignCompression{comm::SignMode::scaled, false}, 3, 3, 1.0 / 3);
  check_against(no_ef, reference_sign(3, 3, 1.0 / 3, false, false), 1e-5);
}

TEST_CASE("majority-vote sign compression gives the sign of the summed signs") {
  for (int world : {1, 2, 3, 4, 5}) {
    CAPTURE(world);
    auto out = run(comm::SignCompression{comm::SignMode::majority_vote, false}, world, 2, 1.0);
    check_ranks_agree(out);
    check_against(out, reference_sign(world, 2, 1.0, true, false), 0.0);
  }
}

// --- the exchanges alone (comm/compression/coded.h), as the GPU's codecs drive them
// ---------------

// Runs `steps` steps of the exchange of `algorithm` (sign or min-max) on `world` thread ranks,
// encoding before it and decoding after it here, on the CPU, in the layouts coded.h documents:
// what ddp's device codecs do with cuda/ kernels. out[rank][step] as run() gives.
std::vector<std::vector<Vec>> run_exchange(const comm::Compression& algorithm, int world,
                                           uint32_t steps, double scale) {
  comm::InprocFabric fabric(world);
  std::vector<std::future<std::vector<Vec>>> futures;
  for (int r = 0; r < world; ++r)
    futures.push_back(std::async(std::launch::async, [&, r] {
      auto transport = fabric.transport(r);
      Vec data(kCount);
      const comm::BucketBuffer bucket{0, data.data(), kCount, comm::DataType::float32, kTensors};
      const auto* sign = std::get_if<comm::SignCompression>(&algorithm);
      const auto* sparse = std::get_if<comm::Sparsification>(&algorithm);
      const auto codes = comm::minmax_codes(algorithm);
      REQUIRE((sign || sparse || codes));
      // Sign: every rank's message. Top-k: every rank's record. Min-max: the codes sent, then the
      // codes gathered.
      const comm::SignMessage message(bucket);
      const size_t k = sparse ? comm::sparse_k(*sparse, kCount) : 0;
      const size_t slot =
          codes ? comm::minmax_slot_bytes(codes->bits, codes->block, kCount, world) : 0;
      std::vector<uint8_t> area(sign     ? message.bytes * static_cast<size_t>(world)
                                : sparse ? 8 * k * static_cast<size_t>(world)
                                         : 2 * slot * static_cast<size_t>(world));
      auto exchange = sign     ? comm::make_sign_exchange(*sign, bucket, world, area.data())
                      : sparse ? comm::make_top_k_exchange(*sparse, bucket, world, area.data())
                               : comm::make_minmax_exchange(*codes, bucket, world, area.data(),
                                                            area.data() + slot * world);
      Vec error(kCount, 0.0f);
      comm::BlockingDriver driver;
      std::vector<Vec> out;
      for (uint32_t s = 0; s < steps; ++s) {
        const Vec g = gradient(r, s);
        std::copy(g.begin(), g.end(), data.begin());
        if (sign) {
          uint8_t* mine = area.data() + message.bytes * static_cast<size_t>(r);
          for (size_t i = 0; i < kTensors.size(); ++i) {
            const auto& t = kTensors[i];
            float* x = data.data() + t.offset;
            float* e = error.data() + t.offset;
            if (sign->error_feedback)
              for (size_t k = 0; k < t.count; ++k) x[k] += e[k];
            const float m = sign->mode == comm::SignMode::scaled ? comm::mean_abs(x, t.count) : 1;
            std::memcpy(mine + i * sizeof(float), &m, sizeof(float));
            comm::sign_pack(x, t.count, mine + message.bits_at[i]);
            if (sign->error_feedback)
              for (size_t k = 0; k < t.count; ++k) e[k] = x[k] - (x[k] < 0 ? -m : m);
          }
        } else if (sparse) {
          for (const comm::Range& gap : comm::padding_of(bucket))
            std::fill(data.begin() + gap.begin, data.begin() + gap.end, 0.0f);
          if (sparse->error_feedback)
            for (size_t i = 0; i < kCount; ++i) data[i] += error[i];
          auto* record = reinterpret_cast<uint32_t*>(area.data()) + 2 * k * static_cast<size_t>(r);
          comm::top_k(data.data(), kCount, k, record);
          for (size_t j = 0; j < k; ++j) std::memcpy(record + k + j, &data[record[j]], 4);
          if (sparse->error_feedback) {
            error = data;
            for (size_t j = 0; j < k; ++j) error[record[j]] = 0.0f;
          }
        } else {
          for (const comm::Range& gap : comm::padding_of(bucket))
            std::fill(data.begin() + gap.begin, data.begin() + gap.end, 0.0f);
          for (int j = 0; j < world; ++j) {
            const comm::Range c = comm::block_range(kCount, world, j);
            comm::minmax_encode(codes->bits, data.data() + c.begin, c.size(), codes->block,
                                area.data() + slot * j);
          }
        }
        run_step(*exchange, driver, transport, r, world, s, scale);
        if (sign) {
          for (size_t i = 0; i < kTensors.size(); ++i) {
            const auto& t = kTensors[i];
            float* x = data.data() + t.offset;
            std::fill(x, x + t.count, 0.0f);
            for (int q = 0; q < world; ++q) {
              const uint8_t* from = area.data() + message.bytes * static_cast<size_t>(q);
              float f = 1;
              if (sign->mode == comm::SignMode::scaled) {
                std::memcpy(&f, from + i * sizeof(float), sizeof(float));
                f *= static_cast<float>(scale);
              }
              const uint8_t* bits = from + message.bits_at[i];
              for (size_t k = 0; k < t.count; ++k) x[k] += (bits[k / 8] >> (k % 8) & 1) ? -f : f;
            }
            if (sign->mode == comm::SignMode::majority_vote)
              for (size_t k = 0; k < t.count; ++k)
                x[k] = static_cast<float>((x[k] > 0) - (x[k] < 0));
          }
        } else if (sparse) {
          std::fill(data.begin(), data.end(), 0.0f);
          for (int q = 0; q < world; ++q) {
            const auto* record =
                reinterpret_cast<const uint32_t*>(area.data()) + 2 * k * static_cast<size_t>(q);
            for (size_t j = 0; j < k; ++j) {
              float v;
              std::memcpy(&v, record + k + j, 4);
              data[record[j]] += static_cast<float>(scale) * v;
            }
          }
        } else {
          for (int j = 0; j < world; ++j) {
            const comm::Range c = comm::block_range(kCount, world, j);
            comm::minmax_decode(codes->bits, area.data() + slot * (world + j), c.size(),
                                codes->block, data.data() + c.begin);
          }
        }
        out.push_back(data);
      }
      return out;
    }));
  std::vector<std::vector<Vec>> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

TEST_CASE(
    "the exchanges of sign, min-max and top-k codes, encoded and decoded around them in their "
    "documented layouts, give the bits of the algorithms' own reductions") {
  const std::vector<comm::Compression> algorithms = {
      comm::SignCompression{comm::SignMode::scaled, true},
      comm::SignCompression{comm::SignMode::scaled, false},
      comm::SignCompression{comm::SignMode::majority_vote, false},
      comm::ByteGrad{.block = 64},
      comm::Int4Quantization{.block = 32},
      comm::Sparsification{.ratio = 0.05},
      comm::Sparsification{.count = 7, .error_feedback = false},
  };
  for (const auto& algorithm : algorithms) {
    CAPTURE(comm::algorithm_name(algorithm));
    for (int world : {1, 2, 3}) {
      CAPTURE(world);
      const double scale = 1.0 / world;
      const auto want = run(algorithm, world, 3, scale);
      const auto got = run_exchange(algorithm, world, 3, scale);
      for (int r = 0; r < world; ++r)
        for (size_t s = 0; s < 3; ++s) {
          CAPTURE(r);
          CAPTURE(s);
          const auto& w = want[static_cast<size_t>(r)][s];
          const auto& g = got[static_cast<size_t>(r)][s];
          for (size_t i = 0; i < kCount; ++i)
            if (in_tensor(i) && std::memcmp(&w[i], &g[i], sizeof(float)) != 0) {
              CAPTURE(i);
              FAIL_CHECK(g[i] << " against the reduction's " << w[i]);
              break;
            }
        }
    }
  }
}

TEST_CASE(
    "an exchange run in a world of another size than it was made for is refused, naming both") {
  std::vector<float> data(kCount);
  const comm::BucketBuffer bucket{3, data.data(), kCount, comm::DataType::float32, kTensors};
  std::vector<uint8_t> area(1 << 16);
  comm::ReduceStep step;
  step.group = comm::Group{0, 3};
  auto sign = comm::make_sign_exchange(comm::SignCompression{}, bucket, 2, area.data());
  CHECK_THROWS_WITH_AS(sign->stages(step),
                       "sign exchange of bucket 3: made for 2 ranks, run among 3", comm::Error);
  auto bytegrad = comm::make_minmax_exchange(*comm::minmax_codes(comm::ByteGrad{}), bucket, 4,
                                             area.data(), area.data() + 1024);
  CHECK_THROWS_WITH_AS(bytegrad->stages(step),
                       "bytegrad exchange of bucket 3: made for 4 ranks, run among 3", comm::Error);
  CHECK_THROWS_AS(comm::make_sign_exchange(comm::SignCompression{}, bucket, 2, nullptr),
                  comm::Error);
  auto top_k = comm::make_top_k_exchange(comm::Sparsification{}, bucket, 1, area.data());
  CHECK_THROWS_WITH_AS(top_k->stages(step),
                       "top-k exchange of bucket 3: made for 1 ranks, run among 3", comm::Error);
  CHECK_THROWS_AS(
      comm::make_top_k_exchange(comm::Sparsification{.mode = comm::SparseMode::random_k}, bucket, 3,
                                area.data()),
      comm::Error);
  CHECK_FALSE(comm::minmax_codes(comm::SignCompression{}).has_value());
}

TEST_CASE("top-k, random-k and block sparsification with error feedback match a single process") {
  for (auto mode : {comm::SparseMode::top_k, comm::SparseMode::random_k, comm::SparseMode::block})
    for (bool ef : {true, false})
      for (int world : {1, 2, 3, 4}) {
        CAPTURE(static_cast<int>(mode));
        CAPTURE(ef);
        CAPTURE(world);
        comm::Sparsification c;
        c.mode = mode;
        c.ratio = 0.05;
        c.error_feedback = ef;
        c.seed = 42;
        const size_t k = static_cast<size_t>(std::llround(0.05 * kCount));
        auto out = run(c, world, 4, 1.0 / world);
        check_ranks_agree(out);
        check_against(out, reference_sparse(c, k, world, 4, 1.0 / world), 1e-6);
      }
}

TEST_CASE("sparsification with momentum correction matches a single-process DGC") {
  for (auto mode : {comm::SparseMode::top_k, comm::SparseMode::random_k})
    for (int world : {1, 3}) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(world);
      comm::Sparsification c;
      c.mode = mode;
      c.ratio = 0.05;
      c.momentum = 0.9;
      c.seed = 7;
      const size_t k = static_cast<size_t>(std::llround(0.05 * kCount));
      auto out = run(c, world, 5, 1.0 / world);
      check_ranks_agree(out);
      auto with = reference_sparse(c, k, world, 5, 1.0 / world);
      check_against(out, with, 1e-6);
      // The correction changes what is sent: plain error feedback gives other values.
      c.momentum = 0;
      auto without = reference_sparse(c, k, world, 5, 1.0 / world);
      double differ = 0;
      for (size_t i = 0; i < kCount; ++i)
        differ = std::max(differ, double(std::abs(with[4][i] - without[4][i])));
      CHECK(differ > 1e-3);
    }
}

TEST_CASE("sparsification by count keeps that many coordinates per rank") {
  comm::Sparsification c;
  c.count = 10;
  auto out = run(c, 1, 1, 1.0);
  size_t nonzero = 0;
  for (size_t i = 0; i < kCount; ++i) nonzero += out[0][0][i] != 0.0f;
  CHECK(nonzero == 10);
  check_against(out, reference_sparse(c, 10, 1, 1, 1.0), 0.0);
}

TEST_CASE("PowerSGD with warm start and error feedback matches a double-precision reference") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    comm::PowerSGD c;
    c.rank = 2;
    c.start_iter = 1;  // step 0 is a full allreduce
    c.min_compression_rate = 0;
    c.seed = 7;
    auto out = run(c, world, 4, 1.0 / world);
    check_ranks_agree(out);
    check_against(out, reference_power_sgd(c, world, 4, 1.0 / world), 2e-4);
  }
}

TEST_CASE("PowerSGD without warm start agrees on every rank and is still a rank-r approximation") {
  comm::PowerSGD c;
  c.rank = 1;
  c.start_iter = 0;
  c.warm_start = false;
  c.min_compression_rate = 0;
  auto out = run(c, 3, 3, 1.0 / 3);
  check_ranks_agree(out);
  // A rank-1 matrix: every row of the 16 x 24 block is a multiple of one row.
  const auto& m = out[0][2];
  size_t pivot = 0;
  for (size_t j = 0; j < 24; ++j)
    if (std::abs(m[j]) > std::abs(m[pivot])) pivot = j;
  for (size_t i = 1; i < 16; ++i) {
    const double ratio = m[i * 24 + pivot] / m[pivot];
    for (size_t j = 0; j < 24; ++j)
      CHECK(m[i * 24 + j] == doctest::Approx(ratio * m[j]).epsilon(1e-3).scale(1e-3));
  }
}

TEST_CASE("PowerSGD sends matrices that would not shrink enough uncompressed") {
  comm::PowerSGD c;
  c.rank = 4;
  c.start_iter = 0;
  c.min_compression_rate = 1e9;  // nothing is worth compressing: a plain allreduce
  auto out = run(c, 2, 2, 0.5);
  check_against(out, reference_sum(2, 2, 0.5), 1e-6);
}

TEST_CASE("bad algorithm settings are rejected with the setting, its value and what is allowed") {
  comm::BucketBuffer bucket{3, nullptr, 10, comm::DataType::float32, {{0, 10, 1}}};
  CHECK_THROWS_WITH(comm::make_reduction(comm::PowerSGD{0}, bucket),
                    "PowerSGD.rank=0 (expected >= 1)");
  comm::Sparsification zero;
  zero.ratio = 0;
  CHECK_THROWS_WITH(comm::make_reduction(zero, bucket),
                    "Sparsification.ratio=0 (expected 0 < ratio <= 1, or a count > 0)");
  comm::Sparsification big;
  big.ratio = 1.5;
  CHECK_THROWS_WITH(comm::make_reduction(big, bucket),
                    "Sparsification.ratio=1.5 (expected 0 < ratio <= 1, or a count > 0)");
  comm::Sparsification fast;
  fast.momentum = 1.0;
  CHECK_THROWS_WITH(comm::make_reduction(fast, bucket),
                    "Sparsification.momentum=1 (expected 0 <= momentum < 1)");
  comm::Sparsification no_memory;
  no_memory.momentum = 0.9;
  no_memory.error_feedback = false;
  CHECK_THROWS_WITH(comm::make_reduction(no_memory, bucket),
                    doctest::Contains("Sparsification.momentum=0.9 with error_feedback=false"));
  CHECK_THROWS_WITH(comm::make_reduction(comm::ByteGrad{0}, bucket),
                    "ByteGrad.block=0 (expected >= 1 element per block)");
  CHECK_THROWS_WITH(
      comm::make_reduction(comm::SignCompression{comm::SignMode::majority_vote, true}, bucket),
      doctest::Contains("error_feedback=true with mode majority_vote"));
  comm::BucketBuffer doubles{3, nullptr, 10, comm::DataType::float64, {{0, 10, 1}}};
  CHECK_THROWS_WITH(comm::make_reduction(comm::PowerSGD{}, doubles),
                    "powersgd(rank=2) compresses float32 gradients; bucket 3 holds float64 (use "
                    "GradientAllReduce for other types)");
  CHECK_NOTHROW(comm::make_reduction(comm::GradientAllReduce{}, doubles));
}

TEST_CASE("algorithm specs from the command line parse, and mistakes name the key and value") {
  auto p = std::get<comm::PowerSGD>(
      comm::parse_compression("powersgd:rank=4,start_iter=0,warm_start=false"));
  CHECK(p.rank == 4);
  CHECK(p.start_iter == 0);
  CHECK_FALSE(p.warm_start);
  auto t =
      std::get<comm::Sparsification>(comm::parse_compression("randomk:ratio=0.02,seed=9,ef=0"));
  CHECK(t.mode == comm::SparseMode::random_k);
  CHECK(t.ratio == 0.02);
  CHECK(t.seed == 9);
  CHECK_FALSE(t.error_feedback);
  CHECK(std::get<comm::HalfPrecision>(comm::parse_compression("bf16")).bfloat16);
  auto vote = std::get<comm::SignCompression>(comm::parse_compression("sign-vote"));
  CHECK(vote.mode == comm::SignMode::majority_vote);
  CHECK_FALSE(vote.error_feedback);
  CHECK(std::holds_alternative<comm::GradientAllReduce>(comm::parse_compression("allreduce")));
  CHECK_THROWS_WITH(comm::parse_compression("zip"),
                    "--algorithm 'zip' is not an algorithm (expected allreduce, fp16, bf16, "
                    "bytegrad, int4, sign, sign-vote, topk, randomk, blockk or powersgd)");
  CHECK_THROWS_WITH(comm::parse_compression("powersgd:rank=two"),
                    "--algorithm powersgd: rank=two: expected an integer >= 1");
  CHECK_THROWS_WITH(comm::parse_compression("topk:k=5"),
                    "--algorithm topk: unknown key 'k' (allowed for topk: ratio, count, "
                    "error_feedback, seed, momentum)");
  CHECK_THROWS_WITH(comm::parse_compression("fp16:ratio=1"),
                    "--algorithm fp16: unknown key 'ratio' (allowed for fp16: none)");
  CHECK_THROWS_WITH(comm::parse_compression("topk:ratio"),
                    "--algorithm topk:ratio: 'ratio' is not key=value");
  CHECK_THROWS_WITH(comm::parse_compression("powersgd:rank=0"),
                    "--algorithm powersgd: rank=0: expected an integer >= 1");
}
