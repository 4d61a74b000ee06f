#pragma once
/// The local-update algorithms' settings (plain structs, like comm/compression/algorithms.h and
/// algorithms/gossip/algorithms.h): what a job names and algorithms/local_update/diloco.h and
/// streaming_diloco.h run.
#include "comm/compression/algorithms.h"

namespace troupe {

/// DiLoCo (arXiv 2311.08105): `inner_steps` local steps, then the averaged outer gradient stepped
/// by SGD with (Nesterov) momentum into the global weights. algorithms/local_update/diloco.h.
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
/// algorithms/local_update/sparseloco.h.
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

/// Streaming DiLoCo (arXiv 2501.18512), optionally with eager updates (arXiv 2502.12996): the
/// model cut into `fragments` pieces that synchronise in turn, each every `inner_steps` steps,
/// offsets inner_steps / fragments apart; a fragment's outer gradient travels during the next
/// `delay` inner steps and is then stepped into its global copy and merged into the local one.
/// algorithms/local_update/streaming_diloco.h.
struct StreamingDiLoCo {
  /// H: inner steps between two synchronisations of one fragment (>= 1).
  int inner_steps = 50;
  /// P: fragments (1 <= P <= H, and no more than the model has rows to cut).
  int fragments = 4;
  /// tau: inner steps a fragment's reduction travels before it is applied (the overlap),
  /// 0 <= tau <= H / P (rounded down): at most one fragment is in flight.
  int delay = 1;
  /// alpha: at the merge, local = alpha local + (1 - alpha) global (0: the global replaces it).
  double fragment_update_alpha = 0.5;
  /// The outer SGD's learning rate (> 0) and momentum (in [0, 1)), Nesterov or heavy ball.
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  bool nesterov = true;
  /// How each fragment's outer gradient is averaged over the ranks (the paper: 4 bits, summed in
  /// float32).
  comm::Compression outer_compression = comm::GradientAllReduce{};
  /// Eager updates: at the sync the local fragment takes a provisional outer step by its own
  /// fresh outer gradient standing in for the others' (docs/algorithms.md), corrected on arrival.
  bool eager = false;
};

}  // namespace troupe
