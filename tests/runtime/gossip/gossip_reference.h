#pragma once
// Test support for the gossip algorithms: a small model, each rank's batches, thread ranks that
// train it with an algorithm on a device, and single-process simulations of D-PSGD and Choco-SGD
// written from their definitions (x := W x and the 8-bit public copies) on the CPU, which the
// ranks' weights must match wherever they were computed.
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithms/gossip/decentralized.h"
#include "comm/codecs/minmax.h"
#include "comm/gossip/topology.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/flat_params.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

namespace troupe::test::gossip {

using test::flat_of;  // flat_params.h's, for the tests that name this namespace only
using test::load_flat;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

inline void check_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r)
    CHECK_MESSAGE(errors[r].empty(), "rank ", r, ": ", errors[r]);
}

/// Rank r's batch of step s (the same in the ranks and in the reference), on the CPU.
inline std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  auto g = torch::make_generator<torch::CPUGeneratorImpl>(1000 + 37 * rank + step);
  auto x = torch::randn({4, 5}, g);
  auto y = torch::randn({4, 3}, g);
  return {x, y};
}

/// The gradient of rank r's loss at weights x (a flat vector), on a scratch model.
inline torch::Tensor gradient_at(const torch::Tensor& x, int rank, int step) {
  auto net = std::make_shared<Net>();
  load_flat(*net, x);
  auto [in, target] = batch(rank, step);
  torch::mse_loss(net->forward(in), target).backward();
  std::vector<torch::Tensor> parts;
  for (auto& p : net->parameters()) parts.push_back(p.grad().reshape({-1}));
  return torch::cat(parts);
}

inline torch::Tensor initial_weights() {
  torch::manual_seed(7);
  Net net;
  return flat_of(net);
}

/// Runs `world` thread ranks of one in-process job (RuntimeOptions::nccl as given), each training
/// `steps` steps of plain SGD on its batches with the module `make` returns, on device_of(rank).
/// Returns each rank's final flat weights (on the CPU); `paths` gets each rank's gossip_path().
inline std::vector<torch::Tensor> train_ranks(
    int world, int steps, double lr,
    const std::function<std::unique_ptr<DecentralizedModule>(Runtime&, std::shared_ptr<Net>)>& make,
    const std::function<torch::Device(int)>& device_of = [](int) { return torch::kCPU; },
    bool nccl = true, std::vector<std::string>* paths = nullptr) {
  std::vector<torch::Tensor> finals(static_cast<size_t>(world));
  std::vector<std::string> got_paths(static_cast<size_t>(world));
  std::mutex mutex;
  const auto init = initial_weights();  // here: the ranks' threads also draw from torch's RNG
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < world; ++r) {
    options.push_back(thread_rank(r, world, port, fabric));
    options.back().nccl = nccl;
  }
  auto errors = run_ranks(options, [&](int rank, Runtime& rt) {
    const torch::Device device = device_of(rank);
    auto net = std::make_shared<Net>();
    if (rank == 0) load_flat(*net, init);  // the others get rank 0's at construction
    net->to(device);
    auto dp = make(rt, net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      torch::mse_loss(net->forward(x.to(device)), y.to(device)).backward();
      dp->step(opt);
    }
    dp->finish();
    std::lock_guard<std::mutex> lock(mutex);
    finals[static_cast<size_t>(rank)] = flat_of(*net);
    got_paths[static_cast<size_t>(rank)] = dp->gossip_path();
  });
  check_no_errors(errors);
  if (paths) *paths = got_paths;
  return finals;
}

inline torch::Tensor matrix(const std::vector<std::vector<double>>& w) {
  const int64_t n = static_cast<int64_t>(w.size());
  auto m = torch::zeros({n, n}, torch::kFloat64);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) m[i][j] = w[static_cast<size_t>(i)][static_cast<size_t>(j)];
  return m.to(torch::kFloat32);
}

inline comm::TopologySpec ring() {
  comm::TopologySpec t;
  t.kind = comm::TopologyKind::ring;
  return t;
}

