// The decentralized and asynchronous algorithms of algorithms/gossip/ over thread ranks (inproc):
// one gossip round against W x; D-PSGD (overlap, adapt-then-combine, communication interval) and
// Choco-SGD against single-process simulations (gossip_reference.h); asynchronous model averaging
// and AD-PSGD against what they must preserve (the mean, the sum); and their argument checks.
// gossip_cuda_test.cpp runs the same algorithms on CUDA parameters.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/model_switch.h"
#include "comm/gossip/exchange.h"
#include "comm/status.h"
#include "elastic/launch.h"
#include "tests/runtime/gossip/gossip_reference.h"

using namespace troupe;
using namespace troupe::test::gossip;
using test::run_threads;

TEST_CASE("one gossip round of NeighborExchange and mix computes W x") {
  for (auto kind : {comm::TopologyKind::ring, comm::TopologyKind::exponential,
                    comm::TopologyKind::random_matching}) {
    CAPTURE(comm::topology_kind_name(kind));
    const int world = 6;
    comm::TopologySpec spec;
    spec.kind = kind;
    spec.seed = 3;
    comm::Topology topology(spec, world);
    const uint64_t round = 1;
    std::vector<std::vector<float>> result(world);
    auto errors = run_threads(world, [&](int rank, Runtime& rt) {
      std::vector<float> x(9);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rank * 10 + i);
      auto peers = topology.round(rank, round);
      std::vector<std::vector<float>> in(peers.recv_from.size(), std::vector<float>(x.size()));
      std::vector<void*> targets;
      for (auto& b : in) targets.push_back(b.data());
      auto ex = comm::NeighborExchange::start(rt.transport(), comm::Tag{1} << 45, x.data(),
                                              x.size() * sizeof(float), peers.send_to,
                                              peers.recv_from, targets);
      auto outcome = ex->wait(std::chrono::steady_clock::now() + std::chrono::seconds(20), "test");
      REQUIRE(outcome.failed.empty());
      REQUIRE(outcome.received == peers.recv_from);
      std::vector<const float*> others;
      for (auto& b : in) others.push_back(b.data());
      std::vector<float> out(x.size());
      comm::mix(out.data(), x.data(), peers.self_weight, others, peers.recv_weights, x.size());
      result[static_cast<size_t>(rank)] = out;
    });
    check_no_errors(errors);
    auto w = topology.mixing_matrix(round);
    for (int i = 0; i < world; ++i)
      for (size_t k = 0; k < 9; ++k) {
        double expected = 0;
        for (int j = 0; j < world; ++j) expected += w[i][j] * (j * 10 + static_cast<double>(k));
        CHECK(result[i][k] == doctest::Approx(expected).epsilon(1e-6));
      }
  }
}

TEST_CASE("D-PSGD equals a single-process simulation: overlap, adapt-then-combine, interval") {
  const int world = 4, steps = 5;
  const double lr = 0.1;
  struct Case {
    Decentralized::Exchange exchange;
    int interval;
    comm::TopologyKind kind;
  };
  for (auto c : {Case{Decentralized::Exchange::overlap, 1, comm::TopologyKind::ring},
                 Case{Decentralized::Exchange::after_step, 1, comm::TopologyKind::ring},
                 Case{Decentralized::Exchange::overlap, 2, comm::TopologyKind::ring},
                 Case{Decentralized::Exchange::after_step, 1, comm::TopologyKind::exponential}}) {
    CAPTURE(static_cast<int>(c.exchange));
    CAPTURE(c.interval);
    Decentralized algo;
    algo.topology.kind = c.kind;
    algo.topology.mixing = comm::Mixing::metropolis;
    algo.exchange = c.exchange;
    algo.communication_interval = c.interval;
    std::vector<std::string> paths;
    auto finals = train_ranks(
        world, steps, lr,
        [&](Runtime& rt, std::shared_ptr<Net> net) {
          return std::make_unique<DecentralizedModule>(rt, net, algo);
        },
        [](int) { return torch::kCPU; }, true, &paths);
    for (const auto& path : paths) CHECK(path == "cpu");
    const auto x = dpsgd_reference(algo, world, steps, lr);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-5);
    }
    // The ranks disagree (it is not allreduce) but stay close.
    CHECK((finals[0] - finals[2]).abs().max().item<double>() > 1e-6);
  }
}

TEST_CASE("low-precision decentralized SGD equals a Choco-SGD simulation with 8-bit differences") {
  const int world = 4, steps = 4;
  const double lr = 0.1;
  LowPrecisionDecentralized algo;
  algo.topology = ring();
  algo.gamma = 0.5;
  algo.block = 16;
  auto finals = train_ranks(world, steps, lr, [&](Runtime& rt, std::shared_ptr<Net> net) {
    return std::make_unique<DecentralizedModule>(rt, net, algo);
  });
  const auto x = choco_reference(algo, world, steps, lr);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-5);
  }
}

