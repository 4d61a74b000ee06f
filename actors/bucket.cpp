#include "actors/bucket.h"

#include <caf/all.hpp>

#include "actors/handoff.h"

namespace troupe::actors {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

struct BucketState {
  int index = 0;
  int parameters = 0;  // ready messages that fill the bucket
  std::shared_ptr<BucketPath> path;
  bucket_sink_actor reducer;
  std::shared_ptr<BucketStats> stats;
  uint32_t step = 0;
  bool fresh = true;  // no message seen yet
  int ready = 0;
  bool launched = false;
  std::string broken;  // why the job is broken (a rank died); empty while it is not
  int broken_peer = -1;
  static inline const char* name = "troupe.bucket";
};

using Self = bucket_actor::stateful_pointer<BucketState>;

void begin_step(Self self, uint32_t step) {
  auto& st = self->state;
  if (!st.fresh && st.step == step) return;
  st.fresh = false;
  st.step = step;
  st.ready = 0;
  st.launched = false;
}

// Ends a bucket's step: stamps its statistics and tells the reducer. Safe from any thread.
void report(int index, uint32_t step, BucketStats& stats, const bucket_sink_actor& reducer,
            const comm::Status& status) {
  stats.done_us = now_us();
  handoff_release();  // the reduced bucket, and its algorithm's state, go back to the trainer
  caf::anon_send(reducer, bucket_done_atom::value, index, step, status.ok(), status.message(),
                 status.peer());
}

void launch(Self self, double denominator) {
  auto& st = self->state;
  st.launched = true;
  *st.stats = BucketStats{};
  st.stats->step = st.step;
  st.stats->ready = st.ready;
  st.stats->ready_us = now_us();
  if (!st.broken.empty()) {
    report(st.index, st.step, *st.stats, st.reducer,
           comm::Status::failure(st.broken, st.broken_peer));
    return;
  }
  // Runs on whichever thread ends the reduction: touches only what it captured.
  BucketPath::Done done = [index = st.index, step = st.step, stats = st.stats,
                           reducer = st.reducer](const comm::Status& status, size_t sent,
                                                 size_t received) {
    stats->bytes_sent = sent;
    stats->bytes_received = received;
    report(index, step, *stats, reducer, status);
  };
  try {
    st.path->reduce(ActorThread(caf::actor_cast<run_actor>(self)), st.step, denominator, done);
  } catch (const std::exception& e) {
    done(comm::Status::failure("bucket " + std::to_string(st.index) + ": " + e.what()), 0, 0);
  }
}

bucket_actor::behavior_type bucket(Self self, int index, int parameters,
                                   std::shared_ptr<BucketPath> path, bucket_sink_actor reducer,
                                   std::shared_ptr<BucketStats> stats) {
  auto& st = self->state;
  st.index = index;
  st.parameters = parameters;
  st.path = std::move(path);
  st.reducer = std::move(reducer);
  st.stats = std::move(stats);
  return {
      [self](ready_atom, uint32_t step, double denominator) {
        handoff_acquire();  // the trainer's gradients in the bucket
        begin_step(self, step);
        auto& st = self->state;
        if (++st.ready == st.parameters && !st.launched) launch(self, denominator);
      },
      [self](launch_atom, uint32_t step, double denominator) {
        handoff_acquire();
        begin_step(self, step);
        if (!self->state.launched) launch(self, denominator);
      },
      [](run_atom, std::function<void()>& fn) { fn(); },
      [self](abort_atom, const std::string& reason, int peer) {
        auto& st = self->state;
        if (!st.broken.empty()) return;
        st.broken = reason;
        st.broken_peer = peer;
        st.path->abort(ActorThread(caf::actor_cast<run_actor>(self)),
                       comm::Status::failure(reason, peer));
      },
      [self](progress_atom) {
        auto& st = self->state;
        std::vector<int> waiting;
        if (st.launched) waiting = st.path->waiting_on();
        return std::make_tuple(bucket_state_atom::value, st.index, st.launched, st.ready,
                               std::move(waiting));
      },
  };
}

}  // namespace

Bucket Bucket::spawn(caf::actor_system& system, int index, int parameters,
                     std::shared_ptr<BucketPath> path, bucket_sink_actor reducer,
                     std::shared_ptr<BucketStats> stats) {
  return Bucket(system.spawn(bucket, index, parameters, std::move(path), std::move(reducer),
                             std::move(stats)));
}

void Bucket::ready(uint32_t step, double denominator) const {
  caf::anon_send(actor_, ready_atom::value, step, denominator);
}

void Bucket::launch(uint32_t step, double denominator) const {
  caf::anon_send(actor_, launch_atom::value, step, denominator);
}

void Bucket::abort(const std::string& reason, int peer) const {
  caf::anon_send(actor_, abort_atom::value, reason, peer);
}

void Bucket::stop() const {
  if (actor_) caf::anon_send_exit(actor_, caf::exit_reason::user_shutdown);
}

}  // namespace troupe::actors
