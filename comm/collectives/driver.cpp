#include "comm/collectives/driver.h"

#include <string>

namespace troupe::comm {

namespace {

using Clock = std::chrono::steady_clock;

std::string timeout_message(const Execution& execution, const Transport& transport,
                            std::chrono::milliseconds timeout, const std::vector<int>& peers) {
  std::string ranks;
  for (int p : peers) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
  return execution.name() + " on rank " + std::to_string(transport.rank()) + " timed out after " +
         std::to_string(timeout.count()) + " ms waiting for rank(s) " +
         (ranks.empty() ? "(none)" : ranks);
}

// After a timeout has failed the waited-on peers, their operations complete soon; this long at
// most is spent waiting for them.
constexpr auto kDrainGrace = std::chrono::seconds(10);

}  // namespace

Status BlockingDriver::run(Schedule schedule, uint32_t key,
                           const std::shared_ptr<Transport>& transport,
                           std::chrono::milliseconds timeout) {
  if (transport->serial_callbacks()) {
    auto lock = inline_lock_;
    auto execution = std::make_shared<Execution>(
        transport, key, std::move(schedule), [lock](std::function<void()> fn) {
          std::lock_guard<std::mutex> guard(*lock);
          fn();
        });
    return run_inline(execution, *transport, timeout);
  }
  std::weak_ptr<Queue> weak = queue_;
  auto execution = std::make_shared<Execution>(
      transport, key, std::move(schedule), [weak](std::function<void()> fn) {
        auto q = weak.lock();
        if (!q) return;
        {
          std::lock_guard<std::mutex> guard(q->mutex);
          q->items.push_back(std::move(fn));
        }
        q->ready.notify_one();
      });
  return run_queued(execution, *transport, timeout);
}

Status BlockingDriver::run_queued(const std::shared_ptr<Execution>& execution,
                                  Transport& transport, std::chrono::milliseconds timeout) {
  auto drain_until = [&](Clock::time_point deadline) {
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
  };
  execution->start();
  if (drain_until(Clock::now() + timeout)) return execution->status();
  auto peers = execution->waiting_on();
  std::string why = timeout_message(*execution, transport, timeout, peers);
  for (int p : peers) transport.fail_peer(p, why);
  drain_until(Clock::now() + kDrainGrace);
  return Status::failure(why, peers.empty() ? -1 : peers.front());
}

Status BlockingDriver::run_inline(const std::shared_ptr<Execution>& execution,
                                  Transport& transport, std::chrono::milliseconds timeout) {
  auto q = queue_;
  {
    std::lock_guard<std::mutex> guard(q->mutex);
    q->done = false;
  }
  execution->on_done([q](const Status&) {
    {
      std::lock_guard<std::mutex> guard(q->mutex);
      q->done = true;
    }
    q->ready.notify_one();
  });
  {
    std::lock_guard<std::mutex> guard(*inline_lock_);
    execution->start();
  }
  auto wait_until = [&](Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(q->mutex);
    return q->ready.wait_until(lock, deadline, [&] { return q->done; });
  };
  if (wait_until(Clock::now() + timeout)) return execution->status();
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> guard(*inline_lock_);
    peers = execution->waiting_on();
  }
  std::string why = timeout_message(*execution, transport, timeout, peers);
  for (int p : peers) transport.fail_peer(p, why);
  wait_until(Clock::now() + kDrainGrace);
  return Status::failure(why, peers.empty() ? -1 : peers.front());
}

}  // namespace troupe::comm
