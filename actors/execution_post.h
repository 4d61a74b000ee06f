#pragma once
/// How an actor drives a comm::Execution (collectives/schedule.h): on a transport whose callbacks
/// all run on its one thread (UCX), the execution's steps run right in those callbacks under
/// `inline_lock` (created on first use); elsewhere every completion comes back to the actor `me`
/// as a (run_atom, closure) message that it must handle by calling the closure.
#include <caf/fwd.hpp>

#include <memory>
#include <mutex>

#include "comm/collectives/schedule.h"

namespace troupe::actors {

comm::Post execution_post(const caf::actor& me, const comm::Transport& transport,
                          std::shared_ptr<std::mutex>& inline_lock);

}  // namespace troupe::actors
