#include "actors/execution_post.h"

#include <caf/all.hpp>

#include "actors/atoms.h"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::function<void()>)

namespace troupe::actors {

comm::Post execution_post(const caf::actor& me, const comm::Transport& transport,
                          std::shared_ptr<std::mutex>& inline_lock) {
  if (transport.serial_callbacks()) {
    if (!inline_lock) inline_lock = std::make_shared<std::mutex>();
    return comm::locked_post(inline_lock);
  }
  return [me](std::function<void()> fn) { post(me, std::move(fn)); };
}

void post(const caf::actor& me, std::function<void()> fn) {
  caf::anon_send(me, run_atom::value, std::move(fn));
}

void post_after(const caf::actor& me, std::chrono::milliseconds delay, std::function<void()> fn) {
  caf::delayed_anon_send(me, delay, run_atom::value, std::move(fn));
}

}  // namespace troupe::actors
