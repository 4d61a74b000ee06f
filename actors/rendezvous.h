#pragma once
/// The client side of the rendezvous: reach the directory, register, get the peer table.
#include <caf/actor.hpp>
#include <caf/fwd.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "comm/status.h"

namespace troupe::actors {

/// What this rank tells the directory, and where the directory is.
struct RendezvousRequest {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string host;     // this rank's host name, for the peer table and error messages
  std::string address;  // this rank's transport address
  /// Opaque bytes this rank hands to every rank (rank 0's NCCL unique id, when it made one);
  /// binary-safe, may be empty.
  std::string extra;
  std::chrono::milliseconds timeout{30000};
};

/// The rendezvous' outcome: every rank's host, transport address and extra bytes, by rank.
struct PeerTable {
  std::vector<std::string> hosts;
  std::vector<std::string> addresses;
  std::vector<std::string> extras;
  caf::actor directory;
};

/// On rank 0: spawns the directory and publishes it at master_port (all interfaces; 0: a free port
/// the system picks), and stores the port it listens on in `*bound_port` when given. Throws
/// comm::Error naming the port when it cannot be bound.
caf::actor publish_directory(caf::actor_system& system, const RendezvousRequest& request,
                             int* bound_port = nullptr);

/// Registers `worker` with the directory (`directory` on rank 0, else reached at
/// master_addr:master_port, retrying until the timeout) and waits for the table. Every attempt to
/// connect, the CAF handshake included, ends at the timeout, so a port that accepts and never
/// answers (a stopped rank 0) fails like one that refuses; the table is awaited up to the timeout
/// plus 1 s. Throws comm::Error naming host:port and the timeout when the directory cannot be
/// reached or does not answer in time, and passing on the directory's refusal (duplicate rank,
/// world size mismatch, missing ranks) otherwise.
PeerTable rendezvous(caf::actor_system& system, const RendezvousRequest& request,
                     const caf::actor& worker, caf::actor directory);

}  // namespace troupe::actors
