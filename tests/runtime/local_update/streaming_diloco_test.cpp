// Streaming DiLoCo on thread ranks against a single-process simulation written here: W replicas
// of the model, each stepped by its own inner optimizer on its rank's batches; fragment f's outer
// gradient taken after step t when t mod H is its offset, averaged, and applied `delay` steps
// later (outer Nesterov step on the fragment's global copy, then local = alpha local +
// (1 - alpha) global), with eager updates' provisional step where asked.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <vector>

#include "algorithms/local_update/diloco.h"
#include "algorithms/local_update/streaming_diloco.h"
#include "algorithms/registry.h"
#include "comm/state.h"
#include "tests/support/local_update.h"
#include "tests/support/thread_ranks.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

using namespace troupe::test;

using Cuts = std::vector<std::pair<size_t, size_t>>;

struct Simulated {
  std::vector<torch::Tensor> weights;  // each replica's at the end
  int64_t outer_steps = 0;
};

// The simulation of W replicas (fragments given by `cuts`).
Simulated simulate(const torch::Tensor& init, const Batches& b, int world, int steps,
                   const StreamingDiLoCo& c, bool adamw, const Cuts& cuts) {
  const auto W = static_cast<size_t>(world);
  std::vector<torch::nn::Sequential> nets;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  std::vector<torch::Tensor> x(W);  // the replicas' flat weights between the model's updates
  for (size_t r = 0; r < W; ++r) {
    nets.push_back(make_net());
    load_flat(*nets.back(), init);
    opts.push_back(make_inner(*nets.back(), adamw));
  }
  auto global = init.clone(), momentum = torch::zeros_like(init);
  const size_t P = cuts.size();
  std::vector<std::vector<torch::Tensor>> others(P, std::vector<torch::Tensor>(W));
  std::vector<bool> has_average(P, false);
  std::vector<torch::Tensor> own(W), provisional(W);
  int flight = -1;
  int64_t apply_at = 0, outer = 0;
  torch::Tensor average;
  auto part = [&](const torch::Tensor& t, int f) {
    const auto [lo, hi] = cuts[static_cast<size_t>(f)];
    return t.narrow(0, static_cast<int64_t>(lo), static_cast<int64_t>(hi - lo));
  };
  auto offset = [&](int f) { return (f + 1) * c.inner_steps / c.fragments % c.inner_steps; };
  auto start = [&](int f) {
    auto g = part(global, f).clone();
    average = torch::zeros_like(g);
    for (size_t r = 0; r < W; ++r) {
      auto w = flat_of(*nets[r]).clone();
      auto d = g - part(w, f);
      average += d;
      if (c.eager) {
        own[r] = d;
        auto proxy = has_average[static_cast<size_t>(f)]
                         ? d / world + others[static_cast<size_t>(f)][r] * (world - 1.0) / world
                         : d;
        auto m = c.outer_momentum * part(momentum, f) + proxy;
        provisional[r] = g - c.outer_lr * (c.nesterov ? proxy + c.outer_momentum * m : m);
        part(w, f).copy_(provisional[r]);
        load_flat(*nets[r], w);
      }
    }
    average /= world;
    flight = f;
  };
  auto apply = [&]() {
    const int f = flight;
    auto m = part(momentum, f), g = part(global, f);
    m.copy_(c.outer_momentum * m + average);
    g.copy_(g - c.outer_lr * (c.nesterov ? average + c.outer_momentum * m : m));
    for (size_t r = 0; r < W; ++r) {
      auto w = flat_of(*nets[r]).clone();
      auto local = part(w, f);
      if (c.eager) {
        local.copy_(local + g - provisional[r]);
        others[static_cast<size_t>(f)][r] =
            world > 1 ? (average * world - own[r]) / (world - 1) : torch::zeros_like(average);
      }
      local.copy_(c.fragment_update_alpha * local + (1 - c.fragment_update_alpha) * g);
      load_flat(*nets[r], w);
    }
    if (c.eager) has_average[static_cast<size_t>(f)] = true;
    flight = -1;
    ++outer;
  };
  for (int s = 0; s < steps; ++s) {
    for (size_t r = 0; r < W; ++r) {
      train_step(nets[r], *opts[r], b.at(static_cast<int>(r), s));
      opts[r]->step();
    }
    const int t = s + 1;
    if (flight >= 0 && t == apply_at) apply();
    for (int f = 0; f < c.fragments; ++f)
      if (t % c.inner_steps == offset(f)) {
        start(f);
        apply_at = t + c.delay;
        if (c.delay == 0) apply();
      }
  }
  Simulated out;
  for (auto& n : nets) out.weights.push_back(flat_of(*n));
  out.outer_steps = outer;
  return out;
}

