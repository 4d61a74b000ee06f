#pragma once
/// The elastic membership service across nodes: one TCP connection from each node's launcher to
/// node 0's, which hosts the MembershipServer (elastic/membership.h).
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
///   hub -> relay   challenge the hub's nonce (32 random bytes), sent as soon as it accepts
///   relay -> hub   hello     version, node rank, nnodes, nprocs, spares, the relay's nonce, the
///                            job id (--job-id, TROUPE_JOB_ID; may be empty), and the proof
///                            HMAC-SHA256(TROUPE_JOB_SECRET, "node" | both nonces | job id, shape)
///   hub -> relay   welcome   HMAC-SHA256(secret, "hub" | both nonces | job id): the hub holds the
///                            secret too / refuse (why)
///   relay -> hub   attach    slot's process started (payload "1": as a spare)
///   both ways      relay     one membership message of `slot` (elastic/membership.h)
///   both ways      heartbeat nothing: the link is alive (every kHeartbeatEvery)
///   relay -> hub   closed    slot's socket closed (its process ended), payload: why
///   relay -> hub   exited    slot's process was reaped: payload: exit code, how
///   hub -> relay   stopped   the job has no quorum (why): the relay restarts nobody
///   hub -> relay   dismiss   no rank of the job runs any more: the relay's launcher stops the
///                            spares still waiting (a spare a generation took is not one)
///   relay -> hub   bye       every rank of the node has ended; the connection closes
///
/// The proof binds the hello to this connection (the hub's nonce is fresh for each) and to this
/// job (its id, not only its secret), so a hello recorded from one connection or one job is
/// worth nothing on another. Until the proof is checked, the hub tells a peer nothing about the
/// job: its refusal says "refused", and node 0's launcher logs why. A peer that holds the secret
/// but names another job id is told so (it proved it is one of the operator's own launchers).
/// Before the proof is checked a connection is held to a small frame cap, a deadline whether or
/// not it sends, and caps on connections in handshake (per address and in all); a launcher out
/// of descriptors refuses new connections instead of spinning on them.
///
/// A relay that goes without bye is a lost node: its ranks count as dead.
#include <poll.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "elastic/membership.h"

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
    return local < nprocs ? node * nprocs + local
                          : nnodes * nprocs + node * spares + local - nprocs;
  }
  /// The node whose launcher starts `slot`'s processes.
  int node_of(int slot) const {
    return slot < nnodes * nprocs ? slot / nprocs : (slot - nnodes * nprocs) / spares;
  }
  /// The local index of `slot` on its node (the inverse of slot()).
  int local_of(int slot) const {
    return slot < nnodes * nprocs ? slot % nprocs : nprocs + (slot - nnodes * nprocs) % spares;
  }
  /// Every launch slot of the job: its ranks and its spares.
  int slots() const { return nnodes * (nprocs + spares); }
};

enum class LinkFrame : uint8_t {
  hello = 1,
  welcome = 2,
  refuse = 3,
  attach = 4,
  relay = 5,
  closed = 6,
  exited = 7,
  stopped = 8,
  bye = 9,
  dismiss = 10,
  challenge = 11,
  heartbeat = 12
};

/// How often each end of an authenticated link says it is alive, and the silence after which the
/// other end counts the link as lost (node_silence()).
inline constexpr std::chrono::seconds kHeartbeatEvery{1};
/// The silence that loses a link, from the membership deadline (--membership-timeout): a third of
/// it, within 3..10 s, so that a node behind a cut link is noticed well before a generation that
/// waits for it would close without it.
std::chrono::milliseconds node_silence(std::chrono::milliseconds membership_deadline);

/// Limits on connections that have not proved themselves yet (MembershipHub).
struct HandshakeLimits {
  std::chrono::milliseconds hello_within{10000};  // from accept, whether or not it sends
  int per_address = 8;                            // connections in handshake from one IPv4 address
  int in_all = 64;                                // connections in handshake in all
  size_t max_frame = 4096;                        // the largest frame before the hello is accepted
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
  /// on an error (error() says which). A frame header that claims more than max_frame() ends the
  /// stream as soon as it arrives, before its body is buffered.
  bool read(std::vector<Frame>& frames);
  const std::string& error() const { return error_; }
  /// The largest frame this end accepts (the header and what follows).
  void set_max_frame(size_t bytes) { max_frame_ = bytes; }
  size_t max_frame() const { return max_frame_; }
  /// When bytes last arrived (a heartbeat counts).
  Clock::time_point last_heard() const { return last_heard_; }

 private:
  bool take_frames(std::vector<Frame>& frames);
  int fd_;
  size_t max_frame_;
  Clock::time_point last_heard_ = Clock::now();
  std::string in_, out_;
  std::string error_;
};

