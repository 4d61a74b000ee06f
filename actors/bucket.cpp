#include "actors/bucket.h"

#include <caf/all.hpp>

#include <functional>
#include <mutex>

#include "actors/atoms.h"
#include "actors/execution_post.h"
#include "comm/shm/local_allreduce.h"
#include "comm/collectives/schedule.h"
#ifdef TROUPE_HAVE_CUDA
#include "actors/staging.h"
#endif
#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/communicator.h"
#endif

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::function<void()>)

namespace troupe::actors {

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

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

struct BucketState {
  BucketPlan plan;
  ReduceSettings settings;
  std::shared_ptr<comm::Reduction> reduction;
  std::shared_ptr<comm::Transport> transport;
  caf::actor reducer;
  std::shared_ptr<BucketStats> stats;
  uint32_t step = 0;
  bool fresh = true;     // no message seen yet
  int ready = 0;
  bool launched = false;
  std::shared_ptr<comm::Execution> execution;
  // With a transport whose callbacks all run on its one thread (UCX), the execution runs there,
  // under this lock, instead of hopping to this actor for every step; elsewhere it runs here.
  std::shared_ptr<std::mutex> inline_lock;
  std::string broken;  // why the job is broken (a rank died); empty while it is not
  int broken_peer = -1;
  static inline const char* name = "troupe.bucket";
};

using Bucket = caf::stateful_actor<BucketState>;

void begin_step(Bucket* self, uint32_t step) {
  auto& st = self->state;
  if (!st.fresh && st.step == step) return;
  st.fresh = false;
  st.step = step;
  st.ready = 0;
  st.launched = false;
}

// Runs fn with the execution's lock held when it runs inline on the transport's thread.
template <class F>
void with_execution(Bucket* self, F&& fn) {
  if (self->state.inline_lock) {
    std::lock_guard<std::mutex> guard(*self->state.inline_lock);
    fn();
  } else {
    fn();
  }
}

// Ends a bucket's step: stamps its statistics and tells the reducer. Safe from any thread.
void report(int index, uint32_t step, BucketStats& stats, const caf::actor& reducer,
            const comm::Status& status) {
  stats.done_us = now_us();
  caf::anon_send(reducer, bucket_done_atom::value, index, step, status.ok(), status.message(),
                 status.peer());
}

// What the step multiplies the sum by: 1 / the denominator when averaging.
double step_scale(const ReduceSettings& settings, double divisor) {
  return settings.average ? 1.0 / divisor : 1.0;
}

// Runs the bucket's algorithm (its stages over the transport) on plan.data: the bucket itself,
// or a staged bucket's host mirror, which is copied back to the device before the bucket reports.
void start_execution(Bucket* self, double divisor) {
  auto& st = self->state;
  const auto& plan = st.plan;
  comm::ReduceStep step;
  step.group = comm::Group{st.transport->rank(), st.transport->world_size()};
  step.step = st.step;
  step.scale = step_scale(st.settings, divisor);
  step.divide_before = st.settings.divide_before;
  step.collectives = st.settings.collectives;
  auto builders = st.reduction->stages(step);
  std::vector<comm::Stage> stages;
  for (size_t i = 0; i < builders.size(); ++i)
    stages.push_back(comm::Stage{st.settings.key_prefix | (st.step & 0xfffu) << 16 |
                                     static_cast<uint32_t>(i) << 12 |
                                     static_cast<uint32_t>(plan.index),
                                 std::move(builders[i])});
  comm::Post post =
      execution_post(caf::actor_cast<caf::actor>(self), *st.transport, st.inline_lock);
  auto execution = std::make_shared<comm::Execution>(st.transport, std::move(stages), post);
  // Runs on whichever thread ends the execution: touches only what it captured.
  execution->on_done([index = plan.index, staging = plan.staging, step = st.step, stats = st.stats,
                      reducer = st.reducer, timeout = st.settings.device_timeout,
                      raw = execution.get()](const comm::Status& status) {
    stats->bytes_sent = raw->bytes_sent();
    stats->bytes_received = raw->bytes_received();
    if (!staging || !status.ok()) {
      report(index, step, *stats, reducer, status);
      return;
    }
#ifdef TROUPE_HAVE_CUDA
    try {
      staging->upload(timeout, [index, step, stats, reducer](const std::string& error) {
        report(index, step, *stats, reducer,
               error.empty() ? comm::Status::success() : comm::Status::failure(error));
      });
    } catch (const std::exception& e) {
      report(index, step, *stats, reducer,
             comm::Status::failure("bucket " + std::to_string(index) + ": " + e.what()));
    }
#else
    (void)timeout;
#endif
  });
  st.execution = execution;
  with_execution(self, [&] { execution->start(); });
}

// A CUDA bucket with NCCL: one allreduce on the communicator's stream, in bucket order.
void launch_nccl(Bucket* self, double divisor) {
  auto& st = self->state;
  const auto& plan = st.plan;
#ifdef TROUPE_HAVE_NCCL
  const int world = st.transport->world_size();
  const size_t bytes = plan.count * comm::element_size(plan.type);
  const size_t moved = world > 1 ? bytes * 2 * static_cast<size_t>(world - 1) / world : 0;
  comm::Callback done = [index = plan.index, step = st.step, stats = st.stats,
                         reducer = st.reducer, moved](const comm::Status& status) {
    stats->bytes_sent = moved;  // a ring's share; NCCL does not report what it moved
    stats->bytes_received = moved;
    report(index, step, *stats, reducer, status);
  };
  const bool scaled = st.settings.average && (st.settings.divide_before || divisor != world);
  const auto op = st.settings.average ? comm::ReduceOp::avg : comm::ReduceOp::sum;
  plan.nccl_order->submit(plan.index, [nccl = plan.nccl, data = plan.data, count = plan.count,
                                       type = plan.type, events = plan.ready_events, scaled, op,
                                       divisor, index = plan.index, done]() {
    auto communicator = nccl.lock();
    try {
      if (!communicator)
        throw comm::Error("bucket " + std::to_string(index) +
                          ": its module's NCCL communicator is gone");
      if (scaled) communicator->allreduce_scaled(data, data, count, type, 1.0 / divisor, events, done);
      else communicator->allreduce(data, data, count, type, op, events, done);
    } catch (const std::exception& e) {
      done(comm::Status::failure(e.what()));
    }
  });
#else
  (void)divisor;
  report(plan.index, st.step, *st.stats, st.reducer,
         comm::Status::failure("bucket " + std::to_string(plan.index) +
                               ": an NCCL bucket in a troupe built without NCCL"));
#endif
}

// A CPU bucket of a single-host job: through the ranks' shared memory.
void launch_local(Bucket* self, double divisor) {
  auto& st = self->state;
  const auto& plan = st.plan;
  // The same choice as the transport's reductions make from the step's scale.
  const auto how = comm::LocalReduce::scaled(step_scale(st.settings, divisor),
                                             st.settings.divide_before, plan.local->world_size());
  const size_t moved = plan.local->peer_bytes(plan.count, plan.type);
  try {
    plan.local->allreduce(plan.index, plan.local_offset, plan.count, plan.type, how,
                          [index = plan.index, step = st.step, stats = st.stats,
                           reducer = st.reducer, moved](const comm::Status& status) {
                            stats->bytes_sent = moved;  // written into other ranks' memory
                            stats->bytes_received = moved;  // read from it
                            report(index, step, *stats, reducer, status);
                          });
  } catch (const std::exception& e) {
    report(plan.index, st.step, *st.stats, st.reducer,
           comm::Status::failure("bucket " + std::to_string(plan.index) + ": " + e.what()));
  }
}

// A CUDA bucket without NCCL: copy to the host mirror, then run the execution there.
void launch_staged(Bucket* self, double divisor) {
  auto& st = self->state;
#ifdef TROUPE_HAVE_CUDA
  try {
    st.plan.staging->download(
        st.plan.ready_events, st.settings.device_timeout,
        [actor = caf::actor_cast<caf::actor>(self), step = st.step,
         divisor](const std::string& error) {
          caf::anon_send(actor, staged_atom::value, step, divisor, error);
        });
  } catch (const std::exception& e) {
    report(st.plan.index, st.step, *st.stats, st.reducer,
           comm::Status::failure("bucket " + std::to_string(st.plan.index) + ": " + e.what()));
  }
#else
  (void)divisor;
  report(st.plan.index, st.step, *st.stats, st.reducer,
         comm::Status::failure("bucket " + std::to_string(st.plan.index) +
                               ": a staged CUDA bucket in a troupe built without CUDA"));
#endif
}

void launch(Bucket* self, double divisor) {
  auto& st = self->state;
  st.launched = true;
  *st.stats = BucketStats{};
  st.stats->step = st.step;
  st.stats->ready = st.ready;
  st.stats->ready_us = now_us();
  if (!st.broken.empty()) {
    report(st.plan.index, st.step, *st.stats, st.reducer,
           comm::Status::failure(st.broken, st.broken_peer));
    return;
  }
  if (st.plan.nccl_order) launch_nccl(self, divisor);
  else if (st.plan.local) launch_local(self, divisor);
  else if (st.plan.staging) launch_staged(self, divisor);
  else start_execution(self, divisor);
}

caf::behavior bucket(Bucket* self, BucketPlan plan, ReduceSettings settings,
                     std::shared_ptr<comm::Reduction> reduction,
                     std::shared_ptr<comm::Transport> transport, caf::actor reducer,
                     std::shared_ptr<BucketStats> stats) {
  auto& st = self->state;
  st.plan = plan;
  st.settings = settings;
  st.reduction = std::move(reduction);
  st.transport = std::move(transport);
  st.reducer = std::move(reducer);
  st.stats = std::move(stats);
  return {
      [self](ready_atom, uint32_t step, double divisor) {
        begin_step(self, step);
        auto& st = self->state;
        if (++st.ready == st.plan.parameters && !st.launched) launch(self, divisor);
      },
      [self](launch_atom, uint32_t step, double divisor) {
        begin_step(self, step);
        if (!self->state.launched) launch(self, divisor);
      },
      [](run_atom, std::function<void()>& fn) { fn(); },
      [self](staged_atom, uint32_t step, double divisor, const std::string& error) {
        auto& st = self->state;
        if (step != st.step || !st.launched) return;
        if (!error.empty() || !st.broken.empty()) {
          report(st.plan.index, st.step, *st.stats, st.reducer,
                 !st.broken.empty() ? comm::Status::failure(st.broken, st.broken_peer)
                                    : comm::Status::failure(error));
          return;
        }
        start_execution(self, divisor);
      },
      [self](abort_atom, const std::string& reason, int peer) {
        auto& st = self->state;
        if (!st.broken.empty()) return;
        st.broken = reason;
        st.broken_peer = peer;
#ifdef TROUPE_HAVE_NCCL
        // The NCCL reduction cannot finish without the dead rank: abort the communicator, which
        // fails what is in flight at once, and let the buckets still waiting for their turn fail.
        if (auto nccl = st.plan.nccl.lock()) nccl->abort(reason);
        if (st.plan.nccl_order) st.plan.nccl_order->release();
#endif
        if (st.plan.local) st.plan.local->abort(comm::Status::failure(reason, peer));
        if (!st.execution) return;
        bool running = false;
        with_execution(self, [&] {
          running = !st.execution->done();
          if (running) st.execution->abort(comm::Status::failure(reason, peer));
        });
        if (running) self->delayed_send(self, st.settings.failure_grace, force_atom::value);
      },
      [self](force_atom) {
        auto& st = self->state;
        if (!st.execution) return;
        std::vector<int> waiting;
        with_execution(self, [&] {
          if (!st.execution->done()) waiting = st.execution->waiting_on();
        });
        for (int p : waiting) st.transport->fail_peer(p, st.broken);
      },
      [self](status_atom) {
        auto& st = self->state;
        std::vector<int> waiting;
        if (st.plan.local && st.launched) waiting = st.plan.local->waiting_on(st.plan.index);
        if (st.execution)
          with_execution(self, [&] {
            if (!st.execution->done()) waiting = st.execution->waiting_on();
          });
        return caf::make_message(st.launched, st.ready, waiting);
      },
  };
}

}  // namespace

caf::actor spawn_bucket(caf::actor_system& system, BucketPlan plan, ReduceSettings settings,
                        std::shared_ptr<comm::Reduction> reduction,
                        std::shared_ptr<comm::Transport> transport, caf::actor reducer,
                        std::shared_ptr<BucketStats> stats) {
  return system.spawn(bucket, plan, settings, std::move(reduction), std::move(transport),
                      std::move(reducer), std::move(stats));
}

}  // namespace troupe::actors
