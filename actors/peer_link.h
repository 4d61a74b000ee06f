#pragma once
/// A peer link: the actor that stands for one remote rank on this rank.
///
/// It holds what is known of the peer (host, transport address, alive or why not) and owns the
/// peer's side of the transport: when told the peer is gone (fail_atom) it fails the transport's
/// pending and later operations with that rank, so no collective waits for a dead peer. Bytes do
/// not pass through the actor: collectives post to the transport directly (zero-copy, no mailbox
/// hop per message); link emulation, which must delay sends, will route them through here.
#include <caf/fwd.hpp>

#include <memory>
#include <string>

#include "comm/transport/transport.h"

namespace troupe::actors {

caf::actor spawn_peer_link(caf::actor_system& system, int peer,
                           std::shared_ptr<comm::Transport> transport);

}  // namespace troupe::actors
