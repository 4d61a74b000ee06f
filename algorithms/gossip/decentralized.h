#pragma once
/// The decentralized and asynchronous algorithms (algorithms/gossip/algorithms.h says what each
/// does) as DataParallel objects a training loop steps like a DistributedModule:
///
/// ```cpp
/// troupe::DecentralizedModule dp(rt, net, troupe::Decentralized{.topology = {.kind =
///                                    troupe::comm::TopologyKind::ring}});
/// for (...) { opt.zero_grad(); loss.backward(); dp.step(opt); }
/// dp.finish();
/// ```
/// Construction is a collective: every rank must wrap the same model (names, shapes; float32,
/// all on the CPU or all on one CUDA device), whose parameters are then moved into one flat
/// buffer (each parameter a view of it) and set to rank 0's values. When a neighbour dies, gossip
/// goes on with the neighbours left (their weights renormalised); the rank is logged and listed in
/// stats().dropped_peers.
///
/// A checkpoint loaded after construction (torch::load set_()s every parameter to new storage), a
/// `p.set_data(...)` or a `module->to(...)` leaves the flat buffer behind. Every step() (and
/// AsynchronousModule's abort(), resume() and finish()) first compares each parameter's data
/// pointer with its slice of the buffer and re-attaches one that moved: under the model lock its
/// new values are copied into the buffer and it becomes a view of it again, so gossip goes on
/// with the loaded weights. One of another shape or dtype, or on another device, is refused with
/// an error naming the parameter (after torch::load, move the model to its device before the
/// step). The re-attach is local to the rank; what it does to the algorithm's state:
/// - D-PSGD, overlap: the round in flight carried the old weights: it is waited for and this
///   step's mix skipped (x = x_loaded - lr g). When every rank loaded the same checkpoint, that is
///   the mix they would have made, since W x = x.
/// - Choco-SGD: the public copies stay (the neighbours hold the same ones); the next compressed
///   differences carry the jump.
/// - AsynchronousModule: round results computed from the old weights are dropped.
/// A parameter registered anew (another tensor under the same name) is not detected.
///
/// A model on a CUDA device (gossip_path()):
/// - "cuda via nccl": D-PSGD when the Runtime has NCCL and GossipOptions::stage_through_host is
///   off. Each round is one group of NCCL sends and receives on the module's own communicator,
///   and the mix runs on the device. NCCL cannot drop a peer: a neighbour that dies fails the
///   round with an error instead of being dropped.
/// - "cuda via host staging": otherwise, and always for Choco-SGD and the asynchronous algorithms.
///   The weights are copied to a pinned host mirror, gossiped over the transport as for a CPU
///   model, and copied back.
#include <chrono>
#include <memory>
#include <string>

#include "algorithms/gossip/algorithms.h"
#include "ddp/data_parallel.h"
#include "rank/module_holder.h"

namespace troupe {

struct GossipOptions {
  /// Deadline of each synchronous gossip round, of finish(), abort() and resume(). A neighbour
  /// silent for this long is declared dead.
  std::chrono::milliseconds timeout{60000};
  /// Start every rank from rank 0's weights (true), or from its own. Choco-SGD's public copies
  /// start at those common weights (true), or at zero on every rank (false: the ranks' weights
  /// differ, and a copy must be the same on both ends of its edge).
  bool broadcast_parameters = true;
  /// CUDA models only: D-PSGD gossips over NCCL when the Runtime has it (nccl_available());
  /// true makes it stage through host memory and the transport instead, as the other
  /// algorithms always do. The same on every rank.
  bool stage_through_host = false;
};

/// Decentralized SGD (D-PSGD) and its low-precision variant (Choco-SGD, 8-bit differences).
class DecentralizedModule : public DataParallel {
 public:
  /// `module`: a shared_ptr or a ModuleHolder (rank/module_holder.h).
  DecentralizedModule(Runtime& runtime, ModelRef module, Decentralized algorithm,
                      GossipOptions options = {});
  DecentralizedModule(Runtime& runtime, ModelRef module, LowPrecisionDecentralized algorithm,
                      GossipOptions options = {});
  ~DecentralizedModule() override;

