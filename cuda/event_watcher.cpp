#include "cuda/event_watcher.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

#include "cuda/stream.h"

namespace troupe::cuda {

namespace {
constexpr auto kFirstPause = std::chrono::microseconds(10);
constexpr auto kLongestPause = std::chrono::microseconds(1000);
}  // namespace

EventWatcher::EventWatcher(int device) : device_(device) {
  thread_ = std::thread([this] { loop(); });
}

EventWatcher::~EventWatcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void EventWatcher::watch(void* event, std::string what, std::chrono::milliseconds timeout,
                         Done done) {
  if (event == nullptr)
    throw std::invalid_argument("troupe::cuda::EventWatcher::watch: event for '" + what +
                                "' is null (expected an event made by create_event)");
  Entry entry{event, std::move(what), timeout, std::chrono::steady_clock::now() + timeout,
              std::move(done)};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stop_) {
      incoming_.push_back(std::move(entry));
      wake_.notify_all();
      return;
    }
  }
  entry.done("'" + entry.what + "': the CUDA event watcher has stopped");
}

void EventWatcher::loop() {
  std::string device_error;
  try {
    if (device_ >= 0) set_device(device_);
  } catch (const std::exception& e) {
    device_error = e.what();
  }
  std::vector<Entry> watched;
  auto pause = kFirstPause;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (watched.empty() && incoming_.empty())
      wake_.wait(lock, [&] { return stop_ || !incoming_.empty(); });
    const bool stopping = stop_;
    for (auto& e : incoming_) watched.push_back(std::move(e));
    incoming_.clear();
    lock.unlock();

    // Query outside the lock; collect the finished ones and call them back in order.
    std::vector<std::pair<Done, std::string>> finished;
    const auto now = std::chrono::steady_clock::now();
    for (auto it = watched.begin(); it != watched.end();) {
      std::string error;
      bool over = true;
      if (stopping) {
        error = "'" + it->what + "': the CUDA event watcher stopped before it completed";
      } else if (!device_error.empty()) {
        error = "'" + it->what + "': " + device_error;
      } else {
        try {
          over = event_done(it->event);
        } catch (const std::exception& e) {
          error = "'" + it->what + "': " + e.what();
        }
        if (!over && now >= it->deadline) {
          over = true;
          error = "'" + it->what + "' did not complete within " +
                  std::to_string(it->timeout.count()) + " ms";
        }
      }
      if (over) {
        finished.emplace_back(std::move(it->done), std::move(error));
        it = watched.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [done, error] : finished) done(error);
    if (stopping && watched.empty()) {
      lock.lock();
      if (incoming_.empty()) return;
      continue;
    }
    pause = finished.empty() ? std::min<std::chrono::microseconds>(pause * 2, kLongestPause)
                             : kFirstPause;
    lock.lock();
    if (!watched.empty()) wake_.wait_for(lock, pause, [&] { return stop_ || !incoming_.empty(); });
  }
}

}  // namespace troupe::cuda
