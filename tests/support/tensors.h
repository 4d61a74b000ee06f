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

/// The inputs and targets of a multi-rank test run: step s holds world * batch rows, rank r's are
/// rows [r * batch, (r + 1) * batch) (a single process trains on all of them at once).
struct StepData {
  std::vector<torch::Tensor> xs, ys;
  int64_t batch = 0;
  torch::Tensor x(int s, int r) const { return xs[s].narrow(0, r * batch, batch); }
  torch::Tensor y(int s, int r) const { return ys[s].narrow(0, r * batch, batch); }
};

/// `steps` steps of normal inputs [world * batch, in] and targets [world * batch, out]; with
/// `shrinking`, step s's inputs are scaled by (steps - s), so gradients shrink over time.
inline StepData make_step_data(int world, int steps, int64_t batch, int64_t in, int64_t out,
                               bool shrinking = false) {
  StepData d;
  d.batch = batch;
  for (int s = 0; s < steps; ++s) {
    auto x = torch::randn({world * batch, in});
    d.xs.push_back(shrinking ? x * (steps - s) : x);
    d.ys.push_back(torch::randn({world * batch, out}));
  }
  return d;
}

}  // namespace troupe::test
