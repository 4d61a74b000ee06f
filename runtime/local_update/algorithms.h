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

/// SparseLoCo (Sarfi et al. 2025, of the DeMo family): DiLoCo whose outer gradient is sent as the
/// top `ratio` of each chunk of an error-feedback memory, in `value_bits`-bit values, the memory
/// replacing the outer momentum: e = ef_decay e + delta; c = Q(topk(e)); e -= c; the ranks
/// allgather their c and the global weights step by outer_lr times its average.
/// runtime/local_update/sparseloco.h.
struct SparseLoCo {
  /// H: inner steps between synchronisations (>= 1).
  int inner_steps = 50;
  /// The outer step's learning rate (> 0).
  double outer_lr = 1.0;
  /// The share of each chunk sent, in (0, 1]: k = max(1, round(ratio * chunk)) per chunk (the
  /// default: 64 of 4096).
  double ratio = 1.0 / 64;
  /// Elements per top-k chunk, in [1, 65536] (indices travel as 16 bits within their chunk).
  size_t chunk = 4096;
  /// Bits per value sent: 2, 4 or 8 (min-max codes, one {min, max} pair per chunk), or 32 (float).
  int value_bits = 2;
  /// beta: the decay of the error-feedback memory, in [0, 1].
  double ef_decay = 0.95;
};

}  // namespace troupe
