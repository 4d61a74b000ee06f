#pragma once
// Test support: a model's parameters as one flat tensor and back, for the tests that compare
// ranks' models with a simulation over flat vectors (the gossip and local-update algorithms').
// Torch only (no doctest), so it may be included in either order with doctest.
#include <torch/torch.h>

#include <vector>

namespace troupe::test {

/// Every parameter of `m`, in order, as one flat float tensor on the CPU (a copy).
inline torch::Tensor flat_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().to(torch::kCPU).reshape({-1}));
  return torch::cat(parts);
}

/// The parameters of `m` (on any device) set from a flat tensor laid out as flat_of's.
inline void load_flat(torch::nn::Module& m, const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& p : m.parameters()) {
    p.copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
    at += p.numel();
  }
}

}  // namespace troupe::test
