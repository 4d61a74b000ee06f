#include "comm/collectives/schedule.h"

#include <algorithm>

namespace troupe::comm {

Post locked_post(std::shared_ptr<std::mutex> lock) {
  return [lock = std::move(lock)](std::function<void()> fn) {
    std::lock_guard<std::mutex> guard(*lock);
    fn();
  };
}

char* Schedule::allocate(size_t bytes) {
  scratch.emplace_back(new char[bytes ? bytes : 1]);
  return scratch.back().get();
}

Execution::Execution(std::shared_ptr<Transport> transport, uint32_t key, Schedule schedule,
                     Post post)
    : transport_(std::move(transport)),
      key_(key),
      schedule_(std::move(schedule)),
      post_(std::move(post)) {}

Execution::Execution(std::shared_ptr<Transport> transport, std::vector<Stage> stages, Post post)
    : transport_(std::move(transport)),
      key_(0),
      stages_(std::move(stages)),
      post_(std::move(post)) {}

void Execution::start() {
  // With stages, schedule_ starts empty: finish_if_idle() builds the first stage.
  if (!stages_.empty())
    finish_if_idle();
  else
    begin_schedule();
}

void Execution::begin_schedule() {
  const size_t n = schedule_.lanes.size();
  next_step_.assign(n, 0);
  lane_pending_.assign(n, 0);
  peers_.assign(n, {});
  lanes_running_ = n;
  for (size_t lane = 0; lane < n; ++lane) post_step(lane);
  finish_if_idle();
}

void Execution::post_step(size_t lane) {
  auto& steps = schedule_.lanes[lane];
  // Skip steps with no operations, running their local work directly.
  while (next_step_[lane] < steps.size() && steps[next_step_[lane]].ops.empty()) {
    if (status_.ok() && steps[next_step_[lane]].then) steps[next_step_[lane]].then();
    ++next_step_[lane];
  }
  if (next_step_[lane] >= steps.size() || !status_.ok()) {
    --lanes_running_;
    return;
  }
  const Step& step = steps[next_step_[lane]];
  lane_pending_[lane] = step.ops.size();
  peers_[lane].assign(step.ops.size(), -1);
  for (size_t i = 0; i < step.ops.size(); ++i) peers_[lane][i] = step.ops[i].peer;
  auto transport = transport_.lock();
  if (!transport) {
    // Its owners let the transport go, which ended everything that was in flight.
    --lanes_running_;
    if (status_.ok()) {
      status_ = Status::failure(schedule_.name + " failed: the transport was shut down");
      if (on_failure_) on_failure_(status_);
    }
    return;
  }
  in_flight_ += step.ops.size();
  const Tag base = tags::tag_of(key_);
  for (size_t slot = 0; slot < step.ops.size(); ++slot) {
    const Op& op = step.ops[slot];
    // The callback may run on another thread at once; it only posts back to the driver.
    auto self = shared_from_this();
    Callback cb = [self, lane, slot](const Status& s) {
      self->post_([self, lane, slot, s] { self->complete(lane, slot, s); });
    };
    if (op.kind == Op::Kind::send)
      transport->send(op.peer, base | op.sub, op.buffer, op.bytes, std::move(cb));
    else
      transport->recv(op.peer, base | op.sub, op.buffer, op.bytes, std::move(cb));
  }
}

void Execution::complete(size_t lane, size_t slot, const Status& status) {
  --in_flight_;
  --lane_pending_[lane];
  peers_[lane][slot] = -1;
  if (!status.ok() && status_.ok()) {
    status_ = Status::failure(schedule_.name + " failed: " + status.message(), status.peer());
    if (on_failure_) on_failure_(status_);
  }
  if (lane_pending_[lane] == 0) {
    auto& step = schedule_.lanes[lane][next_step_[lane]];
    if (status_.ok() && step.then) step.then();
    ++next_step_[lane];
    post_step(lane);
  }
  finish_if_idle();
}

void Execution::abort(const Status& status) {
  if (done_ || !status_.ok()) return;
  status_ = Status::failure(schedule_.name + " failed: " + status.message(), status.peer());
  if (on_failure_) on_failure_(status_);
}

void Execution::finish_if_idle() {
  if (done_ || lanes_running_ > 0 || in_flight_ > 0) return;
  if (status_.ok() && schedule_.finally) schedule_.finally();
  if (status_.ok() && next_stage_ < stages_.size()) {
    Stage& stage = stages_[next_stage_++];
    earlier_sent_ = bytes_sent();
    earlier_received_ = bytes_received();
    try {
      schedule_ = stage.build();
      key_ = stage.key;
      begin_schedule();
      return;
    } catch (const std::exception& e) {
      status_ =
          Status::failure("stage " + std::to_string(next_stage_ - 1) + " failed: " + e.what());
      schedule_ = Schedule{};
      if (on_failure_) on_failure_(status_);
    }
  }
  done_ = true;
  if (on_done_) on_done_(status_);
}

namespace {
size_t bytes_of(const Schedule& schedule, Op::Kind kind) {
  size_t n = 0;
  for (auto& lane : schedule.lanes)
    for (auto& step : lane)
      for (auto& op : step.ops)
        if (op.kind == kind) n += op.bytes;
  return n;
}
}  // namespace

size_t Execution::bytes_sent() const { return earlier_sent_ + bytes_of(schedule_, Op::Kind::send); }
size_t Execution::bytes_received() const {
  return earlier_received_ + bytes_of(schedule_, Op::Kind::recv);
}

std::vector<int> Execution::waiting_on() const {
  std::vector<int> peers;
  for (auto& lane : peers_)
    for (int p : lane)
      if (p >= 0) peers.push_back(p);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

}  // namespace troupe::comm