struct Run {
  std::vector<torch::Tensor> weights;
  std::vector<CommStats> stats;
  std::vector<std::vector<uint64_t>> sync_bytes;  // Streaming DiLoCo's: each rank's, per sync
  int64_t outer_steps = 0;                        // rank 0's
  Cuts cuts;                                      // Streaming DiLoCo's fragments
};

// The same on `world` thread ranks.
template <class Module = StreamingDiLoCoModule, class Config = StreamingDiLoCo>
Run run_module(const torch::Tensor& init, const Batches& b, int world, int steps, const Config& c,
               bool adamw, int width = 8) {
  Run out;
  out.sync_bytes.resize(static_cast<size_t>(world));
  std::function<void(int, Module&)> after;
  if constexpr (std::is_same_v<Module, StreamingDiLoCoModule>)
    after = [&](int rank, Module& dp) {
      out.sync_bytes[static_cast<size_t>(rank)] = dp.sync_bytes_sent();
      if (rank == 0) out.cuts = dp.fragments();
    };
  auto runs =
      test::run_on_ranks<Module>(init, b, world, steps, c, test::inner_of(adamw), width, after);
  out.weights = std::move(runs.weights);
  out.stats = std::move(runs.stats);
  out.outer_steps = runs.outer_steps[0];
  return out;
}

}  // namespace

TEST_CASE("fragments are near-equal slices of the flat parameters, cut at row boundaries") {
  // A 4 x 10 matrix, a 10-vector (cut anywhere) and a 2 x 25 matrix: 100 elements, 16 rows.
  const std::vector<size_t> rows = {4, 10, 2}, cols = {10, 1, 25};
  CHECK(streaming_fragments(rows, cols, 1) == Cuts{{0, 100}});
  CHECK(streaming_fragments(rows, cols, 2) == Cuts{{0, 50}, {50, 100}});
  // Targets 25, 50, 75: 25 lies between the rows ending at 20 and 30 (the later is taken).
  CHECK(streaming_fragments(rows, cols, 4) == Cuts{{0, 30}, {30, 50}, {50, 75}, {75, 100}});
  // 16 fragments: one row each, however unequal.
  auto each = streaming_fragments(rows, cols, 16);
  REQUIRE(each.size() == 16);
  CHECK(each.front() == std::make_pair<size_t, size_t>(0, 10));
  CHECK(each.back() == std::make_pair<size_t, size_t>(75, 100));
  for (size_t i = 1; i < each.size(); ++i) CHECK(each[i].first == each[i - 1].second);
  try {
    streaming_fragments(rows, cols, 17);
    FAIL("17 fragments of 16 rows were made");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find("fragments = 17, expected 1 <= it <= 16") !=
          std::string::npos);
  }
}