/// Node 0's side: listens at the master address and hands what the other nodes' launchers relay
/// to `server`. Driven by the launcher's poll loop.
class MembershipHub {
 public:
  /// Listens on `bind_address`:`port` (every address when empty) for the launchers of job
  /// `job_id` (empty: a job without an id) holding `secret`. Throws comm::Error naming the
  /// address when it cannot. Without a secret it warns on `log`, as the rendezvous does.
  /// `silence`: a node's link heard from for that long is lost (node_silence()).
  MembershipHub(MembershipServer& server, NodeShape shape, const std::string& bind_address,
                int port, std::string secret, std::ostream& log, std::string job_id = "",
                HandshakeLimits limits = {},
                std::chrono::milliseconds silence = std::chrono::milliseconds(10000));
  ~MembershipHub();
  MembershipHub(const MembershipHub&) = delete;
  MembershipHub& operator=(const MembershipHub&) = delete;

  /// The fds to poll; `tags` gets what on_ready() needs back for each.
  void add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const;
  void on_ready(int tag, short revents);
  /// Acts on deadlines: closes connections that did not prove themselves in time, sends
  /// heartbeats, loses nodes that went silent.
  void tick();
  /// When tick() must run next.
  Clock::time_point next_deadline() const;
  /// Connections accepted that have not proved themselves yet (tests).
  int in_handshake() const;
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
    Clock::time_point heartbeat_at;
    bool closing = false;  // refused: closes once the refusal is written
    std::string nonce;     // the hub's challenge on this connection
    std::string from;      // the peer's IPv4 address
  };
  void accept_all();
  void send(int link, int slot, const std::string& bytes);
  void handle(int link, const LinkStream::Frame& frame);
  void hello(int link, const LinkStream::Frame& frame);
  // `why` by value: it is often the stream's own error(), which lose() destroys.
  void lose(int link, std::string why);
  std::string node_text(int link) const;

  MembershipServer& server_;
  NodeShape shape_;
  std::string secret_;
  std::ostream& log_;
  std::string job_id_;
  HandshakeLimits limits_;
  std::chrono::milliseconds silence_;
  int listen_fd_ = -1;
  int reserve_fd_ = -1;  // given up to accept (and close) a connection when out of descriptors
  Clock::time_point accept_paused_until_{};
  Clock::time_point descriptors_logged_{};
  std::vector<Link> links_;  // by link id; a closed one keeps its place with no stream
  int finished_ = 0;
};

/// Node i > 0's side: one connection to the hub, and a socket pair per local rank slot.
class MembershipRelay {
 public:
  /// Connects to `address`:`port` and introduces this node of job `job_id` (empty: a job
  /// without an id), retrying until `deadline` (node 0's launcher may start later, or hold as
  /// many connections in handshake as it takes). Throws comm::Error naming the address, the node
  /// and what was expected when it cannot reach the service by then, when the hub refuses, or
  /// when the hub does not prove it holds `secret`. `silence`: the hub heard from for that long is
  /// lost (node_silence()).
  MembershipRelay(NodeShape shape, const std::string& address, int port, std::string secret,
                  std::chrono::milliseconds deadline, std::string job_id = "",
                  std::chrono::milliseconds silence = std::chrono::milliseconds(10000));
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
  /// Sends heartbeats and loses the service when it went silent.
  void tick();
  /// When tick() must run next.
  Clock::time_point next_deadline() const;
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
  /// Whether the service told local slot `local`'s process to stop (a member dropped for not
  /// joining a generation in time): ended once the service says no rank runs (dismissed()).
  bool expelled(int local) const { return locals_.at(static_cast<size_t>(local)).expelled; }
  const std::string& stop_reason() const { return stop_reason_; }
  /// "10.0.0.1:29500"
  const std::string& where() const { return where_; }

 private:
  void close_local(int local, const std::string& why);
  void lose(const std::string& why);
  int global(int local) const { return shape_.slot(shape_.node_rank, local); }

  NodeShape shape_;
  std::string where_;
  std::chrono::milliseconds silence_;
  Clock::time_point heartbeat_at_{};
  std::unique_ptr<LinkStream> stream_;
  struct Local {
    int fd = -1;
    int child_fd = -1;
    bool standby = false;
    bool expelled = false;
  };
  std::vector<Local> locals_;  // ranks, then spares
  std::string lost_reason_, stop_reason_;
  bool dismissed_ = false;
};

/// The proof a hello carries: empty without a secret. `nonces`: the relay's, then the hub's.
std::string hello_proof(const std::string& secret, const std::string& nonces,
                        const std::string& job_id, const NodeShape& s);
/// The proof a welcome carries: empty without a secret. `nonces`: the hub's, then the relay's.
std::string welcome_proof(const std::string& secret, const std::string& nonces,
                          const std::string& job_id);

}  // namespace troupe::elastic
