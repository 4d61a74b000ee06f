// SparseLoCo on thread ranks against a single-process simulation written here: W replicas, each
// stepped by its own inner optimizer on its rank's batches, and every H steps each replica's
// error memory decayed and fed its outer gradient, its chunks' top-k quantised and taken out of
// the memory, and the global weights stepped by the average of what the replicas sent.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "algorithms/local_update/diloco.h"
#include "algorithms/local_update/sparseloco.h"
#include "algorithms/registry.h"
#include "comm/state.h"
#include "tests/support/local_update.h"
#include "tests/support/thread_ranks.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

using namespace troupe::test;

constexpr size_t kParameters = 6 * 8 + 8 + 8 * 3 + 3;  // 83
constexpr uint64_t kSeed = 23;                         // the batches'

// What one replica sends of its memory e (and takes out of it), per chunk: the k largest |e|,
// as min-max codes of `bits` bits rounded to nearest (or as they are at 32 bits).
torch::Tensor compress(torch::Tensor& memory, const SparseLoCo& c) {
  auto sent_tensor = torch::zeros_like(memory);
  float* e = memory.data_ptr<float>();
  float* sent = sent_tensor.data_ptr<float>();
  const auto n = static_cast<size_t>(memory.numel());
  for (size_t begin = 0; begin < n; begin += c.chunk) {
    const size_t len = std::min(c.chunk, n - begin);
    const size_t k = std::clamp<size_t>(static_cast<size_t>(std::llround(c.ratio * len)), 1, len);
    std::vector<size_t> idx(len);
    for (size_t i = 0; i < len; ++i) idx[i] = begin + i;
    std::stable_sort(idx.begin(), idx.end(),
                     [&](size_t a, size_t b) { return std::abs(e[a]) > std::abs(e[b]); });
    idx.resize(k);
    float lo = e[idx[0]], hi = lo;
    for (size_t i : idx) lo = std::min(lo, e[i]), hi = std::max(hi, e[i]);
    for (size_t i : idx) {
      float value = e[i];
      if (c.value_bits < 32) {
        const int levels = (1 << c.value_bits) - 1;
        const float inv = hi > lo ? static_cast<float>(levels / (double(hi) - lo)) : 0.0f;
        const float step = static_cast<float>((double(hi) - lo) / levels);
        const int q = std::min(levels, static_cast<int>((e[i] - lo) * inv + 0.5f));
        value = lo + step * static_cast<float>(q);
      }
      sent[i] = value;
      e[i] -= value;
    }
  }
  return sent_tensor;
}

// The simulation: the final weights of every replica.
std::vector<torch::Tensor> simulate(const torch::Tensor& init, const Batches& b, int world,
                                    int steps, const SparseLoCo& c) {
  std::vector<torch::nn::Sequential> nets;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  std::vector<torch::Tensor> error;
  for (int r = 0; r < world; ++r) {
    nets.push_back(make_net());
    load_flat(*nets.back(), init);
    opts.push_back(test::make_plain_sgd(*nets.back()));
    error.push_back(torch::zeros_like(init));
  }
  auto global_tensor = init.clone();
  float* global = global_tensor.data_ptr<float>();
  const auto n = static_cast<size_t>(init.numel());
  for (int s = 0; s < steps; ++s) {
    for (size_t r = 0; r < nets.size(); ++r) {
      train_step(nets[r], *opts[r], b.at(static_cast<int>(r), s));
      opts[r]->step();
    }
    if ((s + 1) % c.inner_steps != 0) continue;
    std::vector<float> sum(n, 0.0f);
    for (size_t r = 0; r < nets.size(); ++r) {
      const auto local_tensor = flat_of(*nets[r]);
      const float* local = local_tensor.data_ptr<float>();
      float* e = error[r].data_ptr<float>();
      for (size_t i = 0; i < n; ++i)
        e[i] = static_cast<float>(c.ef_decay) * e[i] + (global[i] - local[i]);
      const auto sent_tensor = compress(error[r], c);
      const float* sent = sent_tensor.data_ptr<float>();
      for (size_t i = 0; i < n; ++i) sum[i] += sent[i];
    }
    const auto factor = static_cast<float>(c.outer_lr / world);
    for (size_t i = 0; i < n; ++i) global[i] -= factor * sum[i];
    for (auto& net : nets) load_flat(*net, global_tensor);
  }
  std::vector<torch::Tensor> out;
  for (auto& net : nets) out.push_back(flat_of(*net));
  return out;
}

