#pragma once
/// BlockingDriver: runs an Execution to its end on the calling thread, with a deadline.
///
/// Used by Communicator's blocking collectives (tests, benchmarks, the rendezvous barrier). Actors
/// drive executions themselves (actors/collective_runner.h) and never block.
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
  BlockingDriver();
  /// The Post for executions this driver runs; safe to call from any thread, even after run().
  Post post();
  /// Starts `execution` and processes its completions until it ends or `timeout` passes. On timeout
  /// every peer it still waits on is failed on the transport (so pending operations end), and the
  /// returned status names the collective, the timeout and those ranks.
  Status run(const std::shared_ptr<Execution>& execution, Transport& transport,
             std::chrono::milliseconds timeout);

  struct Queue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<std::function<void()>> items;
  };

 private:
  bool drain_until(const std::shared_ptr<Execution>& execution,
                   std::chrono::steady_clock::time_point deadline);
  std::shared_ptr<Queue> queue_;
};

}  // namespace troupe::comm
