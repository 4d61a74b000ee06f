#pragma once
/// The front door: rank 0's listener for the rendezvous, in front of the directory.
///
/// It listens on one IPv4 address (MASTER_ADDR's interface, not every interface) and lets a
/// connection reach the directory only after the handshake of rendezvous_wire.h has proved that
/// the other side holds the job's secret. Everything before that is bounded: a handshake has a
/// deadline, at most `max_handshakes` connections (and `max_handshakes_per_address` from one
/// address) may be in one at a time, more are closed at once, and no read is larger than the
/// fixed handshake sizes. After it, each frame's size is checked against wire::kMaxRankFrame
/// before it is read.
///
/// Each authenticated connection gets a stand-in actor on rank 0 that is, for the directory, that
/// rank's worker: it registers, receives the directory's news of lost ranks (sent on as frames),
/// and passes on the rank's failure or leave. When the connection is lost the stand-in ends, so
/// the directory's monitor sees the rank die exactly as it would a local worker.
#include <caf/fwd.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "comm/wire/rendezvous_wire.h"

namespace troupe::actors {

struct FrontDoorOptions {
  /// The IPv4 address to listen on (dotted quad; "0.0.0.0" for every interface).
  std::string bind_address = "127.0.0.1";
  /// 0: a port the system picks.
  int port = 0;
  /// The job's secret; empty: the handshake runs with an empty key, so anyone who speaks the
  /// protocol can join (the Runtime warns about it when the port is reachable from other hosts).
  std::string secret;
  /// TLS first, with both sides' certificates checked against the CA; empty: plain TCP.
  wire::TlsFiles tls;
  int world_size = 1;
  std::chrono::milliseconds handshake_timeout{5000};
  int max_handshakes = 64;
  int max_handshakes_per_address = 8;
};

/// What the front door has seen, for tests and diagnostics.
struct FrontDoorCounts {
  long accepted = 0;     // TCP connections accepted
  long turned_away = 0;  // closed at once: too many handshakes in progress (in all or per address)
  long failed = 0;       // closed during the handshake: bad magic, wrong proof, too slow
  long authenticated = 0;  // completed the handshake
  long dropped = 0;        // closed after the handshake: an oversized or malformed frame
};

class FrontDoor {
 public:
  /// Binds and starts listening (its own thread). Throws comm::Error naming the address and port
  /// when it cannot bind, and the file when a TLS file cannot be used.
  FrontDoor(caf::actor_system& system, caf::actor directory, FrontDoorOptions options);
  /// Sends what is still to be sent (flush, up to 1 s), then closes every connection (their
  /// stand-ins end) and the listener.
  ~FrontDoor();
  FrontDoor(const FrontDoor&) = delete;
  FrontDoor& operator=(const FrontDoor&) = delete;

  /// The address and port it listens on.
  const std::string& address() const;
  int port() const;
  /// Waits (up to `timeout`) until everything the directory has sent the remote ranks so far is
  /// written to their connections: call before closing, so that a last "rank 0 left" arrives.
  void flush(std::chrono::milliseconds timeout);
  FrontDoorCounts counts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::actors
