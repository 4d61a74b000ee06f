#pragma once
/// A bucket: the actor that reduces one flat gradient buffer of a DistributedModule.
///
/// Autograd hooks send it one ready message per parameter whose gradient has been accumulated into
/// the buffer; the moment it has them all it asks its BucketPath to reduce the buffer, while
/// backward goes on with earlier layers. When the path says the reduction has ended, the bucket
/// records its statistics and tells the reducer. It knows nothing of how the buffer is reduced:
/// its module chose one gradient path for all its buckets (ddp/gradient_path.h), and each
/// bucket holds its share of it.
#include <caf/fwd.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/status.h"

namespace troupe::comm {
class Reduction;
}

namespace troupe::actors {

/// Issues the NCCL reductions of a module's buckets in bucket order, whatever order they fill in:
/// NCCL matches operations by the order ranks issue them, and buckets fill in different orders on
/// different ranks. Every bucket submits once per step.
class NcclOrder {
 public:
  explicit NcclOrder(int buckets) : buckets_(buckets) {}
  /// Runs `issue` (on this thread, or later on the thread that submits the bucket before it) once
  /// every bucket before `index` has been issued in this round.
  void submit(int index, std::function<void()> issue);
  /// After a failure: runs whatever waits, and from now on everything at once (the communicator
  /// is aborted, so the operations fail at once instead of waiting for their turn).
  void release();

 private:
  std::mutex mutex_;
  int buckets_;
  int next_ = 0;
  bool released_ = false;
  std::map<int, std::function<void()>> waiting_;
};

/// One bucket's share of its module's gradient path: how this bucket's buffer is reduced. A path
/// (ddp/gradient_path/) makes one per bucket; the bucket actor calls it, always on its own
/// thread, and hands it itself (`self`) so that the path can post work back to the actor as
/// (run_atom, closure) messages, which the actor runs on its thread.
class BucketPath {
 public:
  /// How a reduction ends: its status and the bytes this rank moved (sent to other ranks or
  /// written into their memory, and received or read). Called once per reduce(), from any thread.
  using Done =
      std::function<void(const comm::Status& status, size_t bytes_sent, size_t bytes_received)>;

  virtual ~BucketPath() = default;
  /// Starts the reduction of training step `step`: every rank's buffer becomes the sum over ranks
  /// divided by `denominator` (1: the plain sum). May throw; nothing is then in flight.
  virtual void reduce(const caf::actor& self, uint32_t step, double denominator, Done done) = 0;
  /// A rank died: fail what is in flight (at once, or after a grace for what live peers may still
  /// deliver). Called once.
  virtual void abort(const caf::actor& self, const comm::Status& why) = 0;
  /// At a stall, while a reduction has been started: the ranks it still waits for.
  virtual std::vector<int> waiting_on() = 0;
  /// The algorithm's state this bucket keeps across steps (comm::Reduction::save_state), for
  /// checkpoints; null for a path that keeps none (a plain allreduce on NCCL or shared memory).
  /// Touched only between steps, while no reduction runs.
  virtual comm::Reduction* reduction() { return nullptr; }
};

/// What one bucket did in one step, written by the bucket before it reports to the reducer (so the
/// trainer may read it once the reducer has answered).
struct BucketStats {
  uint32_t step = 0;
  int64_t ready_us = 0;  // all parameters ready, reduction starts (steady clock, microseconds)
  int64_t done_us = 0;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
  int ready = 0;                // ready messages counted this step
  std::vector<int> waiting_on;  // at a stall: the ranks the reduction waits for
};

/// Microseconds of the steady clock, the time base of BucketStats and traces.
int64_t now_us();

/// Bucket `index` of its module, full after `parameters` ready messages, reduced by `path`.
/// Messages (actors/atoms.h): ready_atom and launch_atom start a step's reduction; abort_atom fails
/// it; run_atom runs the path's posted work; progress_atom is answered with (bucket_state_atom,
/// index, launched, ready, waiting). It reports each step to `reducer` with bucket_done_atom.
caf::actor spawn_bucket(caf::actor_system& system, int index, int parameters,
                        std::shared_ptr<BucketPath> path, caf::actor reducer,
                        std::shared_ptr<BucketStats> stats);

}  // namespace troupe::actors
