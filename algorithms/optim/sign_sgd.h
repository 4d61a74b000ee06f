#pragma once
/// SignSGD: SGD that moves each coordinate by the learning rate in the direction of its (momentum)
/// gradient's sign (Bernstein et al. 2018; mlbench-core's SignSGD).
///
/// Per parameter, with d the gradient:
///   d = grad + weight_decay * p
///   buf = momentum * buf + (1 - dampening) * d      (buf = d on the first step; momentum > 0)
///   d = nesterov ? d + momentum * buf : buf          (momentum > 0)
///   p -= lr * sign(d)                                (sign(0) = 0)
///
/// Distributed (signSGD with majority vote): wrap the model in a DistributedModule that votes, so
/// that the gradients reaching the optimizer are sign(sum_r sign(g_r)) — one bit per element on
/// the wire — and let the module step it:
/// ```cpp
/// troupe::DistributedModule ddp(rt, net, troupe::SignCompression{troupe::SignMode::majority_vote,
///                                                                 /*error_feedback=*/false});
/// troupe::optim::SignSGD opt(net->parameters(),
/// troupe::optim::SignSgdOptions(1e-3).momentum(0.9)); for (auto& batch : *loader) {
///   opt.zero_grad();
///   torch::nll_loss(net->forward(batch.data), batch.target).backward();
///   ddp.step(opt);   // the vote's signs arrive as gradients, then SignSGD steps
/// }
/// ```
/// (In the vote a zero gradient counts as positive: comm/codecs/sign.h.)
#include <torch/optim/optimizer.h>

#include <vector>

namespace troupe::optim {

/// Options of SignSGD (builder style, as torch::optim::SGDOptions). Checked by the constructor:
/// lr > 0, momentum >= 0, weight_decay >= 0; nesterov needs momentum > 0 and dampening == 0.
struct SignSgdOptions : public torch::optim::OptimizerCloneableOptions<SignSgdOptions> {
  SignSgdOptions(double lr);  // NOLINT: implicit, as torch::optim::SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(double, weight_decay) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// SignSGD's state per parameter: the momentum buffer (undefined until the first step with
/// momentum).
struct SignSgdParamState : public torch::optim::OptimizerCloneableParamState<SignSgdParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// SignSGD as a LibTorch optimizer: parameter groups, zero_grad, save/load (torch::save) and LR
/// schedulers work as with torch::optim::SGD. Parameters without a gradient are skipped.
class SignSGD : public torch::optim::Optimizer {
 public:
  /// Throws comm::Error naming the option, its value and what is expected.
  SignSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups, SignSgdOptions defaults);
  SignSGD(std::vector<torch::Tensor> params, SignSgdOptions defaults);

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

/// Throws comm::Error naming the first option out of range (also used for every param group).
void validate(const SignSgdOptions& options);

}  // namespace troupe::optim
