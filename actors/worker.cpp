#include "actors/worker.h"

#include <caf/all.hpp>

#include <vector>

#include "actors/atoms.h"
#include "actors/peer_link.h"

namespace troupe::actors {

namespace {

using watch_atom = caf::atom_constant<caf::atom("watch")>;

struct WorkerState {
  int rank = -1;
  std::vector<caf::actor> links;  // by rank; empty handle for this rank
  std::vector<bool> gone;
  caf::actor directory;
  PeerDownHandler on_peer_down;
  static inline const char* name = "troupe.worker";
};

using Worker = caf::stateful_actor<WorkerState>;

void peer_down(Worker* self, int rank, const std::string& reason, bool fatal) {
  auto& st = self->state;
  if (rank < 0 || rank >= static_cast<int>(st.links.size()) || st.gone[rank]) return;
  st.gone[rank] = true;
  // A rank that died: its operations fail at once; collectives waiting on it fail, and the other
  // ranks' collectives stop with them (BlockingDriver). A rank that left cleanly had completed
  // everything it sent; a wait for more ends at the waiter's deadline.
  if (fatal && st.links[rank]) self->send(st.links[rank], fail_atom::value, reason);
  if (st.on_peer_down) st.on_peer_down(rank, reason, fatal);
}

caf::behavior worker(Worker* self, int rank, std::shared_ptr<comm::Transport> transport,
                     PeerDownHandler on_peer_down) {
  auto& st = self->state;
  st.rank = rank;
  st.on_peer_down = std::move(on_peer_down);
  const int world = transport->world_size();
  st.gone.assign(static_cast<size_t>(world), false);
  st.links.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    if (r != rank) {
      st.links[r] = spawn_peer_link(self->system(), r, transport);
      self->link_to(st.links[r]);  // links end with the worker
    }
  self->set_down_handler([self](const caf::down_msg& down) {
    if (self->state.directory && down.source == self->state.directory.address())
      peer_down(self, 0, "rank 0 died: the rendezvous (directory) on it is gone", true);
  });
  return {
      [self](peer_down_atom, int r, const std::string& reason, bool fatal) {
        peer_down(self, r, reason, fatal);
      },
      [self](watch_atom, const caf::actor& directory) {
        self->state.directory = directory;
        self->monitor(directory);
      },
      [self](status_atom) {
        std::vector<int> gone;
        for (size_t r = 0; r < self->state.gone.size(); ++r)
          if (self->state.gone[r]) gone.push_back(static_cast<int>(r));
        return gone;
      },
  };
}

}  // namespace

caf::actor spawn_worker(caf::actor_system& system, int rank,
                        std::shared_ptr<comm::Transport> transport, PeerDownHandler on_peer_down) {
  return system.spawn(worker, rank, std::move(transport), std::move(on_peer_down));
}

void watch_directory(const caf::actor& worker, const caf::actor& directory) {
  caf::anon_send(worker, watch_atom::value, directory);
}

}  // namespace troupe::actors
