#pragma once
// The elastic gossip test job, shared by the rank program (tests/runtime/elastic_gossip_rank.cpp)
// and the test that simulates it in one process (tests/runtime/elastic_gossip_processes_test.cpp):
// the data, the model and each rank's optimizer, the algorithms by the names the test passes,
// and one rank's batch of a step.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "comm/status.h"
#include "elastic/elastic.h"

namespace troupe::test::elastic_gossip {

constexpr int64_t kSamples = 480;
constexpr int64_t kGlobalBatch = 24;  // divides by 1, 2, 3, 4
constexpr uint64_t kSeed = 7;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;

struct Data {
  torch::Tensor x, y;
};

// Labels a fixed linear map gives (learnable: the loss goes down within the test's steps).
inline Data make_data() {
  torch::manual_seed(1234);
  Data d;
  d.x = torch::randn({kSamples, 16});
  d.y = torch::matmul(d.x, torch::randn({16, 4})).argmax(1);
  return d;
}

inline torch::nn::Sequential make_model() {
  torch::manual_seed(99);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

inline torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
}

inline torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts);
}

inline comm::TopologySpec ring() {
  comm::TopologySpec t;
  t.kind = comm::TopologyKind::ring;
  return t;
}

/// "dpsgd-overlap", "dpsgd-after-step" (D-PSGD on a ring), "choco" (Choco-SGD on a ring,
/// gamma 0.5, blocks of 64), "async-model-average" (every 5 ms, 5 warm-up steps) and
/// "async-gossip" (AD-PSGD on a ring, an exchange at most every 2 ms).
inline JobAlgorithm make_algorithm(const std::string& name) {
  if (name == "dpsgd-overlap" || name == "dpsgd-after-step") {
    Decentralized d;
    d.topology = ring();
    d.exchange = name == "dpsgd-overlap" ? Decentralized::Exchange::overlap
                                         : Decentralized::Exchange::after_step;
    return d;
  }
  if (name == "choco") {
    LowPrecisionDecentralized c;
    c.topology = ring();
    c.gamma = 0.5;
    c.block = 64;
    return c;
  }
  if (name == "async-model-average") {
    AsyncModelAverage a;
    a.warmup_steps = 5;
    a.sync_interval_ms = 5;
    return a;
  }
  if (name == "async-gossip") {
    AsyncGossip g;
    g.topology = ring();
    g.min_interval_ms = 2;
    return g;
  }
  throw comm::Error("elastic gossip rank: algorithm '" + name +
                    "' (expected dpsgd-overlap, dpsgd-after-step, choco, async-model-average or "
                    "async-gossip)");
}

/// Rank `rank` of `world`'s loss in step `step`, forward and backward on `net`.
inline torch::Tensor loss_and_backward(torch::nn::Sequential& net, const Data& d,
                                       ElasticSampler& sampler, int64_t step, int rank, int world) {
  const auto mine = sampler.indices(step, rank, world);
  auto idx = torch::tensor(std::vector<int64_t>(mine.begin(), mine.end()), torch::kLong);
  auto loss =
      torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}));
  loss.backward();
  return loss;
}

}  // namespace troupe::test::elastic_gossip