// The same on `world` thread ranks, every rank having synchronised steps / H times.
test::RankRuns run_sparseloco(const torch::Tensor& init, const Batches& b, int world, int steps,
                              const SparseLoCo& c) {
  auto runs = test::run_on_ranks<SparseLoCoModule>(init, b, world, steps, c, test::make_plain_sgd);
  for (auto n : runs.outer_steps) CHECK(n == steps / c.inner_steps);
  return runs;
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

SparseLoCo small_config() {
  SparseLoCo c;
  c.inner_steps = 3;
  c.chunk = 32;    // chunks of 32, 32 and 19 parameters
  c.ratio = 0.25;  // k = 8, 8 and 5
  c.ef_decay = 0.9;
  c.outer_lr = 0.8;
  return c;
}

// One rank's message: {min, max} per chunk (or the float values), 16-bit indices, the codes,
// in whole 32-bit words.
size_t message_bytes(const SparseLoCo& c, size_t count) {
  size_t k = 0, chunks = 0;
  for (size_t begin = 0; begin < count; begin += c.chunk, ++chunks)
    k += std::clamp<size_t>(
        static_cast<size_t>(std::llround(c.ratio * std::min(c.chunk, count - begin))), 1,
        std::min(c.chunk, count - begin));
  const size_t bytes =
      c.value_bits == 32 ? 4 * k + 2 * k : 8 * chunks + 2 * k + (k * c.value_bits + 7) / 8;
  return (bytes + 3) / 4 * 4;
}

}  // namespace

TEST_CASE("SparseLoCo on 1 to 4 thread ranks follows the single-process simulation") {
  torch::manual_seed(8);
  const auto init = flat_of(*make_net());
  REQUIRE(static_cast<size_t>(init.numel()) == kParameters);
  const int steps = 10;  // three synchronisations at H = 3, then one local step
  for (int bits : {2, 4, 32})
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(bits);
      CAPTURE(world);
      SparseLoCo c = small_config();
      c.value_bits = bits;
      Batches b(world, steps, kSeed);
      const auto want = simulate(init, b, world, steps, c);
      const auto got = run_sparseloco(init, b, world, steps, c);
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(max_difference(got.weights[static_cast<size_t>(r)], want[static_cast<size_t>(r)]) <
              1e-6);
      }
      // Not DiLoCo: with a quarter sent, the memory holds back most of the outer gradient.
      SparseLoCo all = c;
      all.ratio = 1;
      all.value_bits = 32;
      CHECK(max_difference(simulate(init, b, world, steps, all)[0], want[0]) > 1e-4);
    }
}

TEST_CASE("SparseLoCo sending everything without decay is DiLoCo without momentum") {
  torch::manual_seed(9);
  const auto init = flat_of(*make_net());
  const int world = 3, steps = 6;
  Batches b(world, steps, kSeed);
  SparseLoCo s = small_config();
  s.ratio = 1;
  s.value_bits = 32;
  s.ef_decay = 0;
  DiLoCo d;
  d.inner_steps = s.inner_steps;
  d.outer_lr = s.outer_lr;
  d.outer_momentum = 0;
  const auto sparse = run_sparseloco(init, b, world, steps, s).weights;
  const auto diloco =
      test::run_on_ranks<DiLoCoModule>(init, b, world, steps, d, test::make_plain_sgd).weights;
  for (int r = 0; r < world; ++r)
    CHECK(max_difference(sparse[static_cast<size_t>(r)], diloco[static_cast<size_t>(r)]) < 1e-6);
}