  void step(torch::optim::Optimizer& optimizer) override;
  /// Waits for the exchange in flight (overlap mode: the weights sent after the last step).
  void finish() override;
  std::string algorithm_name() const override;
  CommStats stats() const override;
  /// "cpu", "cuda via nccl" or "cuda via host staging" (see above).
  std::string gossip_path() const;
  /// The step and round counters; D-PSGD with overlap: the weights of the round in flight (posted
  /// again at load_state, after the round the fresh module posted is drained); Choco-SGD: the
  /// public copies of this rank and of each neighbour. Every rank loads at the same step (the
  /// rounds after it are collective), on the transport path (not "cuda via nccl").
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Asynchronous model averaging and asynchronous pairwise gossip (AD-PSGD): background actors
/// (actors/background.h) average the model while training goes on; step() only takes the model
/// lock for the optimizer's step (and, during AsyncModelAverage's warm-up, allreduces gradients).
///
/// When a round lands: the weights change only on the trainer's thread, in step() (after the
/// optimizer's step), abort() and finish(). A round's result (avg - snapshot, or half a pairwise
/// difference) waits in a pending buffer until then, and the actors' snapshots read the weights
/// plus what is pending. So a forward and its backward always see the same weights (Bagua locks
/// them from the forward pre-hook until backward ends; LibTorch has no forward pre-hook, and this
/// rule needs none), and training never waits for a round: a step lands what has arrived (one
/// pass over the weights) and goes on. stats().background_rounds counts the rounds completed,
/// landed or not.
///
/// A rank that dies or fails ends AsyncModelAverage's rounds (every rank takes part in each):
/// the next step() throws comm::Error naming it; AsyncGossip drops it as a neighbour and goes on.
class AsynchronousModule : public DataParallel {
 public:
  /// `module`: a shared_ptr or a ModuleHolder (rank/module_holder.h).
  AsynchronousModule(Runtime& runtime, ModelRef module, AsyncModelAverage algorithm,
                     GossipOptions options = {});
  AsynchronousModule(Runtime& runtime, ModelRef module, AsyncGossip algorithm,
                     GossipOptions options = {});
  ~AsynchronousModule() override;

  void step(torch::optim::Optimizer& optimizer) override;
  /// Every rank: background averaging stops after one last round that all ranks take together
  /// (AsyncModelAverage), or once every neighbour has said goodbye (AsyncGossip). Steps go on
  /// locally until resume().
  void abort();
  /// Every rank: background averaging starts again (after warm-up, if that has not ended).
  void resume();
  /// abort(), for good.
  void finish() override;
  /// This rank's world is ending (an elastic re-form, elastic/elastic.h), and the others may
  /// neither stop with it nor say goodbye: ends the background rounds without them. This rank's
  /// operations with the module's peers (every rank for AsyncModelAverage, the neighbours for
  /// AsyncGossip) fail on the Runtime's transport, with `reason`, so a round in flight ends
  /// (AsyncModelAverage: abort_atom; AsyncGossip: every neighbour dropped); what the completed
  /// rounds computed lands, and the call returns once the background actor is gone, so nothing
  /// touches the model after it. Each wait has the GossipOptions::timeout deadline; the module
  /// does not step or resume after it. The transport is the old world's, discarded by the
  /// re-form that follows.
  void end_world(const std::string& reason);
  /// Numbers the next step `steps` (the warm-up counts from it): a module built for a new world
  /// that goes on from the job's step, the same on every member. Starts the background rounds
  /// when the warm-up has ended.
  void resume_at(uint64_t steps);
  std::string algorithm_name() const override;
  CommStats stats() const override;
  /// "cpu", or "cuda via host staging": the background actors snapshot and change a CUDA model
  /// through a pinned host mirror, each copy synchronous on the actor's thread's current stream.
  std::string gossip_path() const;
  /// The step counter (warm-up) and the rounds' results that have not landed yet. The rounds
  /// themselves are timer-driven: a restore continues from the same weights, not the same
  /// trajectory.
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
