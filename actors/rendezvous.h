#pragma once
/// The rendezvous: rank 0 publishes the directory behind its front door (front_door.h); every
/// other rank reaches it over the wire of rendezvous_wire.h, proves it holds the job's secret,
/// registers, gets the peer table, and keeps the connection: over it the directory's news of lost
/// ranks arrive, and this rank's failure or leave is sent.
#include <caf/actor.hpp>
#include <caf/fwd.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/front_door.h"
#include "comm/status.h"
#include "comm/wire/rendezvous_wire.h"

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
  /// The job's secret (TROUPE_JOB_SECRET); every rank of a job must hold the same.
  std::string secret;
  /// The job's identity (TROUPE_JOB_ID); every rank of a job must name the same. The handshake's
  /// key is wire::job_key(secret, job_id): a rank of another job that shares the secret (and
  /// the port) is refused, by name.
  std::string job_id;
  /// Rank 0: the IPv4 address its front door listens on; empty: master_addr's.
  std::string bind_address;
  /// TLS for the control plane (every rank of a job the same way); empty: plain TCP.
  wire::TlsFiles tls;
};

/// A rank's connection to rank 0's front door, kept after the rendezvous (see rendezvous.cpp).
class DirectoryConnection;

/// The rendezvous' outcome: every rank's host, transport address and extra bytes, by rank.
struct PeerTable {
  std::vector<std::string> hosts;
  std::vector<std::string> addresses;
  std::vector<std::string> extras;
  /// On rank 0 the directory; on the others a local actor that speaks for it over the
  /// connection (failed_atom, leave_atom) and ends when the connection is lost, as the directory
  /// would for this rank if rank 0 died.
  caf::actor directory;
  /// Ranks other than 0: the connection; dropping it ends the directory actor above.
  std::shared_ptr<DirectoryConnection> connection;
};

/// Rank 0's side: the directory and its front door.
struct PublishedDirectory {
  caf::actor directory;
  std::unique_ptr<FrontDoor> door;
};

/// On rank 0: spawns the directory and its front door, listening at master_port (0: a free port
/// the system picks; door->port() says which) on `bind_address`, else master_addr's IPv4
/// address. Throws comm::Error naming the address and port when it cannot listen there.
PublishedDirectory publish_directory(caf::actor_system& system, const RendezvousRequest& request);

/// Registers `worker` with the directory (`directory` on rank 0, else reached at
/// master_addr:master_port, retrying until the timeout) and waits for the table. Every attempt to
/// connect, the handshake included, ends at the timeout, so a port that accepts and never answers
/// (a stopped rank 0) fails like one that refuses; the table is awaited up to the timeout plus
/// 1 s. Throws comm::Error naming host:port and the timeout when the directory cannot be reached
/// or does not answer in time, saying so when the process there does not hold this job's secret,
/// and passing on the directory's refusal (duplicate rank, world size mismatch, missing ranks)
/// otherwise.
PeerTable rendezvous(caf::actor_system& system, const RendezvousRequest& request,
                     const caf::actor& worker, caf::actor directory);

}  // namespace troupe::actors
