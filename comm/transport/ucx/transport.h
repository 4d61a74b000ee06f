#pragma once
/// UcxTransport: the Transport between processes and hosts, over the UCX ucp tag API.
///
/// One progress thread owns the ucp worker (UCX workers are single-threaded): callers submit
/// operations through a lock-protected queue and wake the thread through an eventfd; the thread
/// polls ucp_worker_progress for a while after each event (only when every rank is on this host,
/// progress_for(), and once a module has called survive_peer_loss only while an operation through
/// shared memory is in flight) and otherwise sleeps in epoll on the worker's event fd
/// (ucp_worker_arm) and the wake-up fd, so an idle rank costs no CPU.
///
/// Which UCX transports carry the bytes is chosen by UCX's own environment: UCX_TLS (e.g.
/// "sm,self" for shared memory on one host, "tcp,self" across hosts), UCX_NET_DEVICES (e.g.
/// "eth0"). Without UCX_TLS, a job whose ranks all run on one host uses "posix,sysv,tcp,self" (see
/// below). Peer error handling is left at UCP_ERR_HANDLING_MODE_NONE because PEER mode silently
/// disables shared memory; dead peers are detected by the directory actor instead, which calls
/// fail_peer.
///
/// UCX's shared memory has one receive FIFO per worker, filled by every sender on the host and
/// read in order: a sender killed between taking an element and marking it written leaves the
/// receiver deaf to all other senders for good. Modules that go on without a dead peer (gossip)
/// call survive_peer_loss: their sends to each peer on this host then go through a second endpoint
/// in PEER mode, which UCX builds over tcp (loopback), whose connections are the peers' own.
///
/// The wire tag is (source rank << 48) | tag, so a receive matches one peer.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/transport.h"

namespace troupe::comm {

/// The ucp context and worker of a UcxTransport, made before the transport knows its rank and
/// world: a process that waits for its place in a world (an elastic job's hot spare) makes them
/// during its start-up, so that the world that takes it does not wait for UCX's start-up
/// (ucp_init, ucp_worker_create: the transports' resources). One UcxTransport takes it.
class UcxWorker {
 public:
  /// Creates the context and worker as UcxTransport(rank, world_size, single_host) does (the
  /// same UCX_TLS and UCX_RNDV_THRESH choices); `estimated_peers` sizes UCX's endpoint tables (a
  /// hint). Throws comm::Error naming the UCX call and status when UCX cannot start.
  UcxWorker(bool single_host, int estimated_peers);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  /// The worker's address: what the local_address() of the transport that takes it returns.
  const std::string& address() const;
  bool single_host() const;

  struct Handles;  // UCX's handles (transport.cpp), taken by the transport

 private:
  friend class UcxTransport;
  std::unique_ptr<Handles> handles_;
};

class UcxTransport final : public Transport {
 public:
  /// Creates the ucp context and worker and starts the progress thread. With `single_host` (every
  /// rank on this host) and UCX_TLS unset, UCX is limited to "posix,sysv,tcp,self" with
  /// UCX_MAX_RNDV_LANES=0: shared memory without cross-memory attach (which measured ~1.5x faster
  /// for large messages here) for every endpoint, tcp only for survive_peer_loss's. Without
  /// `single_host` and with UCX_RNDV_THRESH unset, messages of every size are sent eagerly (no
  /// rendezvous round trip per message: 94-95% of a 1 Gbit/s ring's bound against ~90%).
  /// Throws comm::Error naming the UCX call and status when UCX cannot start.
  UcxTransport(int rank, int world_size, bool single_host = false);
  /// The same with a context and worker made earlier (UcxWorker): only the progress thread
  /// starts here. Throws comm::Error when `worker` is null.
  UcxTransport(int rank, int world_size, std::unique_ptr<UcxWorker> worker);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  /// This rank's ucp worker address (opaque bytes) to publish through rendezvous.
  std::string local_address() const;
  /// Creates an endpoint to every other rank; `addresses[r]` is rank r's local_address().
  /// Throws comm::Error naming the rank whose address is unusable.
  void connect(const std::vector<std::string>& addresses);
  /// Per peer (by rank, this rank's own included), the UCX transports its endpoint's lanes use,
  /// as UCX chose them at connect(): e.g. "posix/memory sysv/memory cma/memory" (shared memory on
  /// one host), "tcp/eth0" (the network), "self/memory"; empty before connect().
  std::vector<std::string> peer_transports() const;
  /// Per peer, the protocols UCX chose for tagged sends by message size, from its endpoint's
  /// description: e.g. "0..<egr/short>..8185..<egr/zcopy>..(inf)" (eager at every size) or
  /// "0..<egr/short>..8185..<egr/zcopy>..8192..<rndv>..(inf)"; empty before connect().
  std::vector<std::string> peer_protocols() const;
  /// The UCX transports the context found on this machine, e.g. "posix, sysv, cma, tcp".
  static std::string available_transports();
  /// UCX's version string, e.g. "1.13.1".
  static std::string version();
  /// How the progress thread waits for UCX. `spin`: how long it keeps polling after an event
  /// before it sleeps in epoll; `busy_wait`: the longest sleep while operations are in flight
  /// (UCX does not signal every event on its fd).
  struct Progress {
    std::chrono::microseconds spin;
    std::chrono::microseconds busy_wait;
  };
  /// The progress thread's waits by layout: when every rank is on this host (shared memory: the
  /// next event is usually near) it polls 0.5 ms and sleeps at most 1 ms; across hosts it sleeps
  /// at once (over tcp a polling thread loses the CPU to the scheduler when its next message
  /// comes, on a busy machine) and at most 0.25 ms.
  static Progress progress_for(bool single_host);

  int rank() const override;
  int world_size() const override;
  std::string name() const override { return "ucx"; }
  bool serial_callbacks() const override { return true; }
  void send(int peer, Tag tag, const void* data, size_t bytes, Callback done) override;
  void recv(int peer, Tag tag, void* data, size_t bytes, Callback done) override;
  void fail_peer(int peer, const std::string& reason) override;
  /// The module's sends to every peer whose endpoint goes through shared memory take a second
  /// endpoint in UCX's peer-failure mode (tcp), made on the first call; a reason when some peer
  /// cannot have one (UCX_TLS without tcp). After connect() only: throws comm::Error before.
  std::string survive_peer_loss(uint32_t key_prefix) override;
  /// Every rank keeps a receive posted for each peer's probes and answers each one from its
  /// progress thread, whatever its collectives are doing; after connect() only.
  bool can_probe() const override { return true; }
  void probe(int peer, Callback done) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::comm
