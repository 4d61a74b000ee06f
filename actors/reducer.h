#pragma once
/// The reducer: one per DistributedModule; knows when every bucket of a step is done.
///
/// Buckets report to it (bucket_done_atom); the trainer asks it (await_atom) to be woken when the
/// step's last bucket is done, and it answers (step_done_atom, step, ok, error). It reports a
/// failed bucket at once, and a stall (a bucket not done after the stall timeout) with the bucket,
/// whether it ever started, and the ranks it waits for (it asks each with progress_atom) — never
/// a hang.
#include <caf/fwd.hpp>

#include <memory>
#include <string>
#include <vector>

#include "actors/bucket.h"

namespace troupe::actors {

caf::actor spawn_reducer(caf::actor_system& system, int buckets);

/// Tells the reducer its buckets (after they are spawned) and the names of their parameters, for
/// stall reports.
void set_buckets(const caf::actor& reducer, const std::vector<caf::actor>& buckets,
                 const std::vector<std::vector<std::string>>& names,
                 const std::vector<int>& expected);

}  // namespace troupe::actors
