#include "ddp/gradient_path/nccl_order.h"

namespace troupe {

void NcclOrder::submit(int index, std::function<void()> issue) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (released_) {
    issue();
    return;
  }
  waiting_[index] = std::move(issue);
  // Issue every bucket whose turn has come; the round starts over after the last bucket.
  for (auto it = waiting_.find(next_); it != waiting_.end(); it = waiting_.find(next_)) {
    auto fn = std::move(it->second);
    waiting_.erase(it);
    next_ = next_ + 1 == buckets_ ? 0 : next_ + 1;
    fn();
  }
}

void NcclOrder::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  released_ = true;
  for (auto& [index, fn] : waiting_) fn();
  waiting_.clear();
}

}  // namespace troupe
