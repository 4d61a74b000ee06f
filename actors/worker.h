#pragma once
/// The worker: one per rank, the rank's address in the actor world.
///
/// It owns the rank's peer links (one per other rank), receives the directory's news of lost ranks,
/// and turns it into transport failures: a rank that died (its connection to the directory was
/// lost, or it announced a failure with Runtime::fail) fails the operations with it at once
/// (the collectives waiting on it fail, and those of the other survivors stop with them, see
/// comm::BlockingDriver), so nothing waits for its deadline; a rank that left
/// cleanly is only recorded, since every message it sent had been delivered (a wait for one it
/// never sent ends at that wait's deadline). When the directory itself (rank 0) disappears, that
/// counts as rank 0 dying. `on_peer_down` is called on the worker's thread for each lost rank.
#include <caf/fwd.hpp>

#include <functional>
#include <memory>
#include <string>

#include "comm/transport/transport.h"

namespace troupe::actors {

/// Called with (rank, reason, fatal) when a rank is gone.
using PeerDownHandler = std::function<void(int, const std::string&, bool)>;

caf::actor spawn_worker(caf::actor_system& system, int rank,
                        std::shared_ptr<comm::Transport> transport, PeerDownHandler on_peer_down);

/// Tells the worker whom to monitor as the directory (after the rendezvous).
void watch_directory(const caf::actor& worker, const caf::actor& directory);

}  // namespace troupe::actors
