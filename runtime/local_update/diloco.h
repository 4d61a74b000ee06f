#pragma once
/// DiLoCo (Douillard et al., arXiv 2311.08105): every rank trains alone for `inner_steps` steps
/// with its own (inner) optimizer; then the ranks average their outer gradient, the distance the
/// weights travelled since the last synchronisation (global - local), and an outer SGD with
/// Nesterov momentum steps the shared global weights by it, which every rank then continues from.
/// Communication is one reduction of the model every `inner_steps` steps instead of one per step.
///
/// ```cpp
/// troupe::DiLoCoModule dp(rt, net, troupe::DiLoCo{/*inner_steps=*/50});
/// torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(3e-3));
/// for (...) { inner.zero_grad(); loss.backward(); dp.step(inner); }  // steps, syncs every 50th
/// ```
/// The outer gradient is reduced by any bucket algorithm of comm/compression/algorithms.h
/// (`outer_compression`): allreduce, fp16/bf16, ByteGrad, top-k with error feedback, PowerSGD...,
/// whose state (error feedback, PowerSGD's Q) persists across synchronisations. Parameters are
/// float32, on the CPU or one CUDA device (runtime/gossip/flat_model.h moves them into one flat
/// buffer and broadcasts rank 0's at construction). Buffers (BatchNorm statistics) stay local, as
/// in the paper and torchft's DiLoCo.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>

#include "runtime/data_parallel.h"
#include "runtime/local_update/algorithms.h"

namespace troupe {

/// "diloco(h=50, outer_lr=0.7, outer_momentum=0.9, allreduce)".
std::string diloco_name(const DiLoCo& config);

class DiLoCoModule : public DataParallel {
 public:
  /// A collective: every rank wraps the same model with the same config. Throws comm::Error
  /// naming a setting out of range (and what was expected), or a parameter that is not float32.
  DiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, DiLoCo config);
  ~DiLoCoModule() override;

  /// Steps `inner` (its gradients stay local); every inner_steps-th call then synchronises: a
  /// collective, on every rank at the same step.
  void step(torch::optim::Optimizer& inner) override;
  std::string algorithm_name() const override;
  CommStats stats() const override;
  /// Synchronisations so far.
  int64_t outer_steps() const;
  /// The global weights, the outer momentum, the step counters and the outer reduction's own
  /// state (error feedback, PowerSGD's Q): a resumed run continues bit-identically
  /// (runtime/checkpoint.h). The weights themselves are the model's, saved with it.
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
