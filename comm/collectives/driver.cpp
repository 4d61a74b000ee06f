#include "comm/collectives/driver.h"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "comm/timeout_setting.h"

namespace troupe::comm {

namespace {

using Clock = std::chrono::steady_clock;

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text.empty() ? "(none)" : text;
}

// After a timeout, how long a rank waits for its peers to answer a reachability probe: a quarter
// of the collective's deadline, at least 0.5 s (a loaded host's progress thread) and at most 5 s
// (the error should not wait much past its deadline). A probe's answer takes one round trip.
std::chrono::milliseconds probe_window(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::milliseconds(500),
                                               std::chrono::seconds(5));
}

// What probing every other rank found: who answered, and who did not within the window.
struct Reachability {
  bool probed = false;  // the transport can probe
  std::vector<int> silent;
  std::chrono::milliseconds window{0};
};

// Probes every other rank at once and waits until all answered or the window passed. Run before
// this rank fails anyone: a peer it failed could no longer answer it, nor it the peer. A peer that
// was failed earlier answers at once with a failure and is not counted as silent (its death was
// reported already).
Reachability probe_peers(Transport& transport, std::chrono::milliseconds window) {
  Reachability found;
  if (!transport.can_probe() || transport.world_size() < 2) return found;
  found.probed = true;
  found.window = window;
  struct Answers {
    std::mutex mutex;
    std::condition_variable ready;
    std::vector<char> answered;
    int left = 0;
  };
  auto answers = std::make_shared<Answers>();
  answers->answered.assign(static_cast<size_t>(transport.world_size()), 0);
  answers->left = transport.world_size() - 1;
  for (int peer = 0; peer < transport.world_size(); ++peer) {
    if (peer == transport.rank()) continue;
    // A probe left unanswered may call back long after this returns: it holds `answers`.
    transport.probe(peer, [answers, peer](const Status&) {
      {
        std::lock_guard<std::mutex> guard(answers->mutex);
        if (answers->answered[static_cast<size_t>(peer)]) return;
        answers->answered[static_cast<size_t>(peer)] = 1;
        --answers->left;
      }
      answers->ready.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(answers->mutex);
  answers->ready.wait_for(lock, window, [&] { return answers->left == 0; });
  for (int peer = 0; peer < transport.world_size(); ++peer)
    if (peer != transport.rank() && !answers->answered[static_cast<size_t>(peer)])
      found.silent.push_back(peer);
  return found;
}

// A collective's timeout, and what the probes said: the rank(s) this rank cannot reach, which is
// the cause an operator looks for, rather than only the neighbour it waited for (after a cut link
// most ranks wait for a healthy neighbour that waits behind the cut).
std::string timeout_message(const Execution& execution, const Transport& transport,
                            std::chrono::milliseconds timeout, const std::vector<int>& waiting,
                            const Reachability& reach) {
  const std::string head = execution.name() + " on rank " + std::to_string(transport.rank()) +
                           " timed out after " + std::to_string(timeout.count()) + " ms";
  const std::string window = std::to_string(reach.window.count()) + " ms";
  if (!reach.probed) return head + " waiting for rank(s) " + rank_list(waiting) + kTimeoutSetting;
  if (reach.silent.empty())
    return head + " waiting for rank(s) " + rank_list(waiting) +
           " (every other rank answered a reachability probe within " + window +
           ": each one runs and its link carries messages, so the rank(s) waited for are slow, "
           "or wait for another rank that is)" +
           kTimeoutSetting;
  std::vector<int> behind;  // waited for, but answered: blocked like this rank
  for (int p : waiting)
    if (std::find(reach.silent.begin(), reach.silent.end(), p) == reach.silent.end())
      behind.push_back(p);
  std::string text = head + ": rank(s) " + rank_list(reach.silent) +
                     " cannot be reached from rank " + std::to_string(transport.rank()) +
                     " (no answer to a reachability probe within " + window;
  if (transport.world_size() > 2 &&
      static_cast<int>(reach.silent.size()) == transport.world_size() - 1)
    text +=
        ": no other rank answers, so this rank's own link is likely down, or this process was "
        "stopped";
  else
    text += ": a link down, or a process stopped or gone";
  text += ")";
  if (!behind.empty())
    text += "; rank(s) " + rank_list(behind) + ", which this rank waited for, answered: " +
            "they are blocked behind the unreachable rank(s)";
  return text + kTimeoutSetting;
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

Status BlockingDriver::run_made(const std::shared_ptr<Transport>& transport,
                                std::chrono::milliseconds timeout,
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
  int cause = waiting.empty() ? -1 : waiting.front();
  if (why.empty()) {
    // Timed out with no failure: find whom this rank cannot reach before failing anyone.
    const Reachability reach = probe_peers(transport, probe_window(timeout));
    waiting = peers();
    why = timeout_message(*execution, transport, timeout, waiting, reach);
    if (!reach.silent.empty()) cause = reach.silent.front();
    // An unreachable rank is failed too, waited for or not: what this rank still has with it
    // (its unanswered probe included) ends now, and later operations with it fail at once.
    for (int p : reach.silent)
      if (std::find(waiting.begin(), waiting.end(), p) == waiting.end())
        transport.fail_peer(p, why);
  }
  for (int p : waiting) transport.fail_peer(p, why);
  // Until every failed operation has ended, not merely the first: one still running could write
  // into the caller's buffers after the return.
  const auto drained = Clock::now() + kDrainGrace;
  do {
    std::tie(done, failed) = wait(drained);
  } while (!done && Clock::now() < drained);
  if (done && !execution->status().ok()) return execution->status();
  return Status::failure(why, cause);
}

Status BlockingDriver::run_queued(const std::shared_ptr<Execution>& execution, Transport& transport,
                                  std::chrono::milliseconds timeout) {
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

Status BlockingDriver::run_inline(const std::shared_ptr<Execution>& execution, Transport& transport,
                                  std::chrono::milliseconds timeout) {
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
