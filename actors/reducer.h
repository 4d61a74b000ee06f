#pragma once
/// The reducer: one per DistributedModule; knows when every bucket of a step is done.
///
/// Buckets report to it (bucket_done_atom); the trainer asks it (await_atom) to be woken when the
/// step's last bucket is done, and it answers (step_done_atom, step, ok, error). It reports a
/// failed bucket at once, and a stall (a bucket not done after the stall timeout) with the bucket,
/// whether it ever started, and the ranks it waits for (it asks each with progress_atom) — never
/// a hang. The trainer holds a Reducer, a handle on the typed actor (reducer_actor).
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "actors/bucket.h"

namespace troupe::actors {

/// The reducer's messages: a bucket's report, its buckets (setup_atom, handles, parameter names,
/// parameters per bucket), the trainer's waits (await_atom, step, stall_ms[, buckets]) and its
/// own stall timer.
using reducer_actor = bucket_sink_actor::extend<
    caf::reacts_to<setup_atom, std::vector<bucket_actor>, std::vector<std::vector<std::string>>,
                   std::vector<int>>,
    caf::replies_to<await_atom, uint32_t, int64_t>::with<step_done_atom, uint32_t, bool,
                                                         std::string>,
    caf::replies_to<await_atom, uint32_t, int64_t, std::vector<int>>::with<step_done_atom, uint32_t,
                                                                           bool, std::string>,
    caf::reacts_to<stall_atom>>;

/// How a wait for a step ended: ok, or why not (a failed bucket, a stall report, no reducer).
struct StepResult {
  bool ok = false;
  std::string error;
};

class Reducer {
 public:
  Reducer() = default;
  /// The reducer of a module of `buckets` buckets.
  static Reducer spawn(caf::actor_system& system, int buckets);

  /// Where the buckets report.
  bucket_sink_actor sink() const;
  /// Tells it its buckets (once they are spawned) and the names of their parameters, for stall
  /// reports.
  void set_buckets(const std::vector<Bucket>& buckets,
                   const std::vector<std::vector<std::string>>& names,
                   const std::vector<int>& expected) const;
  /// Blocks until reduction `step` of the buckets `wanted` has ended (empty: all of them, which
  /// ends the step), or failed, or stalled for `stall` (the answer then says where each bucket
  /// stands).
  StepResult await(uint32_t step, std::chrono::milliseconds stall,
                   const std::vector<int>& wanted) const;
  /// Ends the actor.
  void stop();

  explicit operator bool() const { return static_cast<bool>(actor_); }
  const reducer_actor& actor() const { return actor_; }

 private:
  explicit Reducer(reducer_actor actor) : actor_(std::move(actor)) {}
  reducer_actor actor_;
};

}  // namespace troupe::actors
