#pragma once
/// OuterStep (internal to algorithms/local_update): the part DiLoCo (diloco.h), Streaming DiLoCo
/// (streaming_diloco.h) and SparseLoCo (sparseloco.h) share. The model's parameters as one flat
/// float32 vector (algorithms/gossip/flat_model.h); the global weights the ranks last agreed on;
/// the pseudo-gradient, global - local, how far this rank's weights travelled since; the outer SGD
/// that steps the global weights by the averaged pseudo-gradient (OuterSgd); the step counters and
/// the traffic; and the saved state of all of these. Each algorithm adds how the pseudo-gradient
/// travels (a bucket reduction, per fragment, or SparseLoCo's top-k allgather) and what else it
/// keeps.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algorithms/gossip/flat_model.h"
#include "comm/collectives/communicator.h"
#include "comm/compression/reduction.h"
#include "comm/state.h"
#include "ddp/data_parallel.h"

namespace troupe {

/// The outer optimizer of DiLoCo and Streaming DiLoCo: torch.optim.SGD with momentum.
struct OuterSgd {
  double lr = 0.7;
  double momentum = 0.9;
  bool nesterov = true;

  /// buf = momentum buf + d; then x -= lr (d + momentum buf) (Nesterov), else x -= lr buf. With
  /// Nesterov, d is spent: it holds d + momentum buf afterwards.
  void step(torch::Tensor x, torch::Tensor buf, torch::Tensor d) const;
};

/// Throws comm::Error "<what>: <setting> = <value>, expected <range>" for inner_steps < 1, an
/// outer_lr that is not a finite number > 0, or (where given) an outer_momentum outside [0, 1).
void check_outer_settings(const std::string& what, int inner_steps, double outer_lr,
                          std::optional<double> outer_momentum = std::nullopt);

/// A tensor's floats, as comm::StateWriter saves them.
std::vector<float> values_of(const torch::Tensor& t);
/// Copies `values` (as many as t holds, checked by the StateReader that read them) into t.
void set_values(torch::Tensor& t, const std::vector<float>& values);

struct OuterStep {
  /// A collective (FlatModel's): `what` names the algorithm in messages ("DiLoCo"); an outer
  /// momentum buffer is kept when `with_momentum`.
  OuterStep(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, const std::string& what,
            bool with_momentum);

  /// Steps `optimizer` under the model's lock and counts the step; returns the inner steps so far.
  int64_t inner_step(torch::optim::Optimizer& optimizer);
  /// The local weights in host memory, brought up to date (parameters reattached, pulled). The
  /// caller holds flat.mutex() until it has pushed what it changed.
  torch::Tensor local();
  /// delta := global - local over [first, first + count) (by default the whole vector); returns
  /// that slice of delta.
  torch::Tensor take_pseudo_gradient(const torch::Tensor& local, size_t first = 0,
                                     size_t count = std::numeric_limits<size_t>::max());
  /// The reduction step that averages the pseudo-gradient of sync `step` over every rank.
  comm::ReduceStep reduce_step(uint32_t step) const;
  /// Adds one sync's traffic to the totals: bytes both ways, this step's, the most one sync sent.
  void count_sync(const comm::Communicator::Traffic& traffic);
  /// Adds the time since `start` to the time step() waited for communication.
  void count_wait(std::chrono::steady_clock::time_point start);
  /// local := global, pushed to the parameters; one more outer step.
  void continue_from_global(torch::Tensor& local);

  /// Writes `name` (the algorithm's, with its settings), the counters, the global weights and the
  /// outer momentum. The caller holds flat.mutex().
  void save(comm::StateWriter& out, const std::string& name) const;
  /// What save() wrote, read and checked against this module, not applied yet.
  struct Saved {
    int64_t inner = 0, outer = 0;
    uint64_t steps = 0;
    std::vector<float> global, momentum;
  };
  /// Reads what save() wrote; StateReader::fail when it was saved under another `name`.
  Saved read(comm::StateReader& in, const std::string& name) const;
  /// Applies what read() returned, once the algorithm has checked the rest of its state.
  void restore(const Saved& saved);

  Runtime& runtime;
  std::string what;
  gossip::FlatModel flat;
  torch::Tensor global, momentum, delta;  // flat float32, in host memory; momentum if asked
  int64_t inner = 0, outer = 0;
  CommStats totals;
};

}  // namespace troupe
