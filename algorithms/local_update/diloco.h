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
/// float32, on the CPU or one CUDA device (algorithms/gossip/flat_model.h moves them into one flat
/// buffer and broadcasts rank 0's at construction). Buffers (BatchNorm statistics) stay local, as
/// in the paper and torchft's DiLoCo.
#include <torch/nn/module.h>

#include <memory>
#include <string>

#include "algorithms/local_update/algorithms.h"
#include "algorithms/local_update/local_update_module.h"

namespace troupe {

/// "diloco(h=50, outer_lr=0.7, outer_momentum=0.9, allreduce)".
std::string diloco_name(const DiLoCo& config);

/// step() synchronises at every inner_steps-th call. The state holds the outer momentum and the
/// outer reduction's own (error feedback, PowerSGD's Q) besides local_update_module.h's.
class DiLoCoModule : public LocalUpdateModule {
 public:
  /// A collective: every rank wraps the same model with the same config. Throws comm::Error
  /// naming a setting out of range (and what was expected), or a parameter that is not float32.
  DiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, DiLoCo config);

 private:
  struct Impl;
};

}  // namespace troupe
