// The decentralized and asynchronous algorithms of runtime/gossip/ over thread ranks (inproc):
// one gossip round against W x; D-PSGD (overlap, adapt-then-combine, communication interval) and
// Choco-SGD against single-process simulations written here; asynchronous model averaging and
// AD-PSGD against what they must preserve (the mean, the sum); and their argument checks.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/codecs/minmax8.h"
#include "comm/gossip/exchange.h"
#include "comm/gossip/topology.h"
#include "comm/status.h"
#include "runtime/gossip/decentralized.h"
#include "runtime/launch.h"
#include "runtime/model_switch.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

using test::run_threads;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

void check_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) CHECK_MESSAGE(errors[r].empty(), "rank ", r, ": ", errors[r]);
}

// Rank r's batch of step s (the same in the ranks and in the reference).
std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  auto g = torch::make_generator<torch::CPUGeneratorImpl>(1000 + 37 * rank + step);
  auto x = torch::randn({4, 5}, g);
  auto y = torch::randn({4, 3}, g);
  return {x, y};
}

torch::Tensor flat_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts).clone();
}

void load_flat(torch::nn::Module& m, const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& p : m.parameters()) {
    p.copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
    at += p.numel();
  }
}

// The gradient of rank r's loss at weights x (a flat vector), on a scratch model.
torch::Tensor gradient_at(const torch::Tensor& x, int rank, int step) {
  auto net = std::make_shared<Net>();
  load_flat(*net, x);
  auto [in, target] = batch(rank, step);
  torch::mse_loss(net->forward(in), target).backward();
  std::vector<torch::Tensor> parts;
  for (auto& p : net->parameters()) parts.push_back(p.grad().reshape({-1}));
  return torch::cat(parts);
}

torch::Tensor initial_weights() {
  torch::manual_seed(7);
  Net net;
  return flat_of(net);
}

// Trains `steps` steps of plain SGD on every rank with `make` as the algorithm; returns each
// rank's final flat weights.
std::vector<torch::Tensor> train_ranks(
    int world, int steps, double lr,
    const std::function<std::unique_ptr<DataParallel>(Runtime&, std::shared_ptr<Net>)>& make) {
  std::vector<torch::Tensor> finals(static_cast<size_t>(world));
  std::mutex mutex;
  const auto init = initial_weights();  // here: the ranks' threads also draw from torch's RNG
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    if (rank == 0) load_flat(*net, init);  // the others get rank 0's at construction
    auto dp = make(rt, net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      torch::mse_loss(net->forward(x), y).backward();
      dp->step(opt);
    }
    dp->finish();
    std::lock_guard<std::mutex> lock(mutex);
    finals[static_cast<size_t>(rank)] = flat_of(*net);
  });
  check_no_errors(errors);
  return finals;
}

torch::Tensor matrix(const std::vector<std::vector<double>>& w) {
  const int64_t n = static_cast<int64_t>(w.size());
  auto m = torch::zeros({n, n}, torch::kFloat64);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) m[i][j] = w[static_cast<size_t>(i)][static_cast<size_t>(j)];
  return m.to(torch::kFloat32);
}

comm::TopologySpec ring() {
  comm::TopologySpec t;
  t.kind = comm::TopologyKind::ring;
  return t;
}

}  // namespace

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
    auto finals = train_ranks(world, steps, lr, [&](Runtime& rt, std::shared_ptr<Net> net) {
      return std::make_unique<DecentralizedModule>(rt, net, algo);
    });
    // Reference: rows of X are the ranks' weights.
    comm::Topology topology(algo.topology, world);
    std::vector<torch::Tensor> x(world, initial_weights());
    uint64_t round = 0;
    for (int s = 0; s < steps; ++s) {
      std::vector<torch::Tensor> g;
      for (int r = 0; r < world; ++r) g.push_back(gradient_at(x[r], r, s));
      const bool mixes = s % c.interval == 0;
      auto w = mixes ? matrix(topology.mixing_matrix(round++)) : torch::eye(world);
      auto stack = [](const std::vector<torch::Tensor>& v) { return torch::stack(v); };
      torch::Tensor next;
      if (c.exchange == Decentralized::Exchange::overlap) {
        next = torch::matmul(w, stack(x)) - lr * stack(g);
      } else {
        next = torch::matmul(w, stack(x) - lr * stack(g));
      }
      for (int r = 0; r < world; ++r) x[r] = next[r].clone();
    }
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
  comm::Topology topology(algo.topology, world);
  auto w = topology.mixing_matrix(0);
  std::vector<torch::Tensor> x(world, initial_weights()), hat(world, initial_weights());
  const size_t n = static_cast<size_t>(x[0].numel());
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) x[r] = x[r] - lr * gradient_at(x[r], r, s);
    for (int r = 0; r < world; ++r) {
      torch::Tensor diff = (x[r] - hat[r]).contiguous();
      std::vector<uint8_t> code(comm::minmax8_bytes(n, 16));
      comm::minmax8_encode(diff.data_ptr<float>(), n, 16, code.data());
      std::vector<float> q(n);
      comm::minmax8_decode(code.data(), n, 16, q.data());
      hat[r] = hat[r] + torch::from_blob(q.data(), {static_cast<int64_t>(n)}).clone();
    }
    std::vector<torch::Tensor> next;
    for (int i = 0; i < world; ++i) {
      auto xi = x[i].clone();
      for (int j = 0; j < world; ++j)
        if (j != i && w[i][j] > 0) xi = xi + static_cast<float>(algo.gamma * w[i][j]) * (hat[j] - hat[i]);
      next.push_back(xi);
    }
    x = next;
  }
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-5);
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
  });
  check_no_errors(errors);
  // Warm-up reference: SGD on the average of the ranks' gradients.
  auto x = initial_weights();
  for (int s = 0; s < 2; ++s) {
    auto g = torch::zeros_like(x);
    for (int r = 0; r < world; ++r) g = g + gradient_at(x, r, s);
    x = x - 0.1 * g / world;
  }
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((after_warmup[r] - x).abs().max().item<double>() < 1e-5);
    CHECK((after_finish[r] - 2.0).abs().max().item<double>() < 1e-6);   // mean of 1, 2, 3
    CHECK((after_resume[r] - 3.0).abs().max().item<double>() < 1e-6);   // mean of 0, 3, 6
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
