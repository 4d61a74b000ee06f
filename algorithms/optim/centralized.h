#pragma once
/// Centralized optimizers (mlbench-core's CentralizedSGD, CentralizedAdam and
/// CustomCentralizedOptimizer): a torch::optim optimizer stepped by a DistributedModule that
/// allreduces the gradients in buckets while backward runs (plain GradientAllReduce), with
/// mlbench's options on top: a global gradient-norm clip after aggregation, the average by the
/// world size or by a denominator given per step, division before the sum, and local steps with
/// averaged weights (agg_grad = false).
///
/// ```cpp
/// using troupe::optim::CentralizedSgdOptions;
/// troupe::optim::CentralizedSGD opt(rt, net, CentralizedSgdOptions(0.1).grad_clip(5));
/// for (auto& batch : *loader) {
///   opt.zero_grad();
///   opt.set_denominator(global_samples);   // optional, before backward: average by this
///   torch::nll_loss(net->forward(batch.data), batch.target, {}, at::Reduction::Sum).backward();
///   opt.step();   // waits for the reductions, clips the global norm, steps
/// }
/// ```
/// Per step, with g_r rank r's gradient and W the world size:
///   agg_grad:  g = s * sum_r g_r (s = 1/W, 1/denominator, or 1 when !average);
///              g *= min(1, grad_clip / (||g||_2 + 1e-6)) over all parameters (grad_clip > 0);
///              the inner optimizer steps on g (identical on every rank).
///   !agg_grad: each rank clips its own g_r and steps its own optimizer (its state stays local),
///              then the weights are averaged: p = (1/W) sum_r p_r.
/// The constructor is the DistributedModule's: a collective that checks that every rank wraps the
/// same model and broadcasts rank 0's parameters (in place, so an optimizer built over
/// module->parameters() before keeps pointing at them).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <tuple>

#include "ddp/distributed_module.h"

namespace troupe::optim {

/// The distribution options every centralized optimizer has (builder style). The fields of
/// CentralizedSgdOptions and CentralizedAdamOptions of the same names mean the same.
struct CentralizedOptions {
  /// Clip the global L2 norm of all gradients to this, after aggregation; 0 = off; >= 0.
  TORCH_ARG(double, grad_clip) = 0;
  /// true: allreduce gradients, then step. false: step locally, then average the weights.
  TORCH_ARG(bool, agg_grad) = true;
  /// true: divide the sum of gradients by the world size (or by set_denominator's value);
  /// false: sum.
  TORCH_ARG(bool, average) = true;
  /// Divide each rank's gradient before the sum rather than the sum after (against overflow).
  TORCH_ARG(bool, divide_before) = false;
  /// The DistributedModule's other options (bucket sizes, aggregation, stall timeout, trace); its
  /// agg_grad, average and divide_before are replaced by the fields above.
  TORCH_ARG(DdpOptions, ddp) = {};
};

/// Options of CentralizedSGD (builder style, as torch::optim::SGDOptions): lr > 0, momentum >= 0,
/// dampening >= 0, weight_decay >= 0, nesterov needs momentum > 0 and dampening = 0; then the
/// distribution options of CentralizedOptions.
struct CentralizedSgdOptions {
  CentralizedSgdOptions(double lr);  // NOLINT: implicit, as torch::optim::SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(double, grad_clip) = 0;
  TORCH_ARG(bool, agg_grad) = true;
  TORCH_ARG(bool, average) = true;
  TORCH_ARG(bool, divide_before) = false;
  TORCH_ARG(DdpOptions, ddp) = {};
};

/// Options of CentralizedAdam (builder style, as torch::optim::AdamOptions): lr > 0,
/// 0 <= betas < 1, eps >= 0, weight_decay >= 0, amsgrad (keep the maximum of the second moments);
/// then the distribution options of CentralizedOptions.
struct CentralizedAdamOptions {
  CentralizedAdamOptions(double lr = 1e-3);  // NOLINT: implicit, as torch::optim::AdamOptions
  TORCH_ARG(double, lr);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(double, grad_clip) = 0;
  TORCH_ARG(bool, agg_grad) = true;
  TORCH_ARG(bool, average) = true;
  TORCH_ARG(bool, divide_before) = false;
  TORCH_ARG(DdpOptions, ddp) = {};
};

/// Each throws comm::Error naming the first option out of range, its value and what is expected.
void validate(const CentralizedOptions& options);
void validate(const CentralizedSgdOptions& options);
void validate(const CentralizedAdamOptions& options);

/// What CentralizedSGD, CentralizedAdam and CustomCentralizedOptimizer share: a DistributedModule
/// (GradientAllReduce) around the model and an inner torch::optim optimizer over its parameters.
class CentralizedOptimizer {
 public:
  virtual ~CentralizedOptimizer();
  CentralizedOptimizer(const CentralizedOptimizer&) = delete;
  CentralizedOptimizer& operator=(const CentralizedOptimizer&) = delete;

