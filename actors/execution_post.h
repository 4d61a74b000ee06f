#pragma once
/// How work reaches an actor's thread from other threads (transport callbacks, CUDA event
/// watchers): as (run_atom, closure) messages, which the actor runs by calling the closure.
///
/// execution_post() is how an actor drives a comm::Execution (collectives/schedule.h): on a
/// transport whose callbacks all run on its one thread (UCX), the execution's steps run right in
/// those callbacks under `inline_lock` (created on first use); elsewhere every completion comes
/// back to the actor `me` as a run message.
#include <caf/fwd.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "comm/collectives/schedule.h"

namespace troupe::actors {

comm::Post execution_post(const caf::actor& me, const comm::Transport& transport,
                          std::shared_ptr<std::mutex>& inline_lock);

/// Runs `fn` on `me`'s thread (a run message).
void post(const caf::actor& me, std::function<void()> fn);
/// Runs `fn` on `me`'s thread after `delay` (dropped if `me` is gone by then).
void post_after(const caf::actor& me, std::chrono::milliseconds delay, std::function<void()> fn);

}  // namespace troupe::actors
