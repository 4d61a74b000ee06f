#include "comm/collectives/driver.h"

#include <string>
#include <tuple>
#include <utility>

#include "comm/timeout_setting.h"

namespace troupe::comm {

namespace {

using Clock = std::chrono::steady_clock;

std::string timeout_message(const Execution& execution, const Transport& transport,
                            std::chrono::milliseconds timeout, const std::vector<int>& peers) {
  std::string ranks;
  for (int p : peers) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
  return execution.name() + " on rank " + std::to_string(transport.rank()) + " timed out after " +
         std::to_string(timeout.count()) + " ms waiting for rank(s) " +
         (ranks.empty() ? "(none)" : ranks) + kTimeoutSetting;
}

// Once an operation has failed (a peer died), the other ranks stop too; operations already
// matched with them finish within this time. Whatever is still in flight then is failed on the
// transport, so that no peer reads from or writes to the caller's buffers after the return.
constexpr auto kFailureGrace = std::chrono::milliseconds(1000);
// After operations were failed on the transport, they complete within this time.
constexpr auto kDrainGrace = std::chrono::seconds(10);

}  // namespace

Status BlockingDriver::run(Schedule schedule, uint32_t key,
                           const std::shared_ptr<Transport>& transport,
                           std::chrono::milliseconds timeout) {
  return run_made(transport, timeout, [&](Post post) {
    return std::make_shared<Execution>(transport, key, std::move(schedule), std::move(post));
  });
}

Status BlockingDriver::run(std::vector<Stage> stages, const std::shared_ptr<Transport>& transport,
                           std::chrono::milliseconds timeout) {
  return run_made(transport, timeout, [&](Post post) {
    return std::make_shared<Execution>(transport, std::move(stages), std::move(post));
  });
}

Status BlockingDriver::run_made(
    const std::shared_ptr<Transport>& transport, std::chrono::milliseconds timeout,
    const std::function<std::shared_ptr<Execution>(Post)>& make) {
  Post post;
  if (transport->serial_callbacks()) {
    post = locked_post(inline_lock_);
  } else {
    std::weak_ptr<Queue> weak = queue_;
    post = [weak](std::function<void()> fn) {
      auto q = weak.lock();
      if (!q) return;
      {
        std::lock_guard<std::mutex> guard(q->mutex);
        q->items.push_back(std::move(fn));
      }
      q->ready.notify_one();
    };
  }
  auto execution = make(post);
  {
    std::lock_guard<std::mutex> guard(current_mutex_);
    current_ = execution;
    current_post_ = post;
  }
  Status status = transport->serial_callbacks() ? run_inline(execution, *transport, timeout)
                                                : run_queued(execution, *transport, timeout);
  last_sent_ = execution->bytes_sent();
  last_received_ = execution->bytes_received();
  std::lock_guard<std::mutex> guard(current_mutex_);
  current_.reset();
  current_post_ = nullptr;
  return status;
}

void BlockingDriver::abort(const Status& status) {
  std::lock_guard<std::mutex> guard(current_mutex_);
  if (!current_) return;
  auto execution = current_;
  current_post_([execution, status] { execution->abort(status); });
}

// Waits for `execution` on the calling thread. `wait(deadline)` returns when the execution is done
// or has failed, or at the deadline; `peers()` reads whom it still waits on.
template <class Wait, class Peers>
Status finish(const std::shared_ptr<Execution>& execution, Transport& transport,
              std::chrono::milliseconds timeout, Wait wait, Peers peers) {
  auto [done, failed] = wait(Clock::now() + timeout);
  if (done) return execution->status();
  std::string why;
  if (failed) {
    std::tie(done, failed) = wait(Clock::now() + kFailureGrace);
    if (done) return execution->status();
    why = execution->status().message();
  }
  auto waiting = peers();
  if (why.empty()) why = timeout_message(*execution, transport, timeout, waiting);
  for (int p : waiting) transport.fail_peer(p, why);
  // Until every failed operation has ended, not merely the first: one still running could write
  // into the caller's buffers after the return.
  const auto drained = Clock::now() + kDrainGrace;
  do {
    std::tie(done, failed) = wait(drained);
  } while (!done && Clock::now() < drained);
  if (done && !execution->status().ok()) return execution->status();
  return Status::failure(why, waiting.empty() ? -1 : waiting.front());
}

Status BlockingDriver::run_queued(const std::shared_ptr<Execution>& execution,
                                  Transport& transport, std::chrono::milliseconds timeout) {
  bool failed = false;
  execution->on_failure([&failed](const Status&) { failed = true; });
  bool reported_failure = false;
  auto wait = [&](Clock::time_point deadline) {
    std::deque<std::function<void()>> batch;
    while (!execution->done()) {
      if (failed && !reported_failure) {
        reported_failure = true;
        return std::make_pair(false, true);
      }
      {
        std::unique_lock<std::mutex> lock(queue_->mutex);
        if (!queue_->ready.wait_until(lock, deadline, [&] { return !queue_->items.empty(); }))
          return std::make_pair(false, failed);
        batch.swap(queue_->items);
      }
      for (auto& fn : batch) fn();
      batch.clear();
    }
    return std::make_pair(true, failed);
  };
  execution->start();
  return finish(execution, transport, timeout, wait, [&] { return execution->waiting_on(); });
}

Status BlockingDriver::run_inline(const std::shared_ptr<Execution>& execution,
                                  Transport& transport, std::chrono::milliseconds timeout) {
  auto q = queue_;
  {
    std::lock_guard<std::mutex> guard(q->mutex);
    q->done = false;
    q->failed = false;
  }
  execution->on_done([q](const Status&) {
    {
      std::lock_guard<std::mutex> guard(q->mutex);
      q->done = true;
    }
    q->ready.notify_one();
  });
  execution->on_failure([q](const Status&) {
    {
      std::lock_guard<std::mutex> guard(q->mutex);
      q->failed = true;
    }
    q->ready.notify_one();
  });
  {
    std::lock_guard<std::mutex> guard(*inline_lock_);
    execution->start();
  }
  bool reported_failure = false;
  auto wait = [&](Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(q->mutex);
    q->ready.wait_until(lock, deadline,
                        [&] { return q->done || (q->failed && !reported_failure); });
    if (q->failed) reported_failure = true;
    return std::make_pair(q->done, q->failed);
  };
  return finish(execution, transport, timeout, wait, [&] {
    std::lock_guard<std::mutex> guard(*inline_lock_);
    return execution->waiting_on();
  });
}

}  // namespace troupe::comm
