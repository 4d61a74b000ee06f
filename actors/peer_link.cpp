#include "actors/peer_link.h"

#include <caf/all.hpp>

#include "actors/atoms.h"

namespace troupe::actors {

namespace {

struct PeerLinkState {
  int peer = -1;
  std::shared_ptr<comm::Transport> transport;
  std::string failure;  // why the peer is unreachable; empty while it is alive
  static inline const char* name = "troupe.peer_link";
};

caf::behavior peer_link(caf::stateful_actor<PeerLinkState>* self, int peer,
                        std::shared_ptr<comm::Transport> transport) {
  self->state.peer = peer;
  self->state.transport = std::move(transport);
  return {
      [self](fail_atom, const std::string& reason) {
        if (!self->state.failure.empty()) return;
        self->state.failure = reason;
        self->state.transport->fail_peer(self->state.peer, reason);
      },
      [self](status_atom) { return self->state.failure; },
  };
}

}  // namespace

caf::actor spawn_peer_link(caf::actor_system& system, int peer,
                           std::shared_ptr<comm::Transport> transport) {
  return system.spawn(peer_link, peer, std::move(transport));
}

}  // namespace troupe::actors
