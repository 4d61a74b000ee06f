#pragma once
// Test support for the local-update algorithms' tests (tests/runtime/local_update/): a small net,
// its parameters as one flat tensor, the inner optimizers, and each rank's batches, so a test can
// run the module on thread ranks and a simulation of W replicas from the same start.
#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

namespace troupe::test {

/// Linear(6, width), Tanh, Linear(width, 3): 83 parameters at width 8.
inline torch::nn::Sequential make_net(int width = 8) {
  return torch::nn::Sequential(torch::nn::Linear(6, width), torch::nn::Tanh(),
                               torch::nn::Linear(width, 3));
}

/// Every parameter of `m`, in order, as one flat tensor (a copy).
inline torch::Tensor flat_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts);
}

/// The parameters of `m` set from a flat tensor laid out as flat_of's.
inline void load_flat(torch::nn::Module& m, const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& p : m.parameters()) {
    p.copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
    at += p.numel();
  }
}

/// The inner optimizer: AdamW(0.01, weight decay 0.01), or SGD(0.05, momentum 0.5).
inline std::unique_ptr<torch::optim::Optimizer> make_inner(torch::nn::Module& m, bool adamw) {
  if (adamw)
    return std::make_unique<torch::optim::AdamW>(
        m.parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.01));
  return std::make_unique<torch::optim::SGD>(m.parameters(),
                                             torch::optim::SGDOptions(0.05).momentum(0.5));
}

using Batch = std::pair<torch::Tensor, torch::Tensor>;

/// Random regression batches of 4 rows, the same for a given seed: data[rank][step].
struct Batches {
  std::vector<std::vector<Batch>> data;
  Batches(int world, int steps, uint64_t seed = 17) {
    torch::manual_seed(seed);
    data.resize(static_cast<size_t>(world));
    for (auto& rank : data)
      for (int s = 0; s < steps; ++s) rank.emplace_back(torch::randn({4, 6}), torch::randn({4, 3}));
  }
  const Batch& at(int rank, int step) const {
    return data[static_cast<size_t>(rank)][static_cast<size_t>(step)];
  }
};

/// The gradients of one batch's MSE loss (the caller's module steps the optimizer).
inline void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt,
                       const Batch& batch) {
  opt.zero_grad();
  torch::mse_loss(net->forward(batch.first), batch.second).backward();
}

}  // namespace troupe::test
