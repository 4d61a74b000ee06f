// DiLoCo on thread ranks against a single-process simulation written here: W replicas of the
// model, each stepped by its own inner optimizer on its rank's batches, and every H steps the
// averaged outer gradient stepped by Nesterov SGD into the global weights they all restart from.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <vector>

#include "algorithms/local_update/diloco.h"
#include "algorithms/registry.h"
#include "comm/state.h"
#include "tests/support/local_update.h"
#include "tests/support/thread_ranks.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

using namespace troupe::test;

// The simulation: the final weights of every replica.
std::vector<torch::Tensor> simulate(const torch::Tensor& init, const Batches& b, int world,
                                    int steps, const DiLoCo& c, bool adamw) {
  std::vector<torch::nn::Sequential> nets;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  for (int r = 0; r < world; ++r) {
    nets.push_back(make_net());
    load_flat(*nets.back(), init);
    opts.push_back(make_inner(*nets.back(), adamw));
  }
  auto global = init.clone(), momentum = torch::zeros_like(init);
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      train_step(nets[static_cast<size_t>(r)], *opts[static_cast<size_t>(r)],
                 b.data[static_cast<size_t>(r)][static_cast<size_t>(s)]);
      opts[static_cast<size_t>(r)]->step();
    }
    if ((s + 1) % c.inner_steps != 0) continue;
    auto delta = torch::zeros_like(init);
    for (auto& n : nets) delta += global - flat_of(*n);
    delta /= world;
    momentum = c.outer_momentum * momentum + delta;
    global = global - c.outer_lr * (c.nesterov ? delta + c.outer_momentum * momentum : momentum);
    for (auto& n : nets) load_flat(*n, global);
  }
  std::vector<torch::Tensor> out;
  for (auto& n : nets) out.push_back(flat_of(*n));
  return out;
}

// The same on `world` thread ranks, every rank having synchronised steps / H times.
test::RankRuns run_diloco(const torch::Tensor& init, const Batches& b, int world, int steps,
                          const DiLoCo& c, bool adamw) {
  auto runs = test::run_on_ranks<DiLoCoModule>(init, b, world, steps, c, test::inner_of(adamw));
  for (auto n : runs.outer_steps) CHECK(n == steps / c.inner_steps);
  return runs;
}

// DiLoCo at H = 4 on 3 thread ranks for 8 steps, exact and with its outer gradient compressed,
// from the same start and batches.
struct Compared {
  static constexpr int world = 3, steps = 8;
  torch::Tensor init;
  test::RankRuns exact, compressed;
};

Compared compare_to_exact(const comm::Compression& compression) {
  torch::manual_seed(4);
  Compared out;
  out.init = flat_of(*make_net()).clone();
  DiLoCo c;
  c.inner_steps = 4;
  Batches b(Compared::world, Compared::steps);
  out.exact = run_diloco(out.init, b, Compared::world, Compared::steps, c, false);
  c.outer_compression = compression;
  out.compressed = run_diloco(out.init, b, Compared::world, Compared::steps, c, false);
  return out;
}

}  // namespace

TEST_CASE("DiLoCo on 1 to 4 thread ranks follows the single-process simulation") {
  torch::manual_seed(3);
  const auto init = flat_of(*make_net()).clone();
  const int steps = 11;  // two synchronisations at H = 4, then three local steps
  DiLoCo c;
  c.inner_steps = 4;
  for (bool adamw : {false, true})
    for (bool nesterov : {true, false})
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(adamw);
        CAPTURE(nesterov);
        CAPTURE(world);
        c.nesterov = nesterov;
        Batches b(world, steps);
        auto want = simulate(init, b, world, steps, c, adamw);
        auto got = run_diloco(init, b, world, steps, c, adamw).weights;
        for (int r = 0; r < world; ++r) {
          CAPTURE(r);
          CHECK(torch::allclose(got[static_cast<size_t>(r)], want[static_cast<size_t>(r)], 1e-5,
                                1e-6));
        }
        // Not the same as plain local training: the outer step moved the weights.
        if (world > 1) CHECK(!torch::allclose(want[0], want[1]));
      }
}

TEST_CASE("DiLoCo's outer gradient in fp16 stays near the exact run at about half the bytes") {
  const auto runs = compare_to_exact(comm::HalfPrecision{});
  const auto &exact = runs.exact, &half = runs.compressed;
  for (size_t r = 0; r < static_cast<size_t>(Compared::world); ++r) {
    CHECK(torch::allclose(half.weights[r], exact.weights[r], 1e-2, 1e-3));
    const double sent_exact = static_cast<double>(exact.stats[r].bytes_sent);
    const double sent_half = static_cast<double>(half.stats[r].bytes_sent);
    CHECK(sent_exact > 0);
    CHECK(sent_half < 0.6 * sent_exact);
    CHECK(half.stats[r].steps == Compared::steps);
  }
}