TEST_CASE(
    "Streaming DiLoCo on 1 to 4 thread ranks follows the single-process simulation, "
    "fragment schedule and delay included") {
  torch::manual_seed(3);
  const auto init = flat_of(*make_net()).clone();
  const int steps = 15;  // leaves a fragment in flight at the end
  struct Case {
    int h, p, delay;
    double alpha;
    bool nesterov, eager, adamw;
  };
  const std::vector<Case> cases = {
      {4, 2, 1, 0.5, true, false, false},  // syncs after steps 2, 4, 6, ...; applied one later
      {6, 3, 2, 0.0, false, false, true},  // the delay's local steps replaced by the global
      {5, 2, 2, 0.5, true, false, false},  // H not a multiple of P: offsets 2 and 0
      {4, 2, 1, 0.5, true, true, false},   // eager updates
      {6, 3, 2, 0.0, true, true, true},   {4, 1, 0, 0.5, true, true, false},  // eager, no delay
  };
  for (const auto& k : cases)
    for (int world = 1; world <= 4; ++world) {
      StreamingDiLoCo c;
      c.inner_steps = k.h;
      c.fragments = k.p;
      c.delay = k.delay;
      c.fragment_update_alpha = k.alpha;
      c.nesterov = k.nesterov;
      c.eager = k.eager;
      CAPTURE(streaming_diloco_name(c));
      CAPTURE(k.adamw);
      CAPTURE(world);
      Batches b(world, steps);
      auto got = run_module(init, b, world, steps, c, k.adamw);
      REQUIRE(got.cuts.size() == static_cast<size_t>(k.p));
      auto want = simulate(init, b, world, steps, c, k.adamw, got.cuts);
      CHECK(got.outer_steps == want.outer_steps);
      CHECK(got.outer_steps >= steps / k.h * k.p - 1);
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(torch::allclose(got.weights[static_cast<size_t>(r)],
                              want.weights[static_cast<size_t>(r)], 1e-5, 1e-6));
      }
      if (world > 1) CHECK(!torch::allclose(want.weights[0], want.weights[1]));
    }
}

TEST_CASE(
    "the simulation tells the schedule apart: a different delay or alpha gives other weights") {
  torch::manual_seed(6);
  const auto init = flat_of(*make_net()).clone();
  const int world = 2, steps = 9;
  Batches b(world, steps);
  StreamingDiLoCo c;
  c.inner_steps = 4;
  c.fragments = 2;
  c.delay = 1;
  auto base = run_module(init, b, world, steps, c, false);
  auto want = simulate(init, b, world, steps, c, false, base.cuts);
  CHECK(torch::allclose(base.weights[0], want.weights[0], 1e-5, 1e-6));
  for (int variant = 0; variant < 3; ++variant) {
    StreamingDiLoCo other = c;
    if (variant == 0) other.delay = 2;
    if (variant == 1) other.fragment_update_alpha = 0.25;
    if (variant == 2) other.eager = true;
    CAPTURE(variant);
    CHECK(!torch::allclose(simulate(init, b, world, steps, other, false, base.cuts).weights[0],
                           want.weights[0], 1e-5, 1e-6));
  }
}

TEST_CASE("with one fragment and no delay Streaming DiLoCo is plain DiLoCo, bit for bit") {
  torch::manual_seed(7);
  const auto init = flat_of(*make_net()).clone();
  const int steps = 10;
  for (bool half : {false, true})
    for (int world = 1; world <= 3; ++world) {
      CAPTURE(half);
      CAPTURE(world);
      Batches b(world, steps);
      DiLoCo d;
      d.inner_steps = 3;
      StreamingDiLoCo s;
      s.inner_steps = 3;
      s.fragments = 1;
      s.delay = 0;
      s.fragment_update_alpha = 0;  // the global replaces the local fragment, as in DiLoCo
      if (half) d.outer_compression = s.outer_compression = comm::HalfPrecision{};
      auto plain = run_module<DiLoCoModule, DiLoCo>(init, b, world, steps, d, true);
      auto streaming = run_module(init, b, world, steps, s, true);
      CHECK(streaming.outer_steps == plain.outer_steps);
      for (int r = 0; r < world; ++r) {
        CHECK(torch::equal(streaming.weights[static_cast<size_t>(r)],
                           plain.weights[static_cast<size_t>(r)]));
        CHECK(streaming.stats[static_cast<size_t>(r)].bytes_sent ==
              plain.stats[static_cast<size_t>(r)].bytes_sent);
      }
    }
}

