#pragma once
/// BlockingDriver: runs one collective to its end while the calling thread waits, with a deadline.
///
/// Used by Communicator's blocking collectives (tests, benchmarks, the rendezvous barrier, a
/// trainer's own thread). Two ways of running, chosen by the transport:
/// - queued: transport callbacks hand closures to a queue that the calling thread works off; the
///   caller's thread does the reductions (any transport; inproc, whose callbacks run on the ranks'
///   own threads).
/// - inline: when the transport has serial_callbacks() (UCX: one progress thread), the work runs
///   in the callbacks themselves, under a lock, and the caller only waits for the end. This saves a
///   thread wake-up per step, which on a 2-core machine is most of a small collective's latency.
/// Actors drive executions themselves and never block.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "comm/collectives/schedule.h"

namespace troupe::comm {

class BlockingDriver {
 public:
  /// Runs `schedule` under `key` on `transport` until it ends or `timeout` passes. On timeout every
  /// peer it still waits on is failed on the transport (so pending operations end and no buffer is
  /// written after the return), and the status names the collective, the timeout and those ranks.
  /// When an operation fails (a dead peer), operations in flight with live peers get a short grace
  /// to finish (those peers stop too) before they are failed the same way.
  Status run(Schedule schedule, uint32_t key, const std::shared_ptr<Transport>& transport,
             std::chrono::milliseconds timeout);
  /// Runs the stages of a multi-stage operation (schedule.h) the same way.
  Status run(std::vector<Stage> stages, const std::shared_ptr<Transport>& transport,
             std::chrono::milliseconds timeout);
  /// Fails the collective running now, if any (from any thread): it posts nothing more, and what
  /// it has in flight gets the failure grace, as when one of its own operations fails.
  void abort(const Status& status);
  /// What the last run() sent and received, in bytes (on this rank).
  size_t last_bytes_sent() const { return last_sent_; }
  size_t last_bytes_received() const { return last_received_; }

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<std::function<void()>> items;
    bool done = false;
    bool failed = false;
  };
  Status run_made(const std::shared_ptr<Transport>& transport, std::chrono::milliseconds timeout,
                  const std::function<std::shared_ptr<Execution>(Post)>& make);
  Status run_queued(const std::shared_ptr<Execution>& execution, Transport& transport,
                    std::chrono::milliseconds timeout);
  Status run_inline(const std::shared_ptr<Execution>& execution, Transport& transport,
                    std::chrono::milliseconds timeout);
  std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  std::mutex current_mutex_;
  std::shared_ptr<Execution> current_;
  Post current_post_;
  std::shared_ptr<std::mutex> inline_lock_ = std::make_shared<std::mutex>();
  size_t last_sent_ = 0;
  size_t last_received_ = 0;
};

}  // namespace troupe::comm