TEST_CASE("DiLoCo's outer gradient in 4 bits stays near the exact run at a fraction of the bytes") {
  const auto int4_compression =
      std::get<DiLoCo>(parse_algorithm_argument("diloco:compress=int4:block=16")).outer_compression;
  REQUIRE(std::get<comm::Int4Quantization>(int4_compression).block == 16);
  const auto job = test::job_of("diloco", "outer_compression = \"int4\"\n");
  CHECK(std::holds_alternative<comm::Int4Quantization>(
      std::get<DiLoCo>(job.algorithm).outer_compression));
  const auto runs = compare_to_exact(int4_compression);
  const auto &exact = runs.exact.weights, &int4 = runs.compressed.weights;
  const int world = Compared::world;
  const double moved = (exact[0] - runs.init).abs().max().item<double>();
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const double off =
        (int4[static_cast<size_t>(r)] - exact[static_cast<size_t>(r)]).abs().max().item<double>();
    CAPTURE(off);
    CAPTURE(moved);
    CHECK(off > 0);            // the codes did lose something
    CHECK(off < 0.1 * moved);  // but little of the way the weights travelled
    CHECK(torch::equal(int4[static_cast<size_t>(r)], int4[0]));  // every rank decodes the same
    const double sent_exact =
        static_cast<double>(runs.exact.stats[static_cast<size_t>(r)].bytes_sent);
    const double sent_int4 =
        static_cast<double>(runs.compressed.stats[static_cast<size_t>(r)].bytes_sent);
    CHECK(sent_int4 < 0.5 * sent_exact);  // 83 parameters: the blocks' headers weigh
    // Two synchronisations of an alltoall and an allgather of W - 1 slots each; a slot holds the
    // largest chunk, 28 elements: two blocks' {min, max} (16 bytes) and 14 code bytes, in words.
    CHECK(runs.compressed.stats[static_cast<size_t>(r)].bytes_sent == 2 * 2 * (world - 1) * 32);
  }
}

TEST_CASE("DiLoCo refuses settings out of range, naming them") {
  auto errors = test::run_threads(1, [](int, Runtime& rt) {
    auto net = make_net();
    auto error_of = [&](const DiLoCo& c) { return test::settings_error<DiLoCoModule>(rt, net, c); };
    DiLoCo c;
    c.inner_steps = 0;
    CHECK(error_of(c).find("inner_steps = 0, expected >= 1") != std::string::npos);
    c = DiLoCo{};
    c.outer_lr = 0;
    CHECK(error_of(c).find("outer_lr = 0") != std::string::npos);
    c = DiLoCo{};
    c.outer_momentum = 1;
    CHECK(error_of(c).find("outer_momentum = 1") != std::string::npos);
    CHECK(error_of(DiLoCo{}).empty());
    CHECK(diloco_name(DiLoCo{}) == "diloco(h=50, outer_lr=0.7, outer_momentum=0.9, allreduce)");
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE(
    "DiLoCo resumed from its saved state continues bit-identically, error feedback included") {
  torch::manual_seed(5);
  const auto init = flat_of(*make_net()).clone();
  const int world = 2, steps = 12, stop = 6;  // stopped between two synchronisations
  DiLoCo c;
  c.inner_steps = 4;
  comm::Sparsification topk;
  topk.ratio = 0.25;  // error feedback on: its residual is state that must survive
  c.outer_compression = topk;
  Batches b(world, steps);
  test::check_resume<DiLoCoModule>(init, b, world, steps, stop, c);  // the inner SGD is stateless
}

TEST_CASE("DiLoCo is named on the command line and in job files, its keys checked") {
  auto d = std::get<DiLoCo>(parse_algorithm_argument(
      "diloco:h=20,outer_lr=0.5,outer_momentum=0.8,nesterov=0,compress=fp16"));
  CHECK(d.inner_steps == 20);
  CHECK(d.outer_lr == 0.5);
  CHECK(d.outer_momentum == 0.8);
  CHECK(!d.nesterov);
  CHECK(std::holds_alternative<comm::HalfPrecision>(d.outer_compression));
  auto defaults = std::get<DiLoCo>(parse_algorithm_argument("diloco"));
  CHECK(defaults.inner_steps == 50);
  CHECK(std::holds_alternative<comm::GradientAllReduce>(defaults.outer_compression));
  CHECK(std::holds_alternative<comm::Compression>(parse_algorithm_argument("topk:ratio=0.1")));
  const auto error_of = test::algorithm_error;
  CHECK(error_of("diloco:h=0").find("h = '0', expected an integer >= 1") != std::string::npos);
  CHECK(error_of("diloco:h=2.5").find("h = '2.5', expected an integer >= 1") != std::string::npos);
  CHECK(error_of("diloco:outer_momentum=1").find("expected a number in [0, 1)") !=
        std::string::npos);
  CHECK(error_of("diloco:outer_lr=x").find("outer_lr = 'x', expected a number > 0") !=
        std::string::npos);
  CHECK(error_of("diloco:h=2,h=3").find("h is given twice") != std::string::npos);
  CHECK(error_of("diloco:foo=1").find("unknown key 'foo' (allowed: h, outer_lr") !=
        std::string::npos);
  CHECK(error_of("diloco:compress=nope").find("nope") != std::string::npos);

  const auto job = test::job_of(
      "diloco", "inner_steps = 10\nouter_lr = 0.6\nouter_compression = \"topk:ratio=0.1\"\n");
  auto j = std::get<DiLoCo>(job.algorithm);
  CHECK(j.inner_steps == 10);
  CHECK(j.outer_lr == 0.6);
  CHECK(std::get<comm::Sparsification>(j.outer_compression).ratio == 0.1);
  CHECK(job_algorithm_name(job.algorithm) == "diloco");
  CHECK(!tolerates_dead_ranks(job.algorithm));
  const auto misspelt = test::job_error("diloco", "inner_step = 10\n");
  CHECK(misspelt.find("inner_step") != std::string::npos);
  CHECK(misspelt.find("inner_steps") != std::string::npos);  // the allowed keys
}

TEST_CASE("make_data_parallel runs DiLoCo") {
  DiLoCo c;
  c.inner_steps = 2;
  test::run_two_steps(c, [](Runtime& rt, torch::nn::Sequential& net, DataParallel& dp) {
    CHECK(dp.algorithm_name() == "diloco(h=2, outer_lr=0.7, outer_momentum=0.9, allreduce)");
    // After a synchronisation every rank holds the same global weights.
    const auto mine = flat_of(*net);
    CHECK(torch::equal(mine, test::rank0_copy(rt, mine)));
    CHECK(dp.stats().bytes_sent > 0);
  });
}