TEST_CASE("each sync of P fragments sends about 1/P of DiLoCo's bytes, the total about the same") {
  const int world = 3, steps = 12, width = 256;  // 6*256+256+256*3+3 = 2563 floats
  Batches b(world, steps);
  DiLoCo d;
  d.inner_steps = 4;
  auto plain = run_module<DiLoCoModule, DiLoCo>(torch::Tensor(), b, world, steps, d, false, width);
  for (int p : {2, 4}) {
    CAPTURE(p);
    StreamingDiLoCo s;
    s.inner_steps = 4;
    s.fragments = p;
    s.delay = 1;
    auto streaming = run_module(torch::Tensor(), b, world, steps, s, false, width);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const auto& ps = plain.stats[static_cast<size_t>(r)];
      const auto& ss = streaming.stats[static_cast<size_t>(r)];
      REQUIRE(ps.peak_sync_bytes_sent > 0);
      const double ratio = static_cast<double>(ps.peak_sync_bytes_sent) /
                           static_cast<double>(ss.peak_sync_bytes_sent);
      // The peak is the largest fragment's sync; fragments end at row boundaries (the last
      // matrix has rows of 256), so they are near P-th parts of the model, not exact ones.
      size_t largest = 0;
      for (const auto& [lo, hi] : streaming.cuts) largest = std::max(largest, hi - lo);
      const double expected = 2563.0 / static_cast<double>(largest);
      CHECK(expected > 0.8 * p);
      CHECK(ratio > 0.9 * expected);
      CHECK(ratio < 1.1 * expected);
      // Every sync is counted, and they sum to the total.
      const auto& each = streaming.sync_bytes[static_cast<size_t>(r)];
      CHECK(static_cast<int64_t>(each.size()) == streaming.outer_steps);
      uint64_t sum = 0;
      for (auto x : each) sum += x;
      CHECK(sum == ss.bytes_sent);
      // Over the same steps the fragments together send what DiLoCo sends (the last fragment of
      // the 12 steps is still in flight, the first synced early: P syncs per H steps either way).
      const double per_sync_plain = static_cast<double>(ps.bytes_sent) / (steps / 4);
      const double per_h_streaming =
          static_cast<double>(sum) / static_cast<double>(each.size()) * p;
      CHECK(per_h_streaming > 0.9 * per_sync_plain);
      CHECK(per_h_streaming < 1.1 * per_sync_plain);
    }
  }
}

