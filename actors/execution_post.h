#pragma once
/// How work reaches an actor's thread from other threads (transport callbacks, CUDA event
/// watchers): as (run_atom, closure) messages, which the actor runs by calling the closure.
///
/// An ActorThread is the handle to such an actor that the code above it holds: a bucket's
/// gradient path (actors/bucket.h) and a background actor's allreduce post their work through it.
/// Its execution_post() is how an actor drives a comm::Execution (collectives/schedule.h): on a
/// transport whose callbacks all run on its one thread (UCX), the execution's steps run right in
/// those callbacks under `inline_lock` (created on first use); elsewhere every completion comes
/// back to the actor as a run message.
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "actors/atoms.h"
#include "comm/collectives/schedule.h"

// A closure only ever travels between actors of one process.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::function<void()>)

namespace troupe::actors {

/// The part of an actor's interface that runs posted work.
using run_actor = caf::typed_actor<caf::reacts_to<run_atom, std::function<void()>>>;

class ActorThread {
 public:
  ActorThread() = default;
  explicit ActorThread(run_actor actor) : actor_(std::move(actor)) {}

  /// Runs `fn` on the actor's thread.
  void post(std::function<void()> fn) const;
  /// Runs `fn` on the actor's thread after `delay` (dropped if the actor is gone by then).
  void post_after(std::chrono::milliseconds delay, std::function<void()> fn) const;
  /// How a comm::Execution over `transport` run by this actor posts its steps.
  comm::Post execution_post(const comm::Transport& transport,
                            std::shared_ptr<std::mutex>& inline_lock) const;

 private:
  run_actor actor_;
};

}  // namespace troupe::actors
