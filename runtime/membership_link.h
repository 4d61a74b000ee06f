#pragma once
/// The elastic membership service across nodes: one TCP connection from each node's launcher to
/// node 0's, which hosts the MembershipServer (runtime/membership.h).
///
/// A rank never speaks TCP to the service: every launcher hands its ranks the same private
/// socket as on one node (TROUPE_ELASTIC_FD), and a launcher of node i > 0 relays what its ranks
/// send and receive over its one connection (MembershipRelay); node 0's launcher takes the
/// connections in (MembershipHub) and feeds them to the server as remote slots. So a rank's side
/// is the same on every node, and a launcher sees its service go: when node 0's launcher dies,
/// every other launcher ends its ranks and fails with an error naming the address.
///
/// The service listens at --master-addr:--master-port (MASTER_ADDR:MASTER_PORT): an elastic job
/// forms its worlds through the service, so rank 0's rendezvous directory, which would use that
/// port otherwise, is never started. The bytes are frames:
///
///   u32 length of what follows (little-endian), u8 type, i32 slot, payload
///
///   relay -> hub   hello     version, node rank, nnodes, nprocs, spares, nonce,
///                            HMAC-SHA256(TROUPE_JOB_SECRET, nonce | shape) when a secret is set
///   hub -> relay   welcome   / refuse (why): a wrong shape, a node already connected, a bad proof
///   relay -> hub   attach    slot's process started (payload "1": as a spare)
///   both ways      relay     one membership message of `slot` (runtime/membership.h)
///   relay -> hub   closed    slot's socket closed (its process ended), payload: why
///   relay -> hub   exited    slot's process was reaped: payload: exit code, how
///   hub -> relay   stopped   the job has no quorum (why): the relay restarts nobody
///   hub -> relay   dismiss   no rank of the job runs any more: the relay's launcher stops the
///                            spares still waiting (a spare a generation took is not one)
///   relay -> hub   bye       every rank of the node has ended; the connection closes
///
/// A relay that goes without bye is a lost node: its ranks count as dead.
#include <poll.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "runtime/membership.h"

namespace troupe::elastic {

/// What a job of several nodes looks like; both ends of a link must agree on it.
struct NodeShape {
  int nnodes = 1;
  int nprocs = 1;  // ranks per node
  int node_rank = 0;
  int spares = 0;  // hot spares per node (`--spares`)

  /// The launch slot of node `node`'s local process `local` (0..nprocs-1: its ranks,
  /// nprocs..nprocs+spares-1: its spares). The ranks' slots come first, node by node (node i's
  /// local rank r is slot i * nprocs + r, its RANK, as without spares), then the spares', node by
  /// node: slot nnodes * nprocs + i * spares + k. With one node that is the local index.
  int slot(int node, int local) const {
    return local < nprocs ? node * nprocs + local : nnodes * nprocs + node * spares + local - nprocs;
  }
  /// The node whose launcher starts `slot`'s processes.
  int node_of(int slot) const {
    return slot < nnodes * nprocs ? slot / nprocs : (slot - nnodes * nprocs) / spares;
  }
  /// The local index of `slot` on its node (the inverse of slot()).
  int local_of(int slot) const {
    return slot < nnodes * nprocs ? slot % nprocs
                                  : nprocs + (slot - nnodes * nprocs) % spares;
  }
  /// Every launch slot of the job: its ranks and its spares.
  int slots() const { return nnodes * (nprocs + spares); }
};

enum class LinkFrame : uint8_t {
  hello = 1, welcome = 2, refuse = 3, attach = 4, relay = 5, closed = 6, exited = 7, stopped = 8,
  bye = 9, dismiss = 10
};

/// One end of a link: frames in and out of a non-blocking TCP socket.
class LinkStream {
 public:
  struct Frame {
    LinkFrame type;
    int slot;
    std::string payload;
  };
  explicit LinkStream(int fd);
  ~LinkStream();
  LinkStream(const LinkStream&) = delete;
  LinkStream& operator=(const LinkStream&) = delete;

  int fd() const { return fd_; }
  /// Queues a frame and writes what the socket takes now.
  void send(LinkFrame type, int slot, const std::string& payload);
  /// Writes what is queued; false once the connection failed (error() says why).
  bool flush();
  bool wants_write() const { return !out_.empty(); }
  /// Reads what arrived, appending whole frames to `frames`; false at the end of the stream or
  /// on an error (error() says which).
  bool read(std::vector<Frame>& frames);
  const std::string& error() const { return error_; }

