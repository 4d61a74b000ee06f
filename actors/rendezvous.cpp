#include "actors/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <caf/all.hpp>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "actors/atoms.h"
#include "actors/directory.h"
#include "comm/wire/rendezvous_wire.h"

namespace troupe::actors {

using wire::Clock;
using wire::Frame;

namespace {

std::string where(const RendezvousRequest& r) {
  return r.master_addr + ":" + std::to_string(r.master_port);
}

struct LinkState {
  std::shared_ptr<wire::Stream> stream;
  static inline const char* name = "troupe.directory_link";
};

// The directory, as this rank sees it: what it tells the directory goes over the connection.
caf::behavior directory_link(caf::stateful_actor<LinkState>* self,
                             std::shared_ptr<wire::Stream> stream) {
  self->state.stream = std::move(stream);
  auto send = [self](const std::string& bytes) {
    try {
      wire::send_all(*self->state.stream, bytes.data(), bytes.size(),
                     Clock::now() + std::chrono::seconds(2), "a message to rank 0");
      return true;
    } catch (const comm::Error&) {
      return false;
    }
  };
  return {
      [send](failed_atom, int, const std::string& reason) {
        wire::Writer w;
        w.str(reason.substr(0, wire::kMaxReasonBytes));
        return send(wire::frame(Frame::failed, w.bytes()));
      },
      [send](leave_atom, int) { return send(wire::frame(Frame::leave, {})); },
      [self](closed_atom) { self->quit(caf::exit_reason::remote_link_unreachable); },
  };
}

// Connects to ip:port, waiting at most until the deadline. -1 and `error` set when it fails.
int connect_to(const std::string& ip, int port, Clock::time_point deadline, std::string& error) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = std::string("socket: ") + std::strerror(errno);
    return -1;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0))) != 1) {
    error = "no TCP connection in time";
    ::close(fd);
    return -1;
  }
  int so_error = 0;
  socklen_t len = sizeof(so_error);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
  if (so_error != 0) {
    error = std::strerror(so_error);
    ::close(fd);
    return -1;
  }
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
  return fd;
}

// Why a handshake ended: `retry` when trying again may help (rank 0 busy or not up yet).
struct Refusal {
  std::string why;
  bool retry = true;
};

// The rank's side of the handshake (rendezvous_wire.h), after TLS when the job uses it. Returns
// true when rank 0 welcomed it.
bool handshake(wire::Stream& s, const std::string& secret, const std::string& job_id,
               Clock::time_point deadline, Refusal& refusal) {
  try {
    wire::tls_handshake(s, deadline, "the TLS handshake");
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    if (what.find("timed out") != std::string::npos || what.find("closed") != std::string::npos ||
        what.find("unexpected eof") != std::string::npos) {
      refusal.why = "no TLS handshake with rank 0 (" + what +
                    "): rank 0 without TLS, a stopped rank 0, or not troupe at all";
    } else {
      refusal = {"TLS with rank 0 failed: " + what, false};
    }
    return false;
  }
  const std::string nonce = wire::random_bytes(wire::kNonceBytes);
  std::string challenge(wire::kChallengeBytes, '\0');
  try {
    const std::string hello = std::string(wire::kMagic, sizeof(wire::kMagic)) + nonce;
    wire::send_all(s, hello.data(), hello.size(), deadline, "hello");
    wire::recv_exact(s, challenge.data(), challenge.size(), deadline, "challenge");
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    if (what.find("OpenSSL: ") != std::string::npos &&
        what.find("unexpected eof") == std::string::npos) {  // rank 0 refused this certificate
      refusal = {"TLS with rank 0 failed: " + what, false};
      return false;
    }
    refusal.why = what.find("timed out") != std::string::npos
                      ? "no handshake in time: something accepts connections there but does not "
                        "answer, e.g. a stopped rank 0 or another program on that port"
                      : "the connection was closed during the handshake (rank 0 busy with too "
                        "many connections, TLS on one side only, another troupe version, or not "
                        "troupe at all)";
    return false;
  }
  const std::string door_nonce = challenge.substr(0, wire::kNonceBytes);
  if (!wire::same_mac(challenge.substr(wire::kNonceBytes),
                      wire::mac(secret, "door", nonce, door_nonce))) {
    refusal = {"the process listening there does not hold this job's secret" +
                   (job_id.empty() ? std::string(" (a different TROUPE_JOB_SECRET, or another "
                                                 "job on that port)")
                                   : " and id (this rank's job is '" + job_id +
                                         "', TROUPE_JOB_ID: another job on that port, or a "
                                         "different TROUPE_JOB_SECRET)"),
               false};
    return false;
  }
  char welcome = 0;
  try {
    const std::string proof = wire::mac(secret, "rank", door_nonce, nonce);
    wire::send_all(s, proof.data(), proof.size(), deadline, "proof");
    wire::recv_exact(s, &welcome, 1, deadline, "welcome");
  } catch (const comm::Error& e) {
    refusal.why = std::string(e.what()).find("timed out") != std::string::npos
                      ? "rank 0 did not welcome this rank in time after its proof (a busy rank 0)"
                      : "rank 0 closed the connection after the handshake (too many ranks "
                        "connected, or rank 0 stopping)";
    return false;
  }
  return welcome == 1;
}

}  // namespace

