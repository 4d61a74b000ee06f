#pragma once
/// Elastic training: a synchronous job that goes on when ranks die, and takes restarted ranks
/// back, without restarting any survivor.
///
/// ```cpp
/// troupe::Runtime rt;   // under `troupe launch --elastic --min-ranks 2 --max-restarts 3 -n 4`
/// auto net = std::make_shared<Net>();
/// torch::optim::SGD opt(net->parameters(), 0.05);
/// troupe::ElasticTrainer trainer(rt, net, opt);
/// troupe::ElasticSampler sampler(train_size, /*global_batch=*/256, /*seed=*/1);
/// while (trainer.steps() < total_steps) {
///   auto mine = sampler.indices(trainer.steps(), rt.rank(), rt.world_size());
///   trainer.step([&] {                     // false: the world changed, the step is redone
///     opt.zero_grad();
///     torch::nll_loss(net->forward(x.index({idx(mine)})), y.index({idx(mine)})).backward();
///   });
/// }
/// trainer.finish();  // false: the world changed while waiting for the others; step on, again
/// ```
/// When a collective fails because a rank died (the membership service tells every survivor at
/// once, elastic/membership.h), step() destroys its DistributedModule, re-forms the Runtime with
/// the survivors (Runtime::reform), copies the state of the member with the most completed steps
/// to every member (a broadcast of ElasticState::save()'s bytes), builds a new DistributedModule
/// for the new world (buckets, denominators) numbered from that step, and returns false: the
/// caller redoes the step on its new shard. A restarted rank joins the same way: its Runtime
/// joins the next generation (the others' current step fails and is redone), and its trainer
/// receives the state before its first step, so every replica is bit-identical. A hot spare
/// (`troupe launch --spares K`, elastic/membership.h) is such a rank that started before the
/// death: the generation the death opens takes it, and it heals in the survivors' re-form.
///
/// The compressed algorithms' own state goes on too. Each survivor carries its error feedback
/// and momentum correction into the new module as they were at the end of its last completed
/// step (the trainer keeps a copy, taken inside each step once the reductions are done: a failed
/// step has already folded its gradient into the buckets it launched, so the live state would
/// count that gradient twice when the step is redone); the bucket layout depends on the model
/// and the options, not on the world size, so the state fits the new buckets. What every rank
/// holds equal (the step, the bucket layout, PowerSGD's warm-start Qs) travels from the source
/// with the parameters, so all members agree on it. A restarted rank starts with zero error
/// feedback: a residual is its owner's unsent gradient, and a copy of a peer's would send the
/// peer's twice. A member one step behind the source keeps its residual of the step before (the
/// unsent remainder of the step it missed is dropped). Keeping the copy costs copying the
/// algorithm state each step into buffers kept from step to step (twice its bytes, no allocation:
/// 29-66 us for the example's models with error feedback, docs/benchmarks-archive.md; nothing
/// for allreduce).
///
/// The local-update algorithms (DiLoCo, Streaming DiLoCo and SparseLoCo, algorithms/local_update)
/// go on too, from the last point where a synchronisation landed (LocalUpdateModule::step(inner,
/// landed)): DiLoCo's and SparseLoCo's outer syncs, and for Streaming DiLoCo each fragment's
/// merge, before the fragment due at the same step starts, so that no fragment is in flight
/// there. At each such point the trainer keeps each rank's caller state (parameters, buffers,
/// inner optimizer: ElasticState), its module's own state and the shared one, and a re-form
/// rolls every survivor back to its own; the steps since are redone on the new shards (a
/// fragment due at the point starts at the first of them, in the new world). Streaming DiLoCo's
/// replicas differ there (each merges its own weights), so each survivor goes back to its own
/// weights, not the source's. What every rank holds equal (the global weights, the outer
/// momentum, the counters, a fragment's reductions counted, an outer PowerSGD's Q) travels from
/// the source; what is a rank's own (its weights between syncs, its inner optimizer, DiLoCo's
/// outer-compression residual, SparseLoCo's error-feedback memory) is kept by a survivor and on
/// a restarted rank is the source's weights and inner optimizer, with a zero residual and memory.
/// A member behind the source (its sync failed where the source's completed: a re-form that
/// lands in a sync) goes on from its live state of that step (its own inner optimizer, which a
/// sync does not change, and its module's own state: a Streaming DiLoCo fragment whose reduction
/// failed is saved as such) and lands the sync with the source's shared state: DiLoCo and
/// SparseLoCo take the global weights, Streaming DiLoCo merges the fragment, as the sync would
/// have. With eager updates the landing point also holds each fragment's last average and its
/// world (shared), and each rank's others' average (its own); a restarted rank takes the whole
/// average as the others', and a member behind replaces its provisional step with the source's
/// global weights.
///
/// The gossip algorithms (D-PSGD, both exchanges, and Choco-SGD: algorithms/gossip) go on too, over
/// the new world's topology: a DecentralizedModule per world. Their replicas differ by design, so
/// each survivor keeps its own parameters, buffers and optimizer; the trainer keeps them as they
/// were after each completed step, and puts them back when a step was half-done (the optimizer
/// ran, the round did not bring every neighbour's message). The module by itself drops a dead
/// neighbour and mixes with the others; under the trainer a dropped neighbour, or a new
/// generation announced by the membership service (runtime_internal.h), fails the step instead.
/// The survivors may have completed different numbers of steps (a death reaches a far rank a few
/// rounds late); each goes on from its own, and the job's step count from the source's. A
/// restarted rank takes the source's parameters and optimizer. Choco-SGD's public copies start
/// at zero on every member of the new world (its paper's start), since a copy must be the same on
/// both ends of an edge; D-PSGD with overlap posts the current weights afresh. Keeping the copy
/// costs serialising the caller's state after each step (ElasticState::save).
///
/// The asynchronous algorithms (AsyncModelAverage and AsyncGossip: algorithms/gossip) go on too: an
/// AsynchronousModule per world. At a re-form the old world's background rounds end first,
/// without waiting on its other members (AsynchronousModule::end_world: the round in flight
/// fails, the neighbours are dropped, each wait has a deadline), and what the completed rounds
/// computed lands. A step never half-completes (it throws before its optimizer runs, or
/// completes), so each survivor keeps its live replica and nothing is serialised per step; a
/// restarted rank takes the source's parameters and optimizer. The new module counts its steps
/// from the job's step (the source's), so every member agrees on whether AsyncModelAverage's
/// warm-up allreduce is still due. A dropped neighbour or an announced generation fails the
/// step, as for gossip.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "algorithms/job_algorithm.h"
#include "ddp/data_parallel.h"
#include "ddp/distributed_module.h"