 private:
  int fd_;
  std::string in_, out_;
  std::string error_;
};

/// Node 0's side: listens at the master address and hands what the other nodes' launchers relay
/// to `server`. Driven by the launcher's poll loop.
class MembershipHub {
 public:
  /// Listens on `bind_address`:`port` (every address when empty). Throws comm::Error naming the
  /// address when it cannot.
  MembershipHub(MembershipServer& server, NodeShape shape, const std::string& bind_address,
                int port, std::string secret, std::ostream& log);
  ~MembershipHub();
  MembershipHub(const MembershipHub&) = delete;
  MembershipHub& operator=(const MembershipHub&) = delete;

  /// The fds to poll; `tags` gets what on_ready() needs back for each.
  void add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const;
  void on_ready(int tag, short revents);
  /// Tells every node the job stopped (no quorum).
  void stopped(const std::string& why);
  /// Tells every node that no rank of the job runs: their waiting spares are not needed.
  void dismiss();
  /// Whether a node's launcher is still connected (it has not said bye).
  bool connected() const;
  /// Drops every connection (the launcher gives up waiting for their bye).
  void drop_all(const std::string& why);
  /// Remote rank processes that exited with status 0.
  int finished() const { return finished_; }

 private:
  struct Link {
    std::unique_ptr<LinkStream> stream;
    int node = -1;  // -1: no hello yet
    Clock::time_point hello_by;
    bool closing = false;  // refused: closes once the refusal is written
  };
  void send(int link, int slot, const std::string& bytes);
  void handle(int link, const LinkStream::Frame& frame);
  void lose(int link, const std::string& why);
  std::string node_text(int link) const;

  MembershipServer& server_;
  NodeShape shape_;
  std::string secret_;
  std::ostream& log_;
  int listen_fd_ = -1;
  std::vector<Link> links_;  // by link id; a closed one keeps its place with no stream
  int finished_ = 0;
};

/// Node i > 0's side: one connection to the hub, and a socket pair per local rank slot.
class MembershipRelay {
 public:
  /// Connects to `address`:`port` and introduces this node, retrying until `deadline` (node 0's
  /// launcher may start later). Throws comm::Error naming the address, the node and what was
  /// expected when it cannot reach the service by then, or when the hub refuses.
  MembershipRelay(NodeShape shape, const std::string& address, int port, std::string secret,
                  std::chrono::milliseconds deadline);
  ~MembershipRelay();
  MembershipRelay(const MembershipRelay&) = delete;
  MembershipRelay& operator=(const MembershipRelay&) = delete;

  /// A fresh socket pair for local slot `local` (0..nprocs+spares-1: a rank or a spare about to
  /// start or restart); returns the rank's end, close-on-exec (as MembershipServer::attach()).
  int attach(int local, bool standby);
  /// Closes the rank's end in the launcher once the child has it.
  void started(int local);
  /// The launcher reaped local slot `local`'s process.
  void on_exit(int local, int exit_code, const std::string& how);
  void add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const;
  void on_ready(int tag, short revents);
  /// Every local rank ended: says bye and closes (waits at most `deadline` for the bytes to go).
  void finish(std::chrono::milliseconds deadline);
  /// The connection to the service was lost (lost_reason() names the address).
  bool lost() const { return !lost_reason_.empty(); }
  const std::string& lost_reason() const { return lost_reason_; }
  /// The service said the job has no quorum.
  bool stopped() const { return !stop_reason_.empty(); }
  /// The service said no rank of the job runs any more: stop the waiting spares.
  bool dismissed() const { return dismissed_; }
  /// Whether local slot `local`'s process is a spare that no generation has taken yet (the relay
  /// saw no assignment go to it).
  bool standby(int local) const { return locals_.at(static_cast<size_t>(local)).standby; }
  const std::string& stop_reason() const { return stop_reason_; }
  /// "10.0.0.1:29500"
  const std::string& where() const { return where_; }

 private:
  void close_local(int local, const std::string& why);
  void lose(const std::string& why);
  int global(int local) const { return shape_.slot(shape_.node_rank, local); }

  NodeShape shape_;
  std::string where_;
  std::unique_ptr<LinkStream> stream_;
  struct Local {
    int fd = -1;
    int child_fd = -1;
    bool standby = false;
  };
  std::vector<Local> locals_;  // ranks, then spares
  std::string lost_reason_, stop_reason_;
  bool dismissed_ = false;
};

/// The proof a hello carries: empty without a secret.
std::string hello_proof(const std::string& secret, const std::string& nonce, const NodeShape& s);

}  // namespace troupe::elastic
