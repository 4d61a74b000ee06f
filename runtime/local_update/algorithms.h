#pragma once
/// The local-update algorithms' settings (plain structs, like comm/compression/algorithms.h and
/// runtime/gossip/algorithms.h): what a job names and runtime/local_update/diloco.h runs.
#include "comm/compression/algorithms.h"

namespace troupe {

/// DiLoCo (arXiv 2311.08105): `inner_steps` local steps, then the averaged outer gradient stepped
/// by SGD with (Nesterov) momentum into the global weights. runtime/local_update/diloco.h.
struct DiLoCo {
  /// H: inner steps between synchronisations (>= 1).
  int inner_steps = 50;
  /// The outer SGD's learning rate (> 0; the paper's 0.7).
  double outer_lr = 0.7;
  /// The outer SGD's momentum, in [0, 1) (the paper's 0.9).
  double outer_momentum = 0.9;
  /// Nesterov momentum (the paper's), else heavy ball.
  bool nesterov = true;
  /// How the outer gradient is averaged over the ranks.
  comm::Compression outer_compression = comm::GradientAllReduce{};
};

}  // namespace troupe
