#pragma once
/// LocalUpdateModule: the DataParallel of the local-update algorithms, DiLoCoModule (diloco.h),
/// StreamingDiLoCoModule (streaming_diloco.h) and SparseLoCoModule (sparseloco.h). Every rank
/// steps its own inner optimizer, whose gradients stay local, and on the algorithm's schedule
/// takes part in an outer step: step() is a collective, called the same number of times on every
/// rank. The saved state holds the global weights, the outer optimizer's state, the step counters
/// and the algorithm's own (error feedback, fragments in flight): a resumed run continues
/// bit-identically (rank/checkpoint.h). The weights themselves are the model's, saved with it.
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ddp/data_parallel.h"

namespace troupe {

struct OuterStep;

class LocalUpdateModule : public DataParallel {
 public:
  ~LocalUpdateModule() override;

  /// Steps `inner`, then takes the part of a synchronisation the schedule puts after this step.
  void step(torch::optim::Optimizer& inner) override;
  /// step(inner), calling `landed` each time a synchronisation has landed in this rank's weights
  /// and nothing of the next is under way (Streaming DiLoCo: between a fragment's merge and the
  /// start of the fragment due at the same step): a point an elastic trainer rolls back to
  /// (elastic/elastic.h). A fragment due there and not started yet (a state saved at such a
  /// point and loaded) starts at the next step(), before its inner step.
  void step(torch::optim::Optimizer& inner, const std::function<void()>& landed);
  /// With a state loaded where a sync had landed (step(inner, landed)) and the caller's weights
  /// of that point in place: starts what the schedule puts right after that landing (Streaming
  /// DiLoCo: the fragment due at that step, a collective), so that the next inner step's forward
  /// and backward run on the weights it leaves (with eager updates, its provisional step's).
  /// step() does it before its inner step when not done, which with eager updates is after a
  /// backward on the weights before it: call this first. Does nothing elsewhere, and calls no
  /// landed listener (a sync it lands, with delay 0, is not a point to go back to).
  void start_due();
  /// Inner steps so far.
  int64_t inner_steps() const;
  /// Elastic training's catch-up of a rank whose synchronisation failed where it completed on
  /// the others: with this rank's weights as they were after inner step inner_steps() and the
  /// shared state of a rank that completed it loaded (StatePart::shared), lands that
  /// synchronisation as it would have: DiLoCo and SparseLoCo continue from the global weights,
  /// Streaming DiLoCo merges the fragment applied after that step. Throws comm::Error when no
  /// synchronisation lands after that step. Streaming DiLoCo with eager updates also needs this
  /// rank's own part of that sync (its outer gradient and provisional step): the module's state
  /// saved after the fragment's reduction failed here, loaded (StatePart::all) before the shared
  /// one; without it, comm::Error naming the fragment.
  void land_missed_sync();
  std::string algorithm_name() const override;
  CommStats stats() const override;
  /// Synchronisations so far (Streaming DiLoCo: fragment syncs applied, all fragments together).
  int64_t outer_steps() const;
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;
  /// StatePart::all is save_state(out); StatePart::shared only what every rank holds equal after
  /// an outer sync (the counters, the global weights, the outer momentum, the outer reduction's
  /// shared part such as PowerSGD's Q), which an elastic member that restarted takes from a peer
  /// (elastic/elastic.h): an error-feedback residual is its owner's. Streaming DiLoCo splits it
  /// only where no fragment is in flight (where a sync has landed, see step(inner, landed)), and
  /// refuses elsewhere with comm::Error naming the fragment.
  void save_state(comm::StateWriter& out, StatePart part) const;
  /// Restores what save_state(out, part) wrote, checked before anything changes.
  void load_state(comm::StateReader& in, StatePart part);

 protected:
  /// What an algorithm adds to the outer step they share (algorithms/local_update/outer_step.h).
  struct Algorithm {
    virtual ~Algorithm() = default;
    /// The algorithm with its settings, "diloco(h=50, ...)"; a state saved under another name is
    /// refused.
    virtual std::string name() const = 0;
    virtual OuterStep& outer_step() = 0;
    /// After inner step t (counted from 1): the synchronisation the schedule puts here, if any;
    /// landed() once it has landed in the weights.
    virtual void after_step(int64_t t) = 0;
    /// Before inner step t + 1: what a state loaded at a landing point still has to start.
    virtual void before_step(int64_t t) { (void)t; }
    /// land_missed_sync() after inner step t; by default the weights := the global weights.
    virtual void land_missed(int64_t t);
    /// Calls the listener of the step() under way, if any.
    void landed() const {
      if (on_landed && *on_landed) (*on_landed)();
    }
    const std::function<void()>* on_landed = nullptr;
    /// Before a save: what is in flight lands in the state. Before a load: a refusal when this
    /// module cannot take one now.
    virtual void before_save() {}
    virtual void before_load(comm::StateReader& in) { (void)in; }
    /// The state beyond OuterStep's, written under the model's lock.
    virtual void save_rest(comm::StateWriter& out) = 0;
    /// Reads and checks that state; returns what applies it, under the model's lock, after it has
    /// read the state of the algorithm's reductions (each checked before anything changes).
    virtual std::function<void(comm::StateReader&)> read_rest(comm::StateReader& in) = 0;
    /// The shared part of that state (save_state(out, StatePart::shared)); by default none can
    /// be split off: comm::Error naming the algorithm.
    virtual void save_shared_rest(comm::StateWriter& out);
    virtual std::function<void(comm::StateReader&)> read_shared_rest(comm::StateReader& in);
  };

  /// An Algorithm whose synchronisation lands whole after every `period()`-th inner step (DiLoCo,
  /// SparseLoCo): it adds what that synchronisation does, and land_missed_sync() is refused after
  /// any other step.
  struct PeriodicAlgorithm : Algorithm {
    /// h, the inner steps from one synchronisation to the next.
    virtual int period() const = 0;
    /// The outer step (it takes the model's lock), after which every rank continues from the
    /// global weights.
    virtual void synchronise() = 0;
    void after_step(int64_t t) override;
    void land_missed(int64_t t) override;
  };

  explicit LocalUpdateModule(std::unique_ptr<Algorithm> algorithm);
  std::unique_ptr<Algorithm> algorithm_;
};

}  // namespace troupe