namespace troupe {

/// The caller's training state as bytes, and back: module_state() covers parameters, buffers and
/// a torch optimizer; the trainer adds its module's algorithm state itself. Other state of the
/// caller's (an RNG, the data position) plugs in here. Under a bucket algorithm it is the same on
/// every member after each step: a restarted or lagging member takes the source's. Under a
/// local-update algorithm it is each rank's own: the trainer saves it where a sync lands and
/// loads it back at a re-form (a survivor its own, a member behind the source its live one, a
/// restarted rank the source's), so `load` must restore exactly what `save` saw.
struct ElasticState {
  std::function<std::string()> save;
  std::function<void(const std::string&)> load;
};

/// Parameters and buffers of `module` and the state of `optimizer` (torch::serialize), which
/// must outlive the returned functions.
ElasticState module_state(std::shared_ptr<torch::nn::Module> module,
                          torch::optim::Optimizer& optimizer);

/// One membership change as this rank lived it.
struct ElasticRecovery {
  int generation = 0;  // the generation it ended in
  int world_size = 0;  // its world
  int64_t step = 0;    // the step the job went on from
  int source = 0;      // the rank (in that generation) whose state every member took
  double seconds = 0;  // from the failed step's error to the state healed and the module built
  std::string reason;  // the error that started it
};

class LocalUpdateModule;

class ElasticTrainer {
 public:
  /// Collective: every member constructs it (a restarted rank included), and receives the state
  /// of the generation's source. `algorithm`: a bucket algorithm (run by a DistributedModule with
  /// `options`), DiLoCo, Streaming DiLoCo or SparseLoCo (a LocalUpdateModule; `optimizer` is
  /// the inner one), D-PSGD or Choco-SGD (a DecentralizedModule; options.stall_timeout is each
  /// round's deadline), AsyncModelAverage or AsyncGossip (an AsynchronousModule;
  /// options.stall_timeout is the deadline of ending a world's rounds). `state` defaults to
  /// module_state(module, optimizer).
  ElasticTrainer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                 torch::optim::Optimizer& optimizer, JobAlgorithm algorithm = comm::Compression{},
                 DdpOptions options = {}, ElasticState state = {});
  ~ElasticTrainer();

