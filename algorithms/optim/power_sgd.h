#pragma once
/// optim::PowerSGD: mlbench-core's PowerSGD optimizer — SGD (lr, momentum, weight decay, Nesterov)
/// whose gradients are averaged over the ranks by PowerSGD with error feedback
/// (comm/compression/algorithms.h, docs/algorithms.md). A convenience over what it is made of:
/// a DistributedModule running comm::PowerSGD on the model's buckets, and a torch::optim::SGD.
///
/// ```cpp
/// troupe::optim::PowerSGD opt(rt, net, troupe::optim::PowerSgdOptimizerOptions(0.1)
///                                          .momentum(0.9)
///                                          .algorithm({.rank = 2, .start_iter = 10}));
/// for (auto& batch : *loader) {
///   opt.zero_grad();
///   torch::nll_loss(net->forward(batch.data), batch.target).backward();  // buckets compress
///   opt.step();   // waits for the reductions, then the SGD step
/// }
/// ```
/// The constructor is the DistributedModule's: a collective that checks every rank wraps the same
/// model and broadcasts rank 0's parameters.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>

#include "ddp/distributed_module.h"

namespace torch::optim {
class SGD;
}

namespace troupe::optim {

/// Options of optim::PowerSGD (builder style). lr > 0, momentum >= 0, weight_decay >= 0, nesterov
/// needs momentum > 0; `algorithm` and `ddp` go to the DistributedModule (which checks them).
struct PowerSgdOptimizerOptions {
  PowerSgdOptimizerOptions(double lr);  // NOLINT: implicit, as torch::optim::SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(comm::PowerSGD, algorithm) = {};
  TORCH_ARG(DdpOptions, ddp) = {};
};

/// Throws comm::Error naming the first option out of range.
void validate(const PowerSgdOptimizerOptions& options);

class PowerSGD {
 public:
  PowerSGD(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
           PowerSgdOptimizerOptions options);
  ~PowerSGD();
  PowerSGD(const PowerSGD&) = delete;
  PowerSGD& operator=(const PowerSGD&) = delete;

  /// Waits for the step's PowerSGD reductions, then steps the SGD.
  void step();
  /// Zeros the gradients in place (they are views into the DistributedModule's buckets).
  void zero_grad();

  DistributedModule& module() { return *ddp_; }
  /// The inner torch::optim::SGD (e.g. for an LR scheduler).
  torch::optim::Optimizer& sgd();
  /// The state across steps (rank/checkpoint.h: Checkpoint::algorithm): the DistributedModule's
  /// (PowerSGD's Qs and error feedback, the step counter) and the SGD's. Between steps only;
  /// load_state throws comm::Error naming what differs.
  void save_state(comm::StateWriter& out) const;
  void load_state(comm::StateReader& in);

 private:
  std::unique_ptr<DistributedModule> ddp_;
  std::unique_ptr<torch::optim::SGD> sgd_;
};

}  // namespace troupe::optim