/// Ranks other than 0: the connection to rank 0's front door after the rendezvous; a thread
/// reads the directory's news of lost ranks and hands them to the worker.
class DirectoryConnection {
 public:
  DirectoryConnection(caf::actor_system& system, std::shared_ptr<wire::Stream> stream,
                      caf::actor worker)
      : stream_(std::move(stream)) {
    link_ = system.spawn(directory_link, stream_);
    reader_ = std::thread([this, worker = std::move(worker)] { read(worker); });
  }

  ~DirectoryConnection() {
    stopping_ = true;
    stream_->shutdown();  // wakes the reader; rank 0 sees the connection end
    reader_.join();
    caf::anon_send(link_, closed_atom::value);
  }

  const caf::actor& link() const { return link_; }

 private:
  void read(const caf::actor& worker) {
    try {
      while (!stopping_) {
        pollfd p{stream_->fd(), POLLIN, 0};
        if (!stream_->buffered() && ::poll(&p, 1, -1) < 0) {
          if (errno == EINTR) continue;
          break;
        }
        auto [type, body] = wire::recv_frame(
            *stream_, 64 * 1024, Clock::now() + std::chrono::seconds(10), "a message from rank 0");
        if (type != Frame::peer_down) break;
        wire::Reader r(body, "a peer-down message from rank 0");
        const int rank = r.i32();
        auto reason = r.str(wire::kMaxReasonBytes + 1024);
        const bool fatal = r.u8() != 0;
        r.done();
        caf::anon_send(worker, peer_down_atom::value, rank, std::move(reason), fatal);
      }
    } catch (const comm::Error&) {
    }
    if (!stopping_) caf::anon_send(link_, closed_atom::value);
  }

  std::shared_ptr<wire::Stream> stream_;
  caf::actor link_;
  std::thread reader_;
  std::atomic<bool> stopping_{false};
};

PublishedDirectory publish_directory(caf::actor_system& system, const RendezvousRequest& request) {
  FrontDoorOptions door;
  door.bind_address = request.bind_address.empty()
                          ? wire::resolve_ipv4(request.master_addr, "MASTER_ADDR")
                          : request.bind_address;
  door.port = request.master_port;
  door.secret = wire::job_key(request.secret, request.job_id);
  door.tls = request.tls;
  door.world_size = request.world_size;
  door.handshake_timeout =
      std::min<std::chrono::milliseconds>(request.timeout, std::chrono::seconds(5));
  PublishedDirectory out;
  out.directory = spawn_directory(system, request.world_size, request.timeout);
  try {
    out.door = std::make_unique<FrontDoor>(system, out.directory, door);
  } catch (...) {
    caf::anon_send_exit(out.directory, caf::exit_reason::user_shutdown);
    throw;
  }
  return out;
}

