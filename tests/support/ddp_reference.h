#pragma once
// Test support: DistributedModule over N thread ranks, each on its shard of the batch, against
// one process trained on the whole batch (tests/runtime/distributed_module_test.cpp and the tests
// of the conventions users bring, such as gradients set to none).
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

namespace troupe::test {

/// Three linear layers; `extra_head` adds a layer that forward() never uses (unused parameters).
struct Mlp : torch::nn::Module {
  Mlp(int64_t in, int64_t hidden, int64_t out, bool extra_head = false) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, out));
    if (extra_head) unused = register_module("unused", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, unused{nullptr};
};

inline void copy_params(const std::shared_ptr<Mlp>& from, const std::shared_ptr<Mlp>& to) {
  torch::NoGradGuard no_grad;
  auto a = from->parameters(), b = to->parameters();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

enum class Optim { sgd_momentum, adam };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind,
                                                               const std::shared_ptr<Mlp>& m) {
  if (kind == Optim::adam)
    return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(m->parameters(),
                                             torch::optim::SGDOptions(0.1).momentum(0.9));
}

struct Case {
  std::string name;
  DdpOptions options;
  Optim optim = Optim::sgd_momentum;
  double denominator = 0;  // 0: default (world size)
  double loss_scale = 1;   // what the reference multiplies its loss by to match
  Algorithm algorithm = GradientAllReduce{};
  std::vector<std::string> hosts;  // pretend hosts of the ranks (empty: all on this one)
  /// Each step zeroes the gradients by setting them to none (Module::zero_grad(true), what
  /// LibTorch >= 2.0's Optimizer::zero_grad() does) instead of the optimizer's zero_grad().
  bool set_to_none = false;
  /// Each rank's batch in this many micro-batches, all but the last backward inside no_sync().
  int micro_batches = 1;
  /// The models have an unused extra head (find_unused_parameters).
  bool extra_head = false;
  /// What every rank's gradient_path() must say ("": not checked).
  std::string path;
  /// The models' hidden width (fc2 holds hidden * hidden weights).
  int64_t hidden = 8;
  /// Called on each rank after each step (rank, step, its module).
  std::function<void(int, int, const DistributedModule&)> after_step;
};

/// A run of the equivalence tests: `world` replicas (rank 0's weights are everyone's after the
/// broadcast), each step's batch of world * batch rows (rank r takes rows [r batch, (r+1) batch)),
/// and the reference: one process that trained on the whole batches with the case's optimizer.
struct Job {
  int world = 0;
  int64_t batch = 4;
  std::vector<std::shared_ptr<Mlp>> replicas;
  std::shared_ptr<Mlp> reference;
  std::vector<torch::Tensor> xs, ys;
  torch::Tensor x(int s, int r) const { return xs[s].narrow(0, r * batch, batch); }
  torch::Tensor y(int s, int r) const { return ys[s].narrow(0, r * batch, batch); }
};

inline Job make_job(const Case& c, int world, int steps) {
  torch::manual_seed(7);
  Job job;
  job.world = world;
  for (int r = 0; r < world; ++r)
    job.replicas.push_back(std::make_shared<Mlp>(6, c.hidden, 3, c.extra_head));
  job.reference = std::make_shared<Mlp>(6, c.hidden, 3, c.extra_head);
  copy_params(job.replicas[0], job.reference);
  for (int s = 0; s < steps; ++s) {
    job.xs.push_back(torch::randn({world * job.batch, 6}));
    job.ys.push_back(torch::randn({world * job.batch, 3}));
  }
  auto ref_opt = make_optimizer(c.optim, job.reference);
  for (int s = 0; s < steps; ++s) {
    ref_opt->zero_grad();
    auto loss = torch::mse_loss(job.reference->forward(job.xs[s]), job.ys[s]) * c.loss_scale;
    loss.backward();
    ref_opt->step();
  }
  return job;
}

/// The largest element-wise difference between the parameters of two models.
inline double parameter_difference(Mlp& a, Mlp& b) {
  double worst = 0;
  auto mine = a.parameters(), want = b.parameters();
  for (size_t i = 0; i < mine.size(); ++i)
    worst = std::max(worst, (mine[i] - want[i]).abs().max().item<double>());
  return worst;
}

/// K steps on `world` ranks, each on its slice of the batch, against one process on the whole
/// batch. Returns the largest parameter difference over ranks.
inline double max_difference(const Case& c, int world, int steps = 3) {
  const Job job = make_job(c, world, steps);
  std::vector<double> diffs(static_cast<size_t>(world), 1e9);
  auto errors = run_threads(
      world,
      [&](int r, Runtime& rt) {
        auto model = job.replicas[static_cast<size_t>(r)];
        auto opt = make_optimizer(c.optim, model);
        DistributedModule ddp(rt, model, c.algorithm, c.options);
        if (!c.path.empty()) CHECK(ddp.gradient_path() == c.path);
        const int64_t micro = job.batch / c.micro_batches;
        for (int s = 0; s < steps; ++s) {
          if (c.set_to_none)
            model->zero_grad(/*set_to_none=*/true);
          else
            opt->zero_grad();
          if (c.denominator > 0) ddp.set_denominator(c.denominator);
          for (int k = 0; k < c.micro_batches; ++k) {
            auto x = job.x(s, r).narrow(0, k * micro, micro),
                 y = job.y(s, r).narrow(0, k * micro, micro);
            auto loss = torch::mse_loss(model->forward(x), y) / c.micro_batches;
            if (k + 1 < c.micro_batches) {
              auto guard = ddp.no_sync();
              loss.backward();
            } else {
              loss.backward();
            }
          }
          ddp.step(*opt);
          if (c.after_step) c.after_step(r, s, ddp);
        }
        diffs[static_cast<size_t>(r)] = parameter_difference(*model, *job.reference);
      },
      c.hosts);
  for (auto& e : errors) CHECK(e == "");
  return *std::max_element(diffs.begin(), diffs.end());
}

}  // namespace troupe::test
