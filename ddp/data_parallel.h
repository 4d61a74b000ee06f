#pragma once
/// DataParallel: the part of every data-parallel algorithm a training loop talks to — the bucket
/// algorithms of DistributedModule and the decentralized and asynchronous ones of algorithms/gossip
/// — so that one trainer (examples/fashion_mnist, `troupe run job.toml`) runs them all. It names no
/// algorithm: make_data_parallel (algorithms/registry.h) builds the one a JobAlgorithm names.
///
/// ```cpp
/// auto dp = troupe::make_data_parallel(rt, net, troupe::Decentralized{...});
/// for (...) { opt.zero_grad(); loss.backward(); dp->step(opt); }
/// dp->finish();                      // every rank: background work ends together
/// ```
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/state.h"
#include "rank/runtime.h"

namespace troupe {

/// Which part of a module's algorithm state DistributedModule::save_state writes: all of it (a
/// checkpoint; a survivor of an elastic re-form keeps its own), or only what every rank holds
/// equal (the step, the bucket layout, PowerSGD's Qs), which a restarted rank takes from a peer:
/// an error-feedback residual is that rank's own unsent gradient, and a copy of a peer's would
/// send the peer's twice.
enum class StatePart { all, shared };

/// What an algorithm has communicated since it was created, on this rank.
struct CommStats {
  uint64_t steps = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  /// Bytes sent by the last step's own communication (not by background rounds).
  uint64_t last_step_bytes_sent = 0;
  /// The most bytes one synchronisation sent (local-update algorithms; 0 for the others).
  uint64_t peak_sync_bytes_sent = 0;
  /// Time step() spent waiting for communication.
  double comm_wait_sec = 0;
  /// Background rounds (asynchronous algorithms): averages or pairwise exchanges completed (their
  /// results land in the weights at the next step(), abort() or finish()).
  uint64_t background_rounds = 0;
  /// Peers this rank stopped talking to because they died, in the order they were dropped.
  std::vector<int> dropped_peers;
};

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  /// After backward: communicates as the algorithm does and steps `optimizer` (whose parameters
  /// are the module's).
  virtual void step(torch::optim::Optimizer& optimizer) = 0;
  /// End of training, on every rank: background communication ends together and what is in
  /// flight is waited for (with a deadline). Later steps are local. Idempotent.
  virtual void finish() {}
  /// "allreduce", "powersgd(rank=2)", "decentralized(ring(8, uniform), overlap)", ...
  virtual std::string algorithm_name() const = 0;
  virtual CommStats stats() const = 0;
  /// The algorithm's state across steps, for checkpoints (rank/checkpoint.h): what each
  /// algorithm keeps (the bucket algorithms' error feedback and Qs, D-PSGD's round in flight,
  /// Choco-SGD's public copies, the asynchronous averager's pending rounds) and the step counter.
  /// Between steps only. The default refuses with comm::Error naming the algorithm.
  virtual void save_state(comm::StateWriter& out) const;
  /// Restores what save_state wrote under the same algorithm; comm::Error names what differs.
  virtual void load_state(comm::StateReader& in);
};

/// Averages the floating-point parameters and buffers of `module` over all ranks, in their own
/// dtypes, one flat allreduce per dtype. A collective.
void average_module(Runtime& runtime, torch::nn::Module& module);

/// Consensus distance: the mean over ranks of ||x_i - x_mean|| (L2 over all floating-point
/// parameters), where x_mean is the average model. A collective (two allreduces).
double consensus_distance(Runtime& runtime, torch::nn::Module& module);

}  // namespace troupe
