#pragma once
// Test support: comparing and copying the parameters of models in the torch tests.
#include <algorithm>
#include <vector>

#include "tests/support/torch_doctest.h"

namespace troupe::test {

/// to's parameters := from's (same architecture).
inline void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto a = from.parameters(), b = to.parameters();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

/// The largest element-wise difference between two lists of tensors (compared in float32, so
/// half-precision tensors compare with float32 ones).
inline double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst,
                     (a[i].to(torch::kFloat) - b[i].to(torch::kFloat)).abs().max().item<double>());
  return worst;
}

/// Detached copies.
inline std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

}  // namespace troupe::test