TEST_CASE("SparseLoCo sends k indices, 2-bit values and a pair per chunk at each synchronisation") {
  torch::manual_seed(10);
  const auto init = flat_of(*make_net());
  const int steps = 9;
  for (int bits : {2, 8, 32})
    for (int world : {2, 4}) {
      CAPTURE(bits);
      CAPTURE(world);
      SparseLoCo c = small_config();
      c.value_bits = bits;
      Batches b(world, steps, kSeed);
      const auto got = run_sparseloco(init, b, world, steps, c);
      // 21 values: 8 + 8 + 5.
      const size_t message = message_bytes(c, kParameters);
      CHECK(message == (bits == 2 ? 24 + 42 + 6 + 0 : bits == 8 ? 24 + 42 + 21 + 1 : 84 + 42 + 2));
      CHECK(sparseloco_message_bytes(c, kParameters) == message);
      for (const auto& s : got.stats) {
        // A ring allgather: W - 1 messages out and in, three times.
        CHECK(s.bytes_sent == 3 * static_cast<size_t>(world - 1) * message);
        CHECK(s.bytes_received == 3 * static_cast<size_t>(world - 1) * message);
        CHECK(s.peak_sync_bytes_sent == static_cast<size_t>(world - 1) * message);  // one sync
        CHECK(s.steps == steps);
      }
    }
  // At scale: 1M parameters in chunks of 4096, 64 each, 2 bits: 108x fewer bytes than float32.
  const SparseLoCo defaults;
  const size_t n = 1 << 20;
  CHECK(sparseloco_message_bytes(defaults, n) == 256 * 8 + 16384 * 2 + 16384 / 4);
  CHECK(4.0 * n / double(sparseloco_message_bytes(defaults, n)) > 100);
}

