#pragma once
/// Schedule and Execution: how every collective is written once against the Transport interface.
///
/// A collective is built as a Schedule: independent lanes (pipelined chunks of the buffer), each a
/// sequence of steps; a step posts its sends and receives together and, when all of them have
/// completed, runs its local work (a reduction, a copy) before the lane's next step is posted.
/// Lanes advance independently, so the transfer of one chunk overlaps the reduction of another.
///
/// An Execution runs one Schedule as a non-blocking state machine. Transport callbacks arrive on
/// transport threads; the Execution hands them to its driver through `Post`, and every state change
/// happens on the driver's thread. A driver is either BlockingDriver (driver.h: the caller's thread
/// waits with a deadline) or an actor (actors/), which lets one actor drive many collectives.
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/status.h"
#include "comm/transport/transport.h"

namespace troupe::comm {

/// One point-to-point operation of a step. `sub` distinguishes the messages of one collective: a
/// send and the receive it must meet use the same `sub` on both ranks.
struct Op {
  enum class Kind : uint8_t { send, recv };
  Kind kind;
  int peer;
  void* buffer;  // read by a send, written by a receive
  size_t bytes;
  uint16_t sub;
};

/// Operations posted together, then local work once every one of them has completed.
struct Step {
  std::vector<Op> ops;
  std::function<void()> then;
};

using Lane = std::vector<Step>;

/// A collective, ready to run: its lanes, the scratch memory they use, and work for the very end.
struct Schedule {
  std::string name;  // "allreduce(ring)", ... used in error messages
  std::vector<Lane> lanes;
  std::vector<std::unique_ptr<char[]>> scratch;
  std::function<void()> finally;

  /// Scratch memory owned by the schedule, alive until the execution ends.
  char* allocate(size_t bytes);
};

/// One phase of an operation made of several collectives in sequence (a compressed allreduce:
/// compress, exchange, decompress, exchange again, ...). `build` runs on the driver's thread when
/// the previous stage has ended: it does the local work that must come first and returns the
/// stage's Schedule, whose messages travel under `key`.
struct Stage {
  uint32_t key;
  std::function<Schedule()> build;
};

/// Runs closures on the driver's thread.
using Post = std::function<void(std::function<void()>)>;

/// A Post that runs each closure at once, on the calling thread, under `lock`. For transports with
/// serial_callbacks(): the execution's work then runs in the transport's own callbacks, which
/// saves a thread hand-off per step. Whoever touches the execution from elsewhere takes `lock`.
Post locked_post(std::shared_ptr<std::mutex> lock);

/// The state machine of one running Schedule. Create with std::make_shared, then start().
class Execution : public std::enable_shared_from_this<Execution> {
 public:
  /// `key` names this collective invocation; it must be the same on every rank and differ from
  /// every other collective in flight on the transport. Tags are tags::tag_of(key, op.sub)
  /// (comm/tags.h).
  Execution(std::shared_ptr<Transport> transport, uint32_t key, Schedule schedule, Post post);
  /// An execution of stages run one after the other (each stage's key must differ from the keys of
  /// everything else in flight). Fails if a stage's build throws.
  Execution(std::shared_ptr<Transport> transport, std::vector<Stage> stages, Post post);

  /// Posts the first step of every lane. On the driver's thread.
  void start();
  /// Fails the execution from outside (a rank died elsewhere in the job): nothing more is posted,
  /// and the driver ends what is in flight. On the driver's thread.
  void abort(const Status& status);
  /// True once every lane has ended and no operation is in flight.
  bool done() const { return done_; }
  const Status& status() const { return status_; }
  const std::string& name() const { return schedule_.name; }
  uint32_t key() const { return key_; }
  /// Bytes this rank sends and receives in all stages so far (what it puts on the wire).
  size_t bytes_sent() const;
  size_t bytes_received() const;
  /// The peers of operations still in flight (sorted, unique): whom a stalled collective waits on.
  std::vector<int> waiting_on() const;
  /// Sets the callback run on the driver's thread once when the execution ends. Set before start().
  void on_done(std::function<void(const Status&)> fn) { on_done_ = std::move(fn); }
  /// Sets the callback run on the driver's thread once when the first operation fails (the
  /// execution then posts nothing more and waits for what is in flight). Set before start().
  void on_failure(std::function<void(const Status&)> fn) { on_failure_ = std::move(fn); }

 private:
  struct Pending {
    int peer;
    size_t lane;
  };
  void begin_schedule();
  void post_step(size_t lane);
  void complete(size_t lane, size_t slot, const Status& status);
  void finish_if_idle();

  // Not owned: the last closure holding this execution may run on a transport thread, and must
  // not hold the last reference to the transport, whose destructor joins that thread.
  std::weak_ptr<Transport> transport_;
  uint32_t key_;
  Schedule schedule_;
  std::vector<Stage> stages_;  // stages after the first
  size_t next_stage_ = 0;
  size_t earlier_sent_ = 0;  // bytes of the stages already ended
  size_t earlier_received_ = 0;
  Post post_;
  std::vector<size_t> next_step_;        // per lane: index of the step in flight
  std::vector<size_t> lane_pending_;     // per lane: ops of the current step not yet completed
  std::vector<std::vector<int>> peers_;  // per lane: peer of each op of the current step, -1 done
  size_t in_flight_ = 0;
  size_t lanes_running_ = 0;
  bool done_ = false;
  Status status_;
  std::function<void(const Status&)> on_done_;
  std::function<void(const Status&)> on_failure_;
};

}  // namespace troupe::comm