/// SGD on the average of the ranks' gradients (an allreduce of gradients) simulated in one
/// process: the weights, the same on every rank, after `steps` steps.
inline torch::Tensor allreduce_sgd_reference(int world, int steps, double lr) {
  auto x = initial_weights();
  for (int s = 0; s < steps; ++s) {
    auto g = torch::zeros_like(x);
    for (int r = 0; r < world; ++r) g = g + gradient_at(x, r, s);
    x = x - lr * g / world;
  }
  return x;
}

/// D-PSGD simulated in one process: every rank's weights after `steps` steps.
inline std::vector<torch::Tensor> dpsgd_reference(const Decentralized& algo, int world, int steps,
                                                  double lr) {
  comm::Topology topology(algo.topology, world);
  std::vector<torch::Tensor> x(static_cast<size_t>(world), initial_weights());
  uint64_t round = 0;
  auto stack = [](const std::vector<torch::Tensor>& v) { return torch::stack(v); };
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (int r = 0; r < world; ++r) g.push_back(gradient_at(x[static_cast<size_t>(r)], r, s));
    const bool mixes = s % algo.communication_interval == 0;
    auto w = mixes ? matrix(topology.mixing_matrix(round++)) : torch::eye(world);
    torch::Tensor next;
    if (algo.exchange == Decentralized::Exchange::overlap) {
      next = torch::matmul(w, stack(x)) - lr * stack(g);
    } else {
      next = torch::matmul(w, stack(x) - lr * stack(g));
    }
    for (int r = 0; r < world; ++r) x[static_cast<size_t>(r)] = next[r].clone();
  }
  return x;
}

/// Choco-SGD (low-precision decentralized SGD, 8-bit differences) simulated in one process, from
/// initial_weights(); the public copies start at `public_copies` (default: the same weights).
inline std::vector<torch::Tensor> choco_reference(const LowPrecisionDecentralized& algo, int world,
                                                  int steps, double lr,
                                                  torch::Tensor public_copies = {}) {
  comm::Topology topology(algo.topology, world);
  auto w = topology.mixing_matrix(0);
  if (!public_copies.defined()) public_copies = initial_weights();
  std::vector<torch::Tensor> x(static_cast<size_t>(world), initial_weights());
  std::vector<torch::Tensor> hat(static_cast<size_t>(world), public_copies);
  const size_t n = static_cast<size_t>(x[0].numel());
  const size_t block = static_cast<size_t>(algo.block);
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      auto& xr = x[static_cast<size_t>(r)];
      xr = xr - lr * gradient_at(xr, r, s);
    }
    for (int r = 0; r < world; ++r) {
      auto& hr = hat[static_cast<size_t>(r)];
      torch::Tensor diff = (x[static_cast<size_t>(r)] - hr).contiguous();
      std::vector<uint8_t> code(comm::minmax_bytes(comm::MinMaxBits::eight, n, block));
      comm::minmax_encode(comm::MinMaxBits::eight, diff.data_ptr<float>(), n, block, code.data());
      std::vector<float> q(n);
      comm::minmax_decode(comm::MinMaxBits::eight, code.data(), n, block, q.data());
      hr = hr + torch::from_blob(q.data(), {static_cast<int64_t>(n)}).clone();
    }
    std::vector<torch::Tensor> next;
    for (int i = 0; i < world; ++i) {
      auto xi = x[static_cast<size_t>(i)].clone();
      const auto& row = w[static_cast<size_t>(i)];
      for (int j = 0; j < world; ++j)
        if (j != i && row[static_cast<size_t>(j)] > 0)
          xi = xi + static_cast<float>(algo.gamma * row[static_cast<size_t>(j)]) *
                        (hat[static_cast<size_t>(j)] - hat[static_cast<size_t>(i)]);
      next.push_back(xi);
    }
    x = next;
  }
  return x;
}

}  // namespace troupe::test::gossip
