#pragma once
/// EventWatcher: a thread that waits for CUDA events and calls back when each has completed, so
/// that an actor can start the next stage of its work when the GPU's part is done without blocking
/// a thread in cudaEventSynchronize (which has no deadline).
///
/// Used by the host staging of CUDA buckets (ddp/staging.h): "the gradients have been copied to
/// pinned memory" and "the reduced bucket is back on the device" are events it watches.
///
/// The thread sleeps on a condition variable while nothing is watched; while events are pending it
/// queries them (cudaEventQuery), sleeping between rounds from 10 us up to 1 ms as nothing
/// completes. Every watched event has a deadline: when it passes, the callback gets an error naming
/// the event's description and the timeout. Callbacks run on the watcher's thread and must be
/// short (send a message, post work); they must not hold the last reference to the watcher.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace troupe::cuda {

class EventWatcher {
 public:
  /// Called once per watched event: an empty error when it completed, otherwise why not.
  using Done = std::function<void(const std::string& error)>;

  /// The thread queries events of `device` (it makes the device current on its thread).
  explicit EventWatcher(int device);
  /// Fails every event still watched ("the watcher stopped"), then joins the thread.
  ~EventWatcher();
  EventWatcher(const EventWatcher&) = delete;
  EventWatcher& operator=(const EventWatcher&) = delete;

  /// Calls `done` once `event` (recorded before this call) has completed, or with an error naming
  /// `what` when it has not within `timeout`, or when CUDA reports an error for it.
  void watch(void* event, std::string what, std::chrono::milliseconds timeout, Done done);

  int device() const { return device_; }

 private:
  struct Entry {
    void* event;
    std::string what;
    std::chrono::milliseconds timeout;
    std::chrono::steady_clock::time_point deadline;
    Done done;
  };
  void loop();

  int device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> incoming_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace troupe::cuda
