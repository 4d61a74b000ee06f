// troupe_elastic_rank: one rank of an elastic test job, started by
// tests/runtime/elastic_processes_test.cpp through `troupe launch --elastic`, with faults from
// TROUPE_FAULT. It trains a small MLP for argv[1] steps on synthetic data with an
// ElasticTrainer (and on, while the world is smaller than argv[2], so that a restarted rank
// rejoins before the end; at most kMaxSteps), then checks that every member holds the same parameters (bit for bit) and that
// they match one process trained on the same global batches (the global batch divides evenly by
// every world size the tests reach, so the average of the ranks' means is the batch mean).
// Exit: 0 held, 2 replicas differ, 3 off the reference, 1 an error (printed).
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#include "runtime/elastic.h"
#include "runtime/runtime.h"

using namespace troupe;

namespace {

constexpr int64_t kSamples = 480;
constexpr int64_t kGlobalBatch = 24;  // divides by 1, 2, 3, 4
constexpr uint64_t kSeed = 7;
constexpr int64_t kMaxSteps = 20000;

struct Data {
  torch::Tensor x, y;
};

Data make_data() {
  torch::manual_seed(1234);
  Data d;
  d.x = torch::randn({kSamples, 16});
  d.y = torch::randint(0, 4, {kSamples});
  return d;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(99);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts);
}

torch::Tensor as_index(const std::vector<int64_t>& v) {
  return torch::tensor(std::vector<int64_t>(v.begin(), v.end()), torch::kLong);
}

torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// One process on the whole global batches: the reference trajectory.
torch::Tensor reference(const Data& d, int64_t steps) {
  auto net = make_model();
  auto opt = make_sgd(*net);
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  for (int64_t s = 0; s < steps; ++s) {
    auto idx = as_index(sampler.indices(s, 0, 1));
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}))
        .backward();
    opt.step();
  }
  return flat(*net);
}

long long unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 40;
  const int until_world = argc > 2 ? std::atoi(argv[2]) : 0;
  try {
    RuntimeOptions o;
    o.scheduler_threads = 1;
    o.rendezvous_timeout = std::chrono::seconds(20);
    o.collective_timeout = std::chrono::seconds(20);
    Runtime rt(o);
    const Data d = make_data();
    auto net = make_model();
    auto opt = make_sgd(*net);
    DdpOptions ddp;
    ddp.stall_timeout = std::chrono::seconds(20);
    ElasticTrainer trainer(rt, net.ptr(), opt, GradientAllReduce{}, ddp);
    if (rt.generation().number > 1 || !trainer.recoveries().empty())
      std::cout << "slot " << rt.slot() << " healed, stepping from step " << trainer.steps()
                << " at unix ms " << unix_ms() << std::endl;
    ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
    bool after_change = false;
    while (trainer.steps() < steps ||
           (rt.world_size() < until_world && trainer.steps() < kMaxSteps)) {
      auto idx = as_index(sampler.indices(trainer.steps(), rt.rank(), rt.world_size()));
      const bool done = trainer.step([&] {
        opt.zero_grad();
        torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}))
            .backward();
      });
      if (!done) after_change = true;
      if (done && after_change) {
        std::cout << "slot " << rt.slot() << " stepping again in generation "
                  << rt.generation().number << " at unix ms " << unix_ms() << std::endl;
        after_change = false;
      }
    }
    // Bit-identical replicas: rank 0's parameters against each member's.
    auto mine = flat(*net);
    auto theirs = mine.clone();
    rt.comm().broadcast(theirs.data_ptr(), static_cast<size_t>(theirs.numel()),
                        comm::DataType::float32, 0);
    const bool same = torch::equal(mine, theirs);
    const double off = (mine - reference(d, trainer.steps())).abs().max().item<double>();
    std::cout << "slot " << rt.slot() << " finished " << trainer.steps() << " steps as rank "
              << rt.rank() << " of " << rt.world_size() << " in generation "
              << rt.generation().number << " after " << trainer.recoveries().size()
              << " recoveries; replicas " << (same ? "identical" : "DIFFER")
              << "; max |param - reference| = " << off << std::endl;
    for (auto& r : trainer.recoveries())
      std::cout << "slot " << rt.slot() << " recovery: generation " << r.generation << ", world "
                << r.world_size << ", from step " << r.step << ", " << r.seconds << " s"
                << std::endl;
    if (!same) return 2;
    if (!(off < 1e-4)) return 3;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "elastic rank: " << e.what() << std::endl;
    return 1;
  }
}
