#include "actors/execution_post.h"

#include <caf/all.hpp>

namespace troupe::actors {

void ActorThread::post(std::function<void()> fn) const {
  caf::anon_send(actor_, run_atom::value, std::move(fn));
}

void ActorThread::post_after(std::chrono::milliseconds delay, std::function<void()> fn) const {
  caf::delayed_anon_send(actor_, delay, run_atom::value, std::move(fn));
}

comm::Post ActorThread::execution_post(const comm::Transport& transport,
                                       std::shared_ptr<std::mutex>& inline_lock) const {
  if (transport.serial_callbacks()) {
    if (!inline_lock) inline_lock = std::make_shared<std::mutex>();
    return comm::locked_post(inline_lock);
  }
  return [me = *this](std::function<void()> fn) { me.post(std::move(fn)); };
}

}  // namespace troupe::actors
