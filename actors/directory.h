#pragma once
/// The directory: the rendezvous of a job, an actor on rank 0 published with CAF's middleman at
/// MASTER_ADDR:MASTER_PORT.
///
/// Each rank registers (rank, world size, host, transport address, worker). When all world_size
/// ranks have registered, every one of them gets the peer table (hosts and transport addresses by
/// rank). Registration fails for everyone, at once, on a duplicate rank, a world size that differs
/// from rank 0's, or a rank outside [0, world_size); and when the deadline passes first, with a
/// message naming the ranks that never arrived. After the rendezvous the directory monitors every
/// worker and tells every survivor of each rank that is gone (peer_down_atom): as a death when its
/// worker disappears or it announces a failure (failed_atom, with its reason), as a clean exit
/// when it leaves (leave_atom). (flush_atom) -> true answers once what came before is handled.
#include <caf/fwd.hpp>

#include <chrono>

namespace troupe::actors {

caf::actor spawn_directory(caf::actor_system& system, int world_size,
                           std::chrono::milliseconds deadline);

}  // namespace troupe::actors