namespace {

// The directory answers by its own deadline, which names the missing ranks; a little slack lets
// that answer arrive when rank 0 started after this rank.
constexpr auto kAnswerSlack = std::chrono::seconds(1);

// Rank 0: registers with the directory in this process.
PeerTable register_locally(caf::actor_system& system, const RendezvousRequest& request,
                           const caf::actor& worker, const caf::actor& directory,
                           Clock::time_point deadline) {
  PeerTable table;
  std::string failure;
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  caf::scoped_actor self{system};
  self->request(directory, std::max(remaining, std::chrono::milliseconds(0)) + kAnswerSlack,
                register_atom::value, request.rank, request.world_size, request.host,
                request.address, request.extra, worker)
      .receive(
          [&](table_atom, bool ok, const std::string& error, const std::vector<std::string>& hosts,
              const std::vector<std::string>& addresses, const std::vector<std::string>& extras) {
            if (!ok) failure = error;
            table.hosts = hosts;
            table.addresses = addresses;
            table.extras = extras;
          },
          [&](caf::error& e) { failure = "rendezvous failed for rank 0: " + system.render(e); });
  if (!failure.empty()) throw comm::Error(failure);
  table.directory = directory;
  return table;
}

// Another rank: a connection to rank 0's front door that passed the handshake, trying again until
// the deadline (rank 0 may not be up yet, or busy).
std::shared_ptr<wire::Stream> join_front_door(const RendezvousRequest& request,
                                              Clock::time_point deadline) {
  const std::string ip = wire::resolve_ipv4(request.master_addr, "MASTER_ADDR");
  const auto fail = [&](const std::string& why) {
    return comm::Error("rank " + std::to_string(request.rank) + " cannot reach the rendezvous at " +
                       where(request) + " within " + std::to_string(request.timeout.count()) +
                       " ms (last error: " + why + ")");
  };
  const auto tls = request.tls.enabled() ? wire::tls_context(request.tls, false) : nullptr;
  std::string last_error;
  auto backoff = std::chrono::milliseconds(20);
  while (true) {
    const int fd = connect_to(ip, request.master_port, deadline, last_error);
    if (fd >= 0) {
      auto stream = std::make_shared<wire::Stream>(fd, tls);
      Refusal refusal;
      if (handshake(*stream, wire::job_key(request.secret, request.job_id), request.job_id,
                    deadline, refusal))
        return stream;
      stream.reset();
      last_error = refusal.why;
      if (!refusal.retry)
        throw comm::Error("rank " + std::to_string(request.rank) +
                          " cannot join the rendezvous at " + where(request) + ": " + refusal.why);
    }
    const auto now = Clock::now();
    if (now >= deadline) throw fail(last_error);
    // Rank 0 may not be up yet: retry, slowly growing the pause (an attempt that would start at
    // the deadline could only time out, hiding the reason of the one before).
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    if (Clock::now() >= deadline) throw fail(last_error);
  }
}

// Registers over `stream` and returns the peer table rank 0's directory sent back.
PeerTable register_remotely(wire::Stream& stream, const RendezvousRequest& request,
                            Clock::time_point deadline) {
  PeerTable table;
  std::string failure;
  const std::string at =
      "rendezvous at " + where(request) + " failed for rank " + std::to_string(request.rank) + ": ";
  try {
    wire::Writer w;
    w.i32(request.rank)
        .i32(request.world_size)
        .str(request.host.substr(0, wire::kMaxHostBytes))
        .str(request.address)
        .str(request.extra);
    const auto bytes = wire::frame(Frame::register_rank, w.bytes());
    wire::send_all(stream, bytes.data(), bytes.size(), deadline + kAnswerSlack, "registering");
    // The table grows with the world: each rank's host, address and extra bytes, within the
    // caps rank 0 checked them against.
    const uint64_t cap =
        1024 + static_cast<uint64_t>(request.world_size) * (12 + wire::kMaxHostBytes + 16 * 1024);
    auto [type, body] =
        wire::recv_frame(stream, static_cast<uint32_t>(std::min<uint64_t>(cap, 1u << 30)),
                         deadline + kAnswerSlack, "waiting for the peer table");
    if (type != Frame::table) throw comm::Error("rank 0 sent something other than the peer table");
    wire::Reader r(body, "the peer table");
    const bool ok = r.u8() != 0;
    const auto error = r.str(64 * 1024);
    const auto n = static_cast<size_t>(request.world_size);
    table.hosts = r.strs(n, wire::kMaxHostBytes);
    table.addresses = r.strs(n, wire::kMaxAddressBytes);
    table.extras = r.strs(n, wire::kMaxExtraBytes);
    r.done();
    if (!ok) failure = error;
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    failure = at + (what.find("timed out") != std::string::npos
                        ? "no peer table from the directory within " +
                              std::to_string(request.timeout.count()) +
                              " ms (+1 s): rank 0 does not answer (stopped?)"
                        : what);
  }
  if (!failure.empty()) throw comm::Error(failure);
  return table;
}

}  // namespace

PeerTable rendezvous(caf::actor_system& system, const RendezvousRequest& request,
                     const caf::actor& worker, caf::actor directory) {
  const auto deadline = Clock::now() + request.timeout;
  if (directory)  // rank 0: the directory is local
    return register_locally(system, request, worker, directory, deadline);
  std::shared_ptr<wire::Stream> stream = join_front_door(request, deadline);
  PeerTable table = register_remotely(*stream, request, deadline);
  table.connection = std::make_shared<DirectoryConnection>(system, std::move(stream), worker);
  table.directory = table.connection->link();
  return table;
}

}  // namespace troupe::actors
