#pragma once
/// A rank's actors, as one handle for the rank's Runtime: the CAF actor system, the worker that
/// hears of dead peers, and the directory (published behind a front door on rank 0, reached
/// through a connection on the others). The Runtime calls these steps in order: start_worker,
/// publish (rank 0), rendezvous; then, at the end, tell_failed or tell_leaving, and close.
#include <caf/fwd.hpp>

#include <memory>
#include <string>

#include "actors/rendezvous.h"
#include "actors/worker.h"

namespace troupe::actors {

class Node {
 public:
  /// An actor system of `threads` scheduler threads.
  explicit Node(int threads);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Where the modules spawn their actors (actors/bucket.h, reducer.h, background.h).
  caf::actor_system& system();

  /// This rank's worker, which calls `on_peer_down` (from an actor's thread) when a rank is gone.
  void start_worker(int rank, std::shared_ptr<comm::Transport> transport,
                    PeerDownHandler on_peer_down);
  /// Ends the worker (an elastic rank's, between generations).
  void stop_worker();
  bool has_worker() const;

  /// Rank 0: spawns the directory behind its front door (see publish_directory); the door says
  /// where it listens.
  const FrontDoor& publish(const RendezvousRequest& request);
  /// Registers the worker with the directory, waits for the table (see rendezvous), and has the
  /// worker watch the directory.
  PeerTable rendezvous(const RendezvousRequest& request);
  bool has_directory() const;

  /// Tells the directory that rank `rank` failed for `reason` (it tells every other rank, as a
  /// death), or leaves on purpose; waits at most 2 s for its acknowledgement.
  void tell_failed(int rank, const std::string& reason);
  void tell_leaving(int rank);

  /// Ends the worker, the front door (after what it still has to send), the connection, and the
  /// directory if this rank published it. The actor system ends with the Node.
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The version of CAF troupe was built with ("0.17.6"), for `troupe info`.
std::string caf_version();

}  // namespace troupe::actors
