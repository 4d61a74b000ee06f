#pragma once
/// A bucket: the actor that reduces one flat gradient buffer of a DistributedModule.
///
/// Autograd hooks send it one ready message per parameter whose gradient has been accumulated into
/// the buffer; the moment it has them all it asks its BucketPath to reduce the buffer, while
/// backward goes on with earlier layers. When the path says the reduction has ended, the bucket
/// records its statistics and tells the reducer. It knows nothing of how the buffer is reduced:
/// its module chose one gradient path for all its buckets (ddp/gradient_path.h), and each
/// bucket holds its share of it.
///
/// The code above the actors holds a Bucket, a handle whose calls are the bucket's messages; the
/// actor behind it is typed (bucket_actor), so a message it does not take is a compile error.
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/execution_post.h"
#include "comm/status.h"

namespace troupe::comm {
class Reduction;
}

namespace troupe::actors {

/// One bucket's share of its module's gradient path: how this bucket's buffer is reduced. A path
/// (ddp/gradient_path/) makes one per bucket; the bucket actor calls it, always on its own
/// thread, and hands it its thread (`self`), to which the path posts the work that must run there.
class BucketPath {
 public:
  /// How a reduction ends: its status and the bytes this rank moved (sent to other ranks or
  /// written into their memory, and received or read). Called once per reduce(), from any thread.
  using Done =
      std::function<void(const comm::Status& status, size_t bytes_sent, size_t bytes_received)>;

  virtual ~BucketPath() = default;
  /// Starts the reduction of training step `step`: every rank's buffer becomes the sum over ranks
  /// divided by `denominator` (1: the plain sum). May throw; nothing is then in flight.
  virtual void reduce(const ActorThread& self, uint32_t step, double denominator, Done done) = 0;
  /// A rank died: fail what is in flight (at once, or after a grace for what live peers may still
  /// deliver). Called once.
  virtual void abort(const ActorThread& self, const comm::Status& why) = 0;
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

/// Where a bucket reports each step: (bucket_done_atom, index, step, ok, error, peer).
using bucket_sink_actor =
    caf::typed_actor<caf::reacts_to<bucket_done_atom, int, uint32_t, bool, std::string, int>>;

/// A bucket's messages (actors/atoms.h): ready_atom and launch_atom start a step's reduction;
/// abort_atom fails it; run_atom runs the path's posted work; progress_atom is answered with
/// (bucket_state_atom, index, launched, ready, waiting).
using bucket_actor = caf::typed_actor<
    caf::reacts_to<ready_atom, uint32_t, double>, caf::reacts_to<launch_atom, uint32_t, double>,
    caf::reacts_to<run_atom, std::function<void()>>, caf::reacts_to<abort_atom, std::string, int>,
    caf::replies_to<progress_atom>::with<bucket_state_atom, int, bool, int, std::vector<int>>>;

class Bucket {
 public:
  Bucket() = default;
  /// Bucket `index` of its module, full after `parameters` ready messages, reduced by `path`,
  /// reporting to `reducer`; `stats` is written before each report.
  static Bucket spawn(caf::actor_system& system, int index, int parameters,
                      std::shared_ptr<BucketPath> path, bucket_sink_actor reducer,
                      std::shared_ptr<BucketStats> stats);

  /// One parameter has its gradient in the buffer, for step `step`, whose sum over ranks is to be
  /// divided by `denominator`; the last one starts the reduction.
  void ready(uint32_t step, double denominator) const;
  /// Starts the step's reduction now, whether every parameter was ready or not.
  void launch(uint32_t step, double denominator) const;
  /// Rank `peer` died (`reason`): fail what is in flight, and every later step.
  void abort(const std::string& reason, int peer) const;
  /// Ends the actor (what is in flight is dropped).
  void stop() const;

  explicit operator bool() const { return static_cast<bool>(actor_); }
  const bucket_actor& actor() const { return actor_; }

 private:
  explicit Bucket(bucket_actor actor) : actor_(std::move(actor)) {}
  bucket_actor actor_;
};

}  // namespace troupe::actors

// The reducer is told its buckets' handles in a message, within the process.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::vector<troupe::actors::bucket_actor>)
