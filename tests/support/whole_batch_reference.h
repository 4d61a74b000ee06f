#pragma once
// Test support for the rank programs (tests/runtime/rank_main.cpp, netbed_rank.cpp): a few steps
// of a DistributedModule, each rank on its shard of a batch, beside one model trained on the
// whole batch that every rank computes too on the CPU. The parameters must end the same.
#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "ddp/distributed_module.h"
#include "rank/runtime.h"

namespace troupe::test {

struct WholeBatchRun {
  /// The largest difference of a parameter from the whole-batch model's.
  double largest_difference = 0;
  /// The DistributedModule's gradient_path().
  std::string gradient_path;
};

/// Linear(in, hidden), Tanh, Linear(hidden, out), SGD(0.1, momentum 0.9), MSE on random batches
/// of 8 rows per rank, `steps` steps; `seed` gives every rank the same weights and batches. The
/// distributed model lives on `device`; the reference on the CPU.
inline WholeBatchRun train_against_whole_batch(Runtime& rt, const DdpOptions& options, int64_t in,
                                               int64_t hidden, int64_t out, int steps,
                                               uint64_t seed, torch::Device device = torch::kCPU) {
  const int64_t world = rt.world_size(), rank = rt.rank(), batch = 8;
  torch::manual_seed(seed);
  auto make = [&] {
    return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(),
                                 torch::nn::Linear(hidden, out));
  };
  auto reference = make();
  auto model = make();
  {
    torch::NoGradGuard no_grad;
    auto from = reference->parameters(), to = model->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  model->to(device);
  DistributedModule net(rt, model.ptr(), GradientAllReduce{}, options);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn({world * batch, in});
    auto y = torch::randn({world * batch, out});
    opt.zero_grad();
    torch::mse_loss(model->forward(x.narrow(0, rank * batch, batch).to(device)),
                    y.narrow(0, rank * batch, batch).to(device))
        .backward();
    net.step(opt);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_opt.step();
  }
  WholeBatchRun run;
  auto got = model->parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    run.largest_difference =
        std::max(run.largest_difference,
                 (got[i].detach().to(torch::kCPU) - want[i]).abs().max().item<double>());
  run.gradient_path = net.gradient_path();
  return run;
}

}  // namespace troupe::test