  /// agg_grad: waits for the step's reductions, clips, then steps the inner optimizer.
  /// !agg_grad: clips the local gradients, steps, then averages the weights over the ranks.
  /// A collective: every rank calls it once per step.
  void step();
  /// Zeros the gradients (in place: they are views into the DistributedModule's buckets).
  void zero_grad();
  /// Averages this step's gradient sum by `denominator` instead of the world size (e.g. the
  /// number of samples of the step over all ranks), at any world size, 1 included. Call it before
  /// backward, every step (the next step is back to the world size), with the same value on every
  /// rank. Throws comm::Error naming the value unless it is finite and > 0, and when average or
  /// agg_grad is off.
  void set_denominator(double denominator);

  /// The global L2 norm of the gradients that the last step clipped (before clipping; with
  /// !agg_grad, of this rank's gradients); 0 while grad_clip is off or before the first step.
  double last_grad_norm() const;

  DistributedModule& module();
  /// The inner optimizer (e.g. for an LR scheduler, or torch::save of its state).
  torch::optim::Optimizer& optimizer();
  /// The state across steps (rank/checkpoint.h: Checkpoint::algorithm): the DistributedModule's,
  /// the inner optimizer's and the last gradient norm. Between steps only; load_state throws
  /// comm::Error naming what differs.
  void save_state(comm::StateWriter& out) const;
  void load_state(comm::StateReader& in);

 protected:
  /// `name` names the optimizer in error messages. Validates `options` before any collective.
  CentralizedOptimizer(std::string name, Runtime& runtime,
                       std::shared_ptr<torch::nn::Module> module,
                       std::unique_ptr<torch::optim::Optimizer> optimizer,
                       CentralizedOptions options);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// torch::optim::SGD (lr, momentum, dampening, weight decay, Nesterov) over a DistributedModule.
class CentralizedSGD : public CentralizedOptimizer {
 public:
  CentralizedSGD(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                 CentralizedSgdOptions options);
};

/// torch::optim::Adam (betas, eps, weight decay, amsgrad) over a DistributedModule.
class CentralizedAdam : public CentralizedOptimizer {
 public:
  CentralizedAdam(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                  CentralizedAdamOptions options);
};

/// Any torch::optim optimizer of the user's over a DistributedModule:
/// ```cpp
/// troupe::optim::CustomCentralizedOptimizer opt(
///     rt, net, std::make_unique<torch::optim::RMSprop>(net->parameters(), 0.01),
///     troupe::optim::CentralizedOptions().grad_clip(1));
/// ```
/// Every parameter of `optimizer` must be a parameter of `module` (checked, naming the first that
/// is not): the DistributedModule reduces only the module's gradients.
class CustomCentralizedOptimizer : public CentralizedOptimizer {
 public:
  CustomCentralizedOptimizer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                             std::unique_ptr<torch::optim::Optimizer> optimizer,
                             CentralizedOptions options = {});
};

}  // namespace troupe::optim