TEST_CASE("a fragment's reduction travels while the trainer takes the delay's steps") {
  // Rank 1 starts the sync only after rank 0 has taken both delay steps beyond it: a reduction
  // run on rank 0's trainer thread would wait for rank 1 there, and rank 1 would never start.
  std::promise<void> rank0_ahead;
  auto ahead = rank0_ahead.get_future().share();
  auto errors = test::run_threads(2, [&](int rank, Runtime& rt) {
    auto net = make_net();
    StreamingDiLoCo c;
    c.inner_steps = 4;
    c.fragments = 2;
    c.delay = 2;
    StreamingDiLoCoModule dp(rt, net.ptr(), c);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    auto one = [&] {
      test::rank_gradients(net, opt, rank);
      dp.step(opt);
    };
    one();  // step 1
    if (rank == 1) REQUIRE(ahead.wait_for(std::chrono::seconds(15)) == std::future_status::ready);
    one();  // step 2: fragment 0 starts
    one();  // step 3
    if (rank == 0) rank0_ahead.set_value();
    one();  // step 4: fragment 0 lands (both ranks needed), fragment 1 starts
    CHECK(dp.outer_steps() == 1);
    dp.finish();
    CHECK(dp.outer_steps() == 2);
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE(
    "Streaming DiLoCo resumed from a state saved with a fragment in flight continues "
    "bit-identically") {
  torch::manual_seed(5);
  const auto init = flat_of(*make_net()).clone();
  const int world = 2, steps = 13, stop = 6;  // fragment 0 synced after step 6, lands after 7
  Batches b(world, steps);
  for (int variant = 0; variant < 2; ++variant) {
    StreamingDiLoCo c;
    c.inner_steps = 4;
    c.fragments = 2;
    c.delay = 1;
    if (variant == 0) {
      comm::Sparsification topk;
      topk.ratio = 0.25;  // error feedback per fragment: state that must survive
      c.outer_compression = topk;
    } else {
      c.eager = true;  // the others' last average and the provisional step
      c.outer_compression = comm::HalfPrecision{};
    }
    CAPTURE(streaming_diloco_name(c));
    test::check_resume<StreamingDiLoCoModule>(init, b, world, steps, stop, c);
  }
}

TEST_CASE("Streaming DiLoCo refuses settings out of range and a state of other settings") {
  auto errors = test::run_threads(1, [](int, Runtime& rt) {
    auto net = make_net();
    auto error_of = [&](const StreamingDiLoCo& c) {
      return test::settings_error<StreamingDiLoCoModule>(rt, net, c);
    };
    auto with = [](auto change) {
      StreamingDiLoCo c;
      change(c);
      return c;
    };
    CHECK(error_of(with([](auto& c) { c.inner_steps = 0; })).find("inner_steps = 0") !=
          std::string::npos);
    CHECK(error_of(with([](auto& c) {
            c.fragments = 0;
          })).find("fragments = 0, expected 1 <= it <= inner_steps (50)") != std::string::npos);
    CHECK(error_of(with([](auto& c) {
            c.inner_steps = 3;
            c.fragments = 4;
          })).find("fragments = 4") != std::string::npos);
    CHECK(error_of(with([](auto& c) {
            c.delay = 13;
          })).find("delay = 13, expected 0 <= it <= inner_steps / fragments (12)") !=
          std::string::npos);
    CHECK(error_of(with([](auto& c) { c.delay = -1; })).find("delay = -1") != std::string::npos);
    CHECK(error_of(with([](auto& c) {
            c.fragment_update_alpha = 1.5;
          })).find("fragment_update_alpha = 1.5") != std::string::npos);
    CHECK(error_of(with([](auto& c) { c.outer_lr = 0; })).find("outer_lr = 0") !=
          std::string::npos);
    CHECK(error_of(with([](auto& c) { c.outer_momentum = 1; })).find("outer_momentum = 1") !=
          std::string::npos);
    // The net's rows: 8 (weight) + 8 (bias) + 3 + 3 = 22; 23 fragments cannot be cut.
    CHECK(error_of(with([](auto& c) {
            c.fragments = 23;
            c.delay = 0;
          })).find("fragments = 23, expected 1 <= it <= 22") != std::string::npos);
    CHECK(error_of(StreamingDiLoCo{}).empty());
    CHECK(streaming_diloco_name(StreamingDiLoCo{}) ==
          "streaming_diloco(h=50, fragments=4, delay=1, alpha=0.5, outer_lr=0.7, "
          "outer_momentum=0.9, allreduce)");

    // A state saved under other settings is refused, naming both.
    StreamingDiLoCo c;
    c.inner_steps = 4;
    c.fragments = 2;
    StreamingDiLoCo other = c;
    other.delay = 2;
    const auto refused = test::load_error<StreamingDiLoCoModule>(rt, net, c, other);
    CHECK(refused.find("delay=1") != std::string::npos);
    CHECK(refused.find("delay=2") != std::string::npos);
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE("Streaming DiLoCo is named on the command line and in job files, its keys checked") {
  auto s = std::get<StreamingDiLoCo>(parse_algorithm_argument(
      "streaming-diloco:h=50,fragments=4,delay=2,alpha=0.25,compress=fp16,eager=1"));
  CHECK(s.inner_steps == 50);
  CHECK(s.fragments == 4);
  CHECK(s.delay == 2);
  CHECK(s.fragment_update_alpha == 0.25);
  CHECK(s.eager);
  CHECK(std::holds_alternative<comm::HalfPrecision>(s.outer_compression));
  auto t = std::get<StreamingDiLoCo>(
      parse_algorithm_argument("streaming_diloco:outer_lr=0.5,outer_momentum=0.8,nesterov=0"));
  CHECK(t.outer_lr == 0.5);
  CHECK(t.outer_momentum == 0.8);
  CHECK(!t.nesterov);
  CHECK(std::holds_alternative<StreamingDiLoCo>(parse_algorithm_argument("streaming-diloco")));
  const auto error_of = test::algorithm_error;
  CHECK(
      error_of("streaming-diloco:fragments=0").find("fragments = '0', expected an integer >= 1") !=
      std::string::npos);
  CHECK(error_of("streaming-diloco:h=3,fragments=4")
            .find("fragments = 4, expected an integer in [1, h] (h = 3)") != std::string::npos);
  CHECK(error_of("streaming-diloco:h=50,fragments=4,delay=13")
            .find("delay = 13, expected an integer in [0, 12]") != std::string::npos);
  CHECK(error_of("streaming-diloco:delay=-1").find("delay = '-1', expected an integer >= 0") !=
        std::string::npos);
  CHECK(error_of("streaming-diloco:alpha=2").find("alpha = '2', expected a number in [0, 1]") !=
        std::string::npos);
  CHECK(
      error_of("streaming-diloco:eager=yes").find("eager = 'yes', expected 0, 1, true or false") !=
      std::string::npos);
  CHECK(error_of("streaming-diloco:delay=1,delay=2").find("delay is given twice") !=
        std::string::npos);
  CHECK(error_of("streaming-diloco:fragment=2")
            .find("unknown key 'fragment' (allowed: h, fragments, delay, alpha") !=
        std::string::npos);
  CHECK(error_of("streaming-diloco:compress=int3").find("int3") != std::string::npos);
  CHECK(error_of("streaming-diloco:h").find("'h' is not key=value") != std::string::npos);

  const auto job = test::job_of("streaming_diloco",
                                "inner_steps = 30\nfragments = 3\ndelay = 2\nalpha = 0\n"
                                "eager = true\nouter_compression = \"bytegrad\"\n");
  auto j = std::get<StreamingDiLoCo>(job.algorithm);
  CHECK(j.inner_steps == 30);
  CHECK(j.fragments == 3);
  CHECK(j.delay == 2);
  CHECK(j.fragment_update_alpha == 0);
  CHECK(j.eager);
  CHECK(std::holds_alternative<comm::ByteGrad>(j.outer_compression));
  CHECK(job_algorithm_name(job.algorithm) == "streaming_diloco");
  CHECK(!tolerates_dead_ranks(job.algorithm));
  auto job_error = [](const std::string& settings) {
    return test::job_error("streaming_diloco", settings);
  };
  CHECK(job_error("fragment = 2\n").find("unknown key algorithm.fragment") != std::string::npos);
  CHECK(job_error("delay = 30\n")
            .find("algorithm.delay = 30: expected an integer in [0, "
                  "inner_steps / fragments = 12]") != std::string::npos);
  CHECK(job_error("inner_steps = 2\n")
            .find("algorithm.inner_steps = 2: expected an integer >= "
                  "fragments (4)") != std::string::npos);
  CHECK(job_error("alpha = 1.5\n").find("algorithm.alpha = 1.5") != std::string::npos);
  CHECK(job_error("eager = 1\n").find("algorithm.eager = 1: expected true or false") !=
        std::string::npos);
}

TEST_CASE("make_data_parallel runs Streaming DiLoCo") {
  StreamingDiLoCo c;
  c.inner_steps = 2;
  c.fragments = 2;
  c.delay = 0;
  c.fragment_update_alpha = 0;
  c.outer_compression = comm::ByteGrad{};
  test::run_two_steps(c, [](Runtime& rt, torch::nn::Sequential& net, DataParallel& dp) {
    CHECK(dp.algorithm_name() ==
          "streaming_diloco(h=2, fragments=2, delay=0, alpha=0, outer_lr=0.7, "
          "outer_momentum=0.9, bytegrad)");
    // Fragment 1 synced after step 2, alpha 0: every rank holds its global copy. Fragment 0,
    // synced after step 1, has taken a local step since, on each rank's own batch.
    auto* streaming = dynamic_cast<StreamingDiLoCoModule*>(&dp);
    REQUIRE(streaming);
    const auto cuts = streaming->fragments();
    REQUIRE(cuts.size() == 2);
    const auto mine = flat_of(*net), theirs = test::rank0_copy(rt, mine);
    auto part = [&](const torch::Tensor& t, size_t f) {
      return t.narrow(0, static_cast<int64_t>(cuts[f].first),
                      static_cast<int64_t>(cuts[f].second - cuts[f].first));
    };
    CHECK(torch::equal(part(mine, 1), part(theirs, 1)));
    if (rt.rank() == 1) CHECK(!torch::equal(part(mine, 0), part(theirs, 0)));
    CHECK(dp.stats().bytes_sent > 0);
    CHECK(dp.stats().peak_sync_bytes_sent > 0);
  });
}
