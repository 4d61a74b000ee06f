#pragma once
/// FP16Optimizer: mixed-precision training (mlbench-core's FP16Optimizer). The model computes in
/// float16 (or bfloat16); the optimizer keeps float32 master weights, steps them, and copies them
/// back into the model, so updates smaller than a half-precision step are not lost. Gradients are
/// averaged over the ranks in half precision by a DistributedModule (GradientAllReduce on float16
/// buckets, overlapping backward), and a dynamic loss scale keeps small gradients from vanishing
/// in float16.
///
/// ```cpp
/// auto net = std::make_shared<Net>();   // float32; FP16Optimizer converts it
/// troupe::optim::FP16Optimizer opt(rt, net, torch::optim::SGDOptions(0.1).momentum(0.9));
/// for (auto& batch : *loader) {
///   opt.zero_grad();
///   auto loss = loss_fn(net->forward(batch.data.to(torch::kHalf)), batch.target);
///   opt.backward(loss);   // = opt.scale_loss(loss).backward(); buckets reduce meanwhile
///   opt.step();           // false when the step was skipped for an overflow
/// }
/// ```
/// The model: its trainable parameters must be float32 or already of `dtype`. The constructor
/// takes the master weights from them (exactly, when float32), then converts the model's float32
/// parameters and buffers to `dtype` in place (not integer buffers, which Module::to would convert
/// too). Master weights live in ONE flat float32 buffer (master_buffer()), each parameter a view
/// of it, and so do their gradients. The inner optimizer (any torch::optim optimizer, made by the
/// factory over the master views, or torch::optim::SGD) never sees a half tensor.
///
/// step(), with S the loss scale and g the model's gradients after the allreduce (half):
///   1. G = float32(g) into the master gradient buffer.
///   2. Overflow = some element of G is inf or NaN. The test reads the gradients after the
///      allreduce: an inf or NaN on any one rank makes the sum inf or NaN on every rank (IEEE
///      arithmetic), and the allreduce leaves the same bits on every rank, so the overflow flag is
///      reduced with the gradients and every rank takes the same decision.
///   3. Overflow: skip the step (masters and model unchanged), count it (skipped_steps()), and
///      S = max(S / scale_factor, min_scale). An overflow while S is already min_scale throws
///      comm::Error on every rank (after counting the skipped step): scaling cannot cure it.
///   4. Otherwise G /= S, the inner optimizer steps the masters, the model gets float16(masters);
///      after scale_window such steps in a row, S = min(S * scale_factor, max_scale).
/// Without loss scaling (the default in bfloat16, whose range is float32's) S stays 1; overflows
/// still skip the step and are counted, but never throw.
///
/// The constructor is a collective (the DistributedModule's model check and broadcast, then rank
/// 0's master weights are broadcast): every rank starts from rank 0's float32 weights.
#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "ddp/distributed_module.h"

namespace troupe::optim {

/// Options of FP16Optimizer (builder style). Checked by the constructor: dtype is Half or
/// BFloat16; init_scale > 0; scale_factor > 1; scale_window >= 1; 0 < min_scale <= init_scale;
/// max_scale, when set, >= init_scale; ddp.agg_grad.
struct Fp16OptimizerOptions {
  /// The model's precision: torch::kHalf or torch::kBFloat16.
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Half;
  /// Dynamic loss scaling; unset: on for Half, off for BFloat16 (then the scale is 1).
  TORCH_ARG(c10::optional<bool>, loss_scaling) = c10::nullopt;
  TORCH_ARG(double, init_scale) = 1024;
  /// The scale is divided by this at an overflow and multiplied by it after scale_window steps
  /// without one.
  TORCH_ARG(double, scale_factor) = 2;
  TORCH_ARG(int64_t, scale_window) = 128;
  TORCH_ARG(double, min_scale) = 1e-4;
  TORCH_ARG(c10::optional<double>, max_scale) = c10::nullopt;
  /// The DistributedModule's options (bucket sizes, divide_before against overflow in the half
  /// sum, stall timeout, trace); agg_grad must stay true.
  TORCH_ARG(DdpOptions, ddp) = {};
};

/// Throws comm::Error naming the first option out of range, its value and the allowed range.
void validate(const Fp16OptimizerOptions& options);

/// Makes the inner optimizer over the float32 master weights (views into one flat buffer).
using MasterOptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> masters)>;

class FP16Optimizer {
 public:
  FP16Optimizer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                MasterOptimizerFactory make_optimizer, Fp16OptimizerOptions options = {});
  /// The inner optimizer is torch::optim::SGD with these options.
  FP16Optimizer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                torch::optim::SGDOptions sgd, Fp16OptimizerOptions options = {});
  ~FP16Optimizer();
  FP16Optimizer(const FP16Optimizer&) = delete;
  FP16Optimizer& operator=(const FP16Optimizer&) = delete;

  /// The loss in float32 times the current loss scale: call backward() on this.
  torch::Tensor scale_loss(const torch::Tensor& loss) const;
  /// scale_loss(loss).backward().
  void backward(const torch::Tensor& loss);
  /// Waits for the gradient reductions, then unscales, checks for overflow and steps (above).
  /// Returns false when the step was skipped. A collective: every rank calls it once per step.
  bool step();
  /// Zeros the model's gradients (in place: they are views into the buckets).
  void zero_grad();

  /// The loss scale the next backward uses.
  double loss_scale() const;
  /// Steps skipped for an overflow so far (the same on every rank).
  int64_t skipped_steps() const;
  /// The float32 master weights: views into master_buffer(), in the order of the module's
  /// trainable parameters.
  const std::vector<torch::Tensor>& master_weights() const;
  /// The one flat float32 buffer that holds every master weight.
  const torch::Tensor& master_buffer() const;

  DistributedModule& module();
  /// The inner optimizer over the masters (e.g. for an LR scheduler).
  torch::optim::Optimizer& optimizer();
  /// The state across steps (rank/checkpoint.h: Checkpoint::algorithm): the float32 master weights,
  /// the loss scale and its counters, the inner optimizer's and the DistributedModule's. Between
  /// steps only; load_state throws comm::Error naming what differs.
  void save_state(comm::StateWriter& out) const;
  void load_state(comm::StateReader& in);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::optim
