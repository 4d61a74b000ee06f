#include "comm/collectives/driver.h"

#include <string>

namespace troupe::comm {

BlockingDriver::BlockingDriver() : queue_(std::make_shared<Queue>()) {}

Post BlockingDriver::post() {
  std::weak_ptr<Queue> weak = queue_;
  return [weak](std::function<void()> fn) {
    auto q = weak.lock();
    if (!q) return;
    {
      std::lock_guard<std::mutex> lock(q->mutex);
      q->items.push_back(std::move(fn));
    }
    q->ready.notify_one();
  };
}

bool BlockingDriver::drain_until(const std::shared_ptr<Execution>& execution,
                                 std::chrono::steady_clock::time_point deadline) {
  std::deque<std::function<void()>> batch;
  while (!execution->done()) {
    {
      std::unique_lock<std::mutex> lock(queue_->mutex);
      if (!queue_->ready.wait_until(lock, deadline, [&] { return !queue_->items.empty(); }))
        return false;
      batch.swap(queue_->items);
    }
    for (auto& fn : batch) fn();
    batch.clear();
  }
  return true;
}

Status BlockingDriver::run(const std::shared_ptr<Execution>& execution, Transport& transport,
                           std::chrono::milliseconds timeout) {
  execution->start();
  if (drain_until(execution, std::chrono::steady_clock::now() + timeout))
    return execution->status();
  std::vector<int> peers = execution->waiting_on();
  std::string ranks;
  for (int p : peers) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
  std::string why = execution->name() + " on rank " + std::to_string(transport.rank()) +
                    " timed out after " + std::to_string(timeout.count()) +
                    " ms waiting for rank(s) " + (ranks.empty() ? "(none)" : ranks);
  for (int p : peers) transport.fail_peer(p, why);
  // The failed operations now complete; wait for them so no buffer is still in use on return.
  drain_until(execution, std::chrono::steady_clock::now() + std::chrono::seconds(10));
  return Status::failure(why, peers.empty() ? -1 : peers.front());
}

}  // namespace troupe::comm