TEST_CASE(
    "low-precision decentralized SGD whose ranks keep their own weights starts every "
    "public copy at zero") {
  // broadcast_parameters off (what an elastic re-form builds): a copy must be the same on both
  // ends of an edge whatever the ranks' weights, so every copy starts at zero, not at each rank's
  // own weights. Here every rank loads the same weights, so the two starts are told apart by the
  // trajectory alone.
  const int world = 4, steps = 4;
  const double lr = 0.1;
  LowPrecisionDecentralized algo;
  algo.topology = ring();
  algo.gamma = 0.5;
  algo.block = 16;
  const auto init = initial_weights();
  GossipOptions own;
  own.broadcast_parameters = false;
  auto finals = train_ranks(world, steps, lr, [&](Runtime& rt, std::shared_ptr<Net> net) {
    load_flat(*net, init);
    return std::make_unique<DecentralizedModule>(rt, net, algo, own);
  });
  const auto from_zero = choco_reference(algo, world, steps, lr, torch::zeros_like(init));
  const auto from_weights = choco_reference(algo, world, steps, lr);
  // The two starts part by 10x the tolerance below.
  CHECK((from_zero[0] - from_weights[0]).abs().max().item<double>() > 1e-4);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((finals[r] - from_zero[r]).abs().max().item<double>() < 1e-5);
  }
}

TEST_CASE("asynchronous model average: warm-up allreduces gradients, the stop round averages") {
  const int world = 3;
  std::vector<torch::Tensor> after_warmup(world), after_finish(world), after_resume(world);
  const auto init = initial_weights();
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    if (rank == 0) load_flat(*net, init);
    AsyncModelAverage algo;
    algo.warmup_steps = 2;
    algo.sync_interval_ms = 60000;  // no timer round in this test: only the stop rounds
    AsynchronousModule dp(rt, net, algo);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      torch::mse_loss(net->forward(x), y).backward();
      dp.step(opt);
    }
    after_warmup[rank] = flat_of(*net);
    // Now asynchronous: set rank-dependent weights; the stop round must average them.
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.fill_(static_cast<float>(rank + 1));
    }
    dp.abort();
    after_finish[rank] = flat_of(*net);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.fill_(static_cast<float>(3 * rank));
    }
    dp.resume();
    dp.finish();
    after_resume[rank] = flat_of(*net);
    CHECK(dp.stats().background_rounds == 2);
    CHECK(dp.gossip_path() == "cpu");
  });
  check_no_errors(errors);
  const auto x = allreduce_sgd_reference(world, 2, 0.1);  // the warm-up's
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((after_warmup[r] - x).abs().max().item<double>() < 1e-5);
    CHECK((after_finish[r] - 2.0).abs().max().item<double>() < 1e-6);  // mean of 1, 2, 3
    CHECK((after_resume[r] - 3.0).abs().max().item<double>() < 1e-6);  // mean of 0, 3, 6
  }
}

TEST_CASE("asynchronous gossip keeps the sum of the models and shrinks their distance") {
  const int world = 4;
  std::vector<torch::Tensor> finals(world);
  std::vector<uint64_t> exchanges(world);
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.fill_(static_cast<float>(4 * rank));
    }
    AsyncGossip algo;
    algo.topology = ring();
    algo.min_interval_ms = 1;
    GossipOptions options;
    options.broadcast_parameters = false;  // every rank starts from its own weights
    AsynchronousModule dp(rt, net, algo, options);
    // Gossip runs in the background; wait (with a deadline) until this rank took part in enough
    // exchanges.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (dp.stats().background_rounds < 30 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    rt.comm().barrier();  // no rank stops (says bye) before every rank has had its exchanges
    dp.finish();
    exchanges[rank] = dp.stats().background_rounds;
    finals[rank] = flat_of(*net);
  });
  check_no_errors(errors);
  auto sum = torch::zeros_like(finals[0]);
  for (auto& f : finals) sum = sum + f;
  // Initial sum: 0 + 4 + 8 + 12 = 24 in every coordinate.
  CHECK((sum - 24.0).abs().max().item<double>() < 1e-3);
  double spread = 0;
  for (auto& f : finals) spread = std::max(spread, (f - 6.0).abs().max().item<double>());
  CHECK(spread < 6.0 * 0.5);  // started 6 away from the mean at the extremes
  for (int r = 0; r < world; ++r) CHECK(exchanges[r] >= 30);
}