TEST_CASE(
    "SparseLoCo resumed from its saved state continues bit-identically, error memory included") {
  torch::manual_seed(11);
  const auto init = flat_of(*make_net());
  const int world = 2, steps = 10, stop = 5;  // stopped between two synchronisations
  const SparseLoCo c = small_config();
  Batches b(world, steps, kSeed);
  test::check_resume<SparseLoCoModule>(init, b, world, steps, stop, c);
  // A state saved under other settings is refused, naming both.
  auto errors = test::run_threads(1, [&](int, Runtime& rt) {
    auto net = make_net();
    SparseLoCo other = c;
    other.value_bits = 4;
    const auto refused = test::load_error<SparseLoCoModule>(rt, net, c, other);
    CHECK(refused.find("bits=2") != std::string::npos);
    CHECK(refused.find("bits=4") != std::string::npos);
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE("SparseLoCo refuses settings out of range, naming them") {
  auto errors = test::run_threads(1, [](int, Runtime& rt) {
    auto net = make_net();
    auto error_of = [&](const SparseLoCo& c) {
      return test::settings_error<SparseLoCoModule>(rt, net, c);
    };
    SparseLoCo c;
    c.inner_steps = 0;
    CHECK(error_of(c) == "SparseLoCo: inner_steps = 0, expected >= 1");
    c = SparseLoCo{};
    c.ratio = 0;
    CHECK(error_of(c) == "SparseLoCo: ratio = 0, expected 0 < ratio <= 1");
    c = SparseLoCo{};
    c.value_bits = 3;
    CHECK(error_of(c) == "SparseLoCo: value_bits = 3, expected 2, 4, 8 or 32");
    c = SparseLoCo{};
    c.chunk = 70000;
    CHECK(error_of(c) == "SparseLoCo: chunk = 70000, expected 1 <= chunk <= 65536");
    c = SparseLoCo{};
    c.ef_decay = 1.5;
    CHECK(error_of(c) == "SparseLoCo: ef_decay = 1.5, expected 0 <= ef_decay <= 1");
    c = SparseLoCo{};
    c.outer_lr = -1;
    CHECK(error_of(c) == "SparseLoCo: outer_lr = -1, expected a finite number > 0");
    CHECK(error_of(SparseLoCo{}).empty());
  });
  for (auto& e : errors) CHECK(e.empty());
  CHECK(sparseloco_name(SparseLoCo{}) ==
        "sparseloco(h=50, ratio=0.015625, chunk=4096, bits=2, beta=0.95, outer_lr=1)");
}

TEST_CASE("SparseLoCo is named on the command line and in job files, its keys checked") {
  auto s = std::get<SparseLoCo>(parse_algorithm_argument(
      "sparseloco:h=20,ratio=0.02,bits=4,beta=0.9,outer_lr=0.7,chunk=1024"));
  CHECK(s.inner_steps == 20);
  CHECK(s.ratio == 0.02);
  CHECK(s.value_bits == 4);
  CHECK(s.ef_decay == 0.9);
  CHECK(s.outer_lr == 0.7);
  CHECK(s.chunk == 1024);
  const auto defaults = std::get<SparseLoCo>(parse_algorithm_argument("sparseloco"));
  CHECK(defaults.inner_steps == 50);
  CHECK(defaults.value_bits == 2);
  const auto error_of = test::algorithm_error;
  CHECK(error_of("sparseloco:h=0") ==
        "--algorithm sparseloco:h=0: h = '0', expected an integer >= 1");
  CHECK(error_of("sparseloco:bits=3") ==
        "--algorithm sparseloco:bits=3: bits = '3', expected 2, 4, 8 or 32");
  CHECK(error_of("sparseloco:ratio=0") ==
        "--algorithm sparseloco:ratio=0: ratio = '0', expected a number in (0, 1]");
  CHECK(error_of("sparseloco:beta=2") ==
        "--algorithm sparseloco:beta=2: beta = '2', expected a number in [0, 1]");
  CHECK(error_of("sparseloco:chunk=0.5") ==
        "--algorithm sparseloco:chunk=0.5: chunk = '0.5', expected an integer in [1, 65536]");
  CHECK(error_of("sparseloco:outer_lr=x") ==
        "--algorithm sparseloco:outer_lr=x: outer_lr = 'x', expected a number > 0");
  CHECK(error_of("sparseloco:h=2,h=3") == "--algorithm sparseloco:h=2,h=3: h is given twice");
  CHECK(error_of("sparseloco:compress=int4") ==
        "--algorithm sparseloco:compress=int4: unknown key 'compress' (allowed: h, outer_lr, "
        "ratio, chunk, bits, beta)");
  CHECK(error_of("sparseloco:h") ==
        "--algorithm sparseloco:h: 'h' is not key=value (keys: h, outer_lr, ratio, chunk, bits, "
        "beta)");

  const auto job = test::job_of("sparseloco",
                                "inner_steps = 10\nratio = 0.03\nvalue_bits = 8\n"
                                "ef_decay = 0.5\nchunk = 512\nouter_lr = 0.9\n");
  auto j = std::get<SparseLoCo>(job.algorithm);
  CHECK(j.inner_steps == 10);
  CHECK(j.ratio == 0.03);
  CHECK(j.value_bits == 8);
  CHECK(j.ef_decay == 0.5);
  CHECK(j.chunk == 512);
  CHECK(j.outer_lr == 0.9);
  CHECK(job_algorithm_name(job.algorithm) == "sparseloco");
  CHECK(!tolerates_dead_ranks(job.algorithm));
  auto job_error = [](const std::string& settings) {
    return test::job_error("sparseloco", settings);
  };
  CHECK(job_error("value_bits = 3\n") ==
        "bad.toml: algorithm.value_bits = 3: expected 2, 4, 8 or 32");
  CHECK(job_error("chunk = 70000\n") ==
        "bad.toml: algorithm.chunk = 70000: expected an integer in [1, 65536]");
  CHECK(job_error("ratio = 0\n") == "bad.toml: algorithm.ratio = 0: expected a number in (0, 1]");
  CHECK(job_error("ef_decay = -0.5\n") ==
        "bad.toml: algorithm.ef_decay = -0.5: expected a number in [0, 1]");
  const std::string misspelt = job_error("inner_step = 10\n");
  CHECK(misspelt.find("inner_step") != std::string::npos);
  CHECK(misspelt.find("ef_decay") != std::string::npos);  // the allowed keys
}

TEST_CASE("make_data_parallel runs SparseLoCo") {
  SparseLoCo c;
  c.inner_steps = 2;
  test::run_two_steps(c, [&](Runtime& rt, torch::nn::Sequential& net, DataParallel& dp) {
    CHECK(dp.algorithm_name() ==
          "sparseloco(h=2, ratio=0.015625, chunk=4096, bits=2, beta=0.95, outer_lr=1)");
    // After a synchronisation every rank holds the same global weights.
    const auto mine = flat_of(*net);
    CHECK(torch::equal(mine, test::rank0_copy(rt, mine)));
    CHECK(dp.stats().bytes_sent == sparseloco_message_bytes(c, kParameters));
  });
}
