#pragma once
/// The order in which the NCCL path issues its buckets' reductions.
#include <functional>
#include <map>
#include <mutex>

namespace troupe {

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

}  // namespace troupe