  /// Runs `forward_backward` (zero the gradients, forward, loss, backward) and the step. True:
  /// the step completed. False: the membership changed; the world has been re-formed and healed,
  /// and the caller redoes steps from steps() (rank and world size may differ; a local-update
  /// algorithm goes back to the last point where a sync landed; a gossip survivor to its own
  /// last completed step, and steps() is the source's). Throws comm::Error when the job stops
  /// (no quorum), and rethrows errors of a Runtime that is not elastic.
  bool step(const std::function<void()>& forward_backward);
  /// Collective, after this rank's last step: waits until every member has ended its steps. A
  /// change of the membership meanwhile (a death, a restarted rank joining) re-forms and heals
  /// as step() does, and it waits again (returns false then: steps() may have changed, and the
  /// caller may have steps to redo; true when every member was there). The gossip and
  /// asynchronous members step at their own pace: one that left at its last step would open a
  /// generation for those still stepping, and a death while it waited would fail it. Each wait
  /// has the collective timeout; throws comm::Error when the job stops (no quorum).
  bool finish();
  /// Steps the job has completed (the same on every member at each formation, and between steps
  /// of the synchronous algorithms; a gossip member may be a step ahead of a neighbour).
  int64_t steps() const { return steps_; }
  /// The bucket algorithms' module; comm::Error when the trainer runs a local-update algorithm.
  DistributedModule& module();
  /// The local-update algorithms' module; comm::Error when it runs a bucket algorithm.
  LocalUpdateModule& local_update();
  /// The algorithm with its settings ("powersgd(rank=1, ...)", "diloco(h=4, ...)").
  std::string algorithm_name() const;
  /// The gossip and asynchronous algorithms' module's statistics in the current world (its
  /// rounds, bytes, dropped neighbours); comm::Error for the other algorithms.
  CommStats stats() const;
  const std::vector<ElasticRecovery>& recoveries() const { return recoveries_; }

  /// What the trainer builds for each world and steps (elastic.cpp): a DistributedModule, a
  /// LocalUpdateModule or a DecentralizedModule.
  struct Driver;

 private:
  void recover(const std::string& why);
  void heal(const ElasticGeneration& generation);
  void build();
  void snapshot();

  Runtime& rt_;
  torch::optim::Optimizer& optimizer_;
  ElasticState state_;
  std::unique_ptr<Driver> driver_;
  // The state a re-form goes back to, that of the end of step completed_: the module's algorithm
  // state, all of it and its shared part, and (for a driver that rolls back) the caller's state.
  // The bucket algorithms take it inside each step (a failed step has already changed the error
  // feedback of the buckets it launched), the local-update ones each time a sync lands.
  std::string own_, shared_, caller_;
  // Whether the sync that landed at step completed_ on the source is still to land in caller_
  // (a member that was behind the source, build()).
  bool land_ = false;
  // At a failure, before the module goes: a local-update member's caller state, module state
  // and step, from which it goes on when it turns out to be behind the source (heal()).
  std::string live_caller_, live_own_;
  int64_t live_step_ = -1;
  int64_t steps_ = 0;      // steps done
  int64_t completed_ = 0;  // the step a re-form goes on from
  bool built_ = false;     // this process has built a module: it holds training state
  std::vector<ElasticRecovery> recoveries_;
};

/// Which samples each rank trains on in a step when the world changes size: step s of the job
/// takes the global batch s of a per-epoch permutation of the data (seeded, the same on every
/// rank), cut into world_size contiguous slices. The job sees each sample once per epoch and the
/// same global batches whatever its membership.
class ElasticSampler {
 public:
  /// `size` samples, `global_batch` per step (1..size), the permutation of epoch e seeded by
  /// seed + e. Throws comm::Error naming a bad size or batch.
  ElasticSampler(int64_t size, int64_t global_batch, uint64_t seed);
  /// The sample indices of `rank` of `world` in step `step`.
  std::vector<int64_t> indices(int64_t step, int rank, int world);
  /// Whole global batches per epoch (the last partial one is dropped).
  int64_t steps_per_epoch() const { return size_ / global_batch_; }

 private:
  int64_t size_;
  int64_t global_batch_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

}  // namespace troupe