TEST_CASE("decentralized algorithms reject bad settings with clear errors") {
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    auto net = std::make_shared<Net>();
    Decentralized d;
    d.communication_interval = 0;
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, net, d),
                         doctest::Contains("communication_interval = 0"), comm::Error);
    LowPrecisionDecentralized l;
    l.gamma = 1.5;
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, net, l), doctest::Contains("gamma = 1.5"),
                         comm::Error);
    l.gamma = 0.5;
    l.topology.kind = comm::TopologyKind::exponential;
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, net, l),
                         doctest::Contains("static undirected topology"), comm::Error);
    AsyncModelAverage a;
    a.sync_interval_ms = 0;
    CHECK_THROWS_WITH_AS(AsynchronousModule(rt, net, a), doctest::Contains("sync_interval_ms = 0"),
                         comm::Error);
    auto half = std::make_shared<Net>();
    half->to(torch::kFloat64);
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, half, Decentralized{}),
                         doctest::Contains("expected float32"), comm::Error);
    // A parameter on a device that is neither the CPU nor CUDA (alone, or after CPU ones).
    struct OnMeta : torch::nn::Module {
      explicit OnMeta(bool cpu_first) {
        if (cpu_first) register_parameter("cpu_weight", torch::zeros({3}));
        register_parameter("meta_weight", torch::empty({2}, torch::kMeta));
      }
    };
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, std::make_shared<OnMeta>(false), Decentralized{}),
                         doctest::Contains("decentralized: parameter meta_weight is on meta, "
                                           "expected the CPU or a CUDA device"),
                         comm::Error);
    CHECK_THROWS_WITH_AS(
        AsynchronousModule(rt, std::make_shared<OnMeta>(true), AsyncModelAverage{}),
        doctest::Contains("parameter meta_weight is on meta, expected the CPU or a CUDA device"),
        comm::Error);
  });
  check_no_errors(errors);
}

TEST_CASE("decentralized SGD refuses a mixing matrix that is not doubly stochastic") {
  auto errors = run_threads(3, [&](int, Runtime& rt) {
    auto net = std::make_shared<Net>();
    Decentralized d;
    d.topology.kind = comm::TopologyKind::edge_list;
    d.topology.edges = {{0, 1}, {1, 2}};  // a path: irregular
    d.topology.mixing = comm::Mixing::uniform;
    CHECK_THROWS_WITH_AS(DecentralizedModule(rt, net, d), doctest::Contains("metropolis"),
                         comm::Error);
  });
  check_no_errors(errors);
}

TEST_CASE("ModelSwitch runs allreduce, then decentralized SGD, then allreduce, like a simulation") {
  const int world = 4, phase = 3;  // a ring of 4 (of 3 it would be the complete graph)
  const double lr = 0.1;
  Decentralized dpsgd;
  dpsgd.topology = ring();
  dpsgd.exchange = Decentralized::Exchange::after_step;
  std::vector<torch::Tensor> finals(world), after_phase2(world);
  std::vector<std::string> names(world);
  std::mutex mutex;
  const auto init = initial_weights();
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    if (rank == 0) load_flat(*net, init);
    ModelSwitch dp(rt, net, comm::GradientAllReduce{});
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
    int s = 0;
    auto train = [&] {
      for (int i = 0; i < phase; ++i, ++s) {
        opt.zero_grad();
        auto [x, y] = batch(rank, s);
        torch::mse_loss(net->forward(x), y).backward();
        dp.step(opt);
      }
    };
    train();
    dp.switch_to(dpsgd);
    const std::string middle = dp.algorithm_name();
    train();
    auto before_switch = flat_of(*net);
    dp.switch_to(comm::GradientAllReduce{});
    train();
    dp.finish();
    std::lock_guard<std::mutex> lock(mutex);
    finals[rank] = flat_of(*net);
    after_phase2[rank] = before_switch;
    names[rank] = middle;
    CHECK(dp.switches() == 2);
    CHECK(dp.stats().steps == 3 * phase);
  });
  check_no_errors(errors);
  CHECK(names[0].find("decentralized(ring(4") == 0);
  // Reference: rows are the ranks' weights.
  auto w = matrix(comm::Topology(dpsgd.topology, world).mixing_matrix(0));
  std::vector<torch::Tensor> x(world, init);
  int s = 0;
  auto allreduce_phase = [&] {
    for (int i = 0; i < phase; ++i, ++s) {
      auto g = torch::zeros_like(x[0]);
      for (int r = 0; r < world; ++r) g = g + gradient_at(x[r], r, s);
      for (int r = 0; r < world; ++r) x[r] = x[r] - lr * g / world;
    }
  };
  allreduce_phase();
  for (int i = 0; i < phase; ++i, ++s) {
    std::vector<torch::Tensor> half;
    for (int r = 0; r < world; ++r) half.push_back(x[r] - lr * gradient_at(x[r], r, s));
    auto next = torch::matmul(w, torch::stack(half));
    for (int r = 0; r < world; ++r) x[r] = next[r].clone();
  }
  for (int r = 0; r < world; ++r) CHECK((after_phase2[r] - x[r]).abs().max().item<double>() < 1e-5);
  auto mean = torch::stack(x).mean(0);  // the switch averages the weights
  for (int r = 0; r < world; ++r) x[r] = mean.clone();
  allreduce_phase();
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-5);
  }
  CHECK((after_phase2[0] - after_phase2[1]).abs().max().item<double>() > 1e-6);  // phase 2 differed
}
