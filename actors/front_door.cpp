#include "actors/front_door.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <caf/all.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "actors/atoms.h"
#include "comm/status.h"
#include "comm/wire/rendezvous_wire.h"

namespace troupe::actors {

namespace {

using wire::Clock;
using wire::Frame;

// What the stand-ins want written to their connections, handed to the I/O thread.
struct Outbox {
  std::mutex mutex;
  std::condition_variable drained;
  std::map<uint64_t, std::string> pending;  // by connection id
  long unsent = 0;                          // bytes the I/O thread holds, not yet written
  int wake_fd = -1;                         // -1 once the door is closed

  void push(uint64_t id, const std::string& bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    if (wake_fd < 0) return;
    pending[id] += bytes;
    const uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof(one));
  }
};

struct StandInState {
  std::shared_ptr<Outbox> outbox;
  uint64_t id = 0;
  caf::actor directory;
  int rank = -1;  // once it has registered
  static inline const char* name = "troupe.rank_stand_in";
};

using StandIn = caf::stateful_actor<StandInState>;

std::string table_frame(bool ok, const std::string& error, const std::vector<std::string>& hosts,
                        const std::vector<std::string>& addresses,
                        const std::vector<std::string>& extras) {
  wire::Writer w;
  w.u8(ok ? 1 : 0).str(error).strs(hosts).strs(addresses).strs(extras);
  return wire::frame(Frame::table, w.bytes());
}

// A remote rank, as the directory sees it: its worker.
caf::behavior stand_in(StandIn* self, std::shared_ptr<Outbox> outbox, uint64_t id,
                       caf::actor directory) {
  self->state.outbox = std::move(outbox);
  self->state.id = id;
  self->state.directory = std::move(directory);
  return {
      [self](register_atom, int rank, int world, const std::string& host,
             const std::string& address, const std::string& extra) {
        auto& st = self->state;
        if (st.rank >= 0) return;  // one registration per connection
        st.rank = rank;
        self->request(st.directory, caf::infinite, register_atom::value, rank, world, host, address,
                      extra, caf::actor_cast<caf::actor>(self))
            .then(
                [self](table_atom, bool ok, const std::string& error,
                       const std::vector<std::string>& hosts,
                       const std::vector<std::string>& addresses,
                       const std::vector<std::string>& extras) {
                  self->state.outbox->push(self->state.id,
                                           table_frame(ok, error, hosts, addresses, extras));
                },
                [self](caf::error& e) {
                  self->state.outbox->push(
                      self->state.id,
                      table_frame(false,
                                  "the directory did not answer: " + self->system().render(e), {},
                                  {}, {}));
                });
      },
      [self](peer_down_atom, int rank, const std::string& reason, bool fatal) {
        wire::Writer w;
        w.i32(rank).str(reason.substr(0, wire::kMaxReasonBytes)).u8(fatal ? 1 : 0);
        self->state.outbox->push(self->state.id, wire::frame(Frame::peer_down, w.bytes()));
      },
      [self](failed_atom, const std::string& reason) {
        if (self->state.rank < 0) return;
        self->request(self->state.directory, caf::infinite, failed_atom::value, self->state.rank,
                      reason)
            .then([](bool) {});
      },
      [self](leave_atom) {
        if (self->state.rank < 0) return;
        self->request(self->state.directory, caf::infinite, leave_atom::value, self->state.rank)
            .then([](bool) {});
      },
      [self](closed_atom) { self->quit(caf::exit_reason::remote_link_unreachable); },
      [](flush_atom) { return true; },
  };
}

enum class Stage { tls, hello, proof, open };

struct Connection {
  std::unique_ptr<wire::Stream> stream;  // null once closed
  bool wants_write = false;              // TLS needs the socket writable to go on
  bool tls_record_seen = false;          // its first byte opens a TLS handshake record
  uint64_t id = 0;
  std::string address;  // the peer's IPv4 address
  Stage stage = Stage::hello;
  Clock::time_point deadline;  // of the handshake
  std::string in;              // the unit being read
  size_t want = wire::kHelloBytes;
  bool header = true;  // open: reading a frame header (else its body)
  Frame type = Frame::register_rank;
  std::string rank_nonce, door_nonce;
  std::string out;  // bytes to write
  caf::actor stand_in;
};

}  // namespace

struct FrontDoor::Impl {
  caf::actor_system* system = nullptr;
  caf::actor directory;
  FrontDoorOptions options;
  int listener = -1;
  int port = 0;
  std::shared_ptr<Outbox> outbox = std::make_shared<Outbox>();
  std::shared_ptr<ssl_ctx_st> tls;  // null: plain TCP
  std::atomic<bool> stopping{false};
  std::thread thread;
  std::map<uint64_t, Connection> connections;  // the I/O thread's
  std::mutex stand_ins_mutex;
  std::vector<caf::actor> stand_ins;  // of every authenticated connection, for flush()
  uint64_t next_id = 1;
  mutable std::mutex counts_mutex;
  FrontDoorCounts counts;

  void count(long FrontDoorCounts::*field) {
    std::lock_guard<std::mutex> lock(counts_mutex);
    ++(counts.*field);
  }
  void run();
  // The steps of one turn of run(): the frames queued for the connections, what to poll and until
  // when, and what one connection does with the events `ev` it got.
  void take_outbox();
  Clock::time_point poll_set(std::vector<pollfd>& fds, std::vector<uint64_t>& ids);
  void serve(Connection& c, short ev, Clock::time_point now);
  // The TLS handshake's step; false when the connection was closed.
  bool tls_step(Connection& c, short ev);
  // Reads and handles whole units while the stream has them; false when the connection must be
  // closed.
  bool read_units(Connection& c);
  void accept_all();
  void close(Connection& c, long FrontDoorCounts::*why);
  // Handles the unit `c.in` now holds; false when the connection must be closed.
  bool handle(Connection& c);
  bool handle_frame(Connection& c);
};

FrontDoor::FrontDoor(caf::actor_system& system, caf::actor directory, FrontDoorOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.system = &system;
  m.directory = std::move(directory);
  m.options = std::move(options);
  if (m.options.tls.enabled()) m.tls = wire::tls_context(m.options.tls, true);
  const std::string where = m.options.bind_address + ":" + std::to_string(m.options.port);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(m.options.port));
  if (inet_pton(AF_INET, m.options.bind_address.c_str(), &addr.sin_addr) != 1)
    throw comm::Error("the rendezvous cannot listen on '" + m.options.bind_address +
                      "' (expected an IPv4 address)");
  m.listener = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (m.listener < 0) throw comm::Error(std::string("socket: ") + std::strerror(errno));
  const int on = 1;
  ::setsockopt(m.listener, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (::bind(m.listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(m.listener, 128) != 0) {
    const int e = errno;
    ::close(m.listener);
    throw comm::Error(
        "rank 0 cannot publish the rendezvous on " + where + ": " + std::strerror(e) +
        (e == EADDRNOTAVAIL ? " (MASTER_ADDR must be an address of rank 0's host)" : ""));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(m.listener, reinterpret_cast<sockaddr*>(&addr), &len);
  m.port = ntohs(addr.sin_port);
  m.outbox->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  m.thread = std::thread([&m] { m.run(); });
}

FrontDoor::~FrontDoor() {
  auto& m = *impl_;
  flush(std::chrono::seconds(1));
  m.stopping = true;
  {
    std::lock_guard<std::mutex> lock(m.outbox->mutex);
    const uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(m.outbox->wake_fd, &one, sizeof(one));
  }
  m.thread.join();
  for (auto& [id, c] : m.connections)
    if (c.stand_in) caf::anon_send(c.stand_in, closed_atom::value);
  m.connections.clear();
  ::close(m.listener);
  std::lock_guard<std::mutex> lock(m.outbox->mutex);
  ::close(m.outbox->wake_fd);
  m.outbox->wake_fd = -1;
}

const std::string& FrontDoor::address() const { return impl_->options.bind_address; }
int FrontDoor::port() const { return impl_->port; }

FrontDoorCounts FrontDoor::counts() const {
  std::lock_guard<std::mutex> lock(impl_->counts_mutex);
  return impl_->counts;
}

void FrontDoor::flush(std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  const auto deadline = Clock::now() + timeout;
  // The directory answers once it has handled what came before (a leave, its deadline); the
  // stand-ins then answer once they have handled what it sent them meanwhile: their frames are
  // then in the outbox.
  caf::scoped_actor self{*m.system};
  self->request(m.directory, timeout, flush_atom::value).receive([](bool) {}, [](caf::error&) {});
  std::vector<caf::actor> stand_ins;
  {
    std::lock_guard<std::mutex> lock(m.stand_ins_mutex);
    stand_ins = m.stand_ins;
  }
  for (auto& s : stand_ins) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    self->request(s, left, flush_atom::value).receive([](bool) {}, [](caf::error&) {});
  }
  std::unique_lock<std::mutex> lock(m.outbox->mutex);
  m.outbox->drained.wait_until(lock, deadline,
                               [&] { return m.outbox->pending.empty() && m.outbox->unsent == 0; });
}

void FrontDoor::Impl::close(Connection& c, long FrontDoorCounts::*why) {
  if (why) count(why);
  c.stream.reset();
  if (c.stand_in) caf::anon_send(c.stand_in, closed_atom::value);
}

void FrontDoor::Impl::accept_all() {
  while (true) {
    sockaddr_in peer{};
    socklen_t len = sizeof(peer);
    const int fd =
        ::accept4(listener, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or out of descriptors: poll again later
    count(&FrontDoorCounts::accepted);
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &peer.sin_addr, buf, sizeof(buf));
    int in_handshake = 0, from_there = 0;
    for (auto& [id, c] : connections)
      if (c.stage != Stage::open) {
        ++in_handshake;
        from_there += c.address == buf;
      }
    if (in_handshake >= options.max_handshakes ||
        from_there >= options.max_handshakes_per_address) {
      ::close(fd);
      count(&FrontDoorCounts::turned_away);
      continue;
    }
    const int on = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    Connection c;
    c.stream = std::make_unique<wire::Stream>(fd, tls);
    c.stage = tls ? Stage::tls : Stage::hello;
    c.id = next_id++;
    c.address = buf;
    c.deadline = Clock::now() + options.handshake_timeout;
    connections.emplace(c.id, std::move(c));
  }
}

bool FrontDoor::Impl::handle(Connection& c) {
  switch (c.stage) {
    case Stage::tls:
      return false;  // run() finishes TLS before any unit is read
    case Stage::hello: {
      if (std::memcmp(c.in.data(), wire::kMagic, sizeof(wire::kMagic)) != 0) return false;
      c.rank_nonce = c.in.substr(sizeof(wire::kMagic));
      c.door_nonce = wire::random_bytes(wire::kNonceBytes);
      c.out += c.door_nonce + wire::mac(options.secret, "door", c.rank_nonce, c.door_nonce);
      c.stage = Stage::proof;
      c.want = wire::kMacBytes;
      return true;
    }
    case Stage::proof: {
      if (!wire::same_mac(c.in, wire::mac(options.secret, "rank", c.door_nonce, c.rank_nonce)))
        return false;
      int open = 0;
      for (auto& [id, other] : connections) open += other.stage == Stage::open;
      // One connection per rank besides rank 0, and a few for ranks whose earlier connection is
      // still being torn down.
      if (open >= options.world_size + 8) return false;
      c.stage = Stage::open;
      c.out += '\x01';
      c.stand_in = system->spawn(stand_in, outbox, c.id, directory);
      {
        std::lock_guard<std::mutex> lock(stand_ins_mutex);
        stand_ins.push_back(c.stand_in);
      }
      c.want = wire::kFrameHeaderBytes;
      c.header = true;
      count(&FrontDoorCounts::authenticated);
      return true;
    }
    case Stage::open:
      return handle_frame(c);
  }
  return false;
}

bool FrontDoor::Impl::handle_frame(Connection& c) {
  if (c.header) {
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i)
      n |= static_cast<uint32_t>(static_cast<unsigned char>(c.in[i])) << (8 * i);
    c.type = static_cast<Frame>(c.in[4]);
    if (n > wire::kMaxRankFrame) return false;
    c.header = false;
    c.want = n;
    if (n > 0) return true;
    c.in.clear();
  }
  c.header = true;
  c.want = wire::kFrameHeaderBytes;
  try {
    wire::Reader r(c.in, "a frame from " + c.address);
    switch (c.type) {
      case Frame::register_rank: {
        const int rank = r.i32();
        const int world = r.i32();
        auto host = r.str(wire::kMaxHostBytes);
        auto address = r.str(wire::kMaxAddressBytes);
        auto extra = r.str(wire::kMaxExtraBytes);
        r.done();
        caf::anon_send(c.stand_in, register_atom::value, rank, world, std::move(host),
                       std::move(address), std::move(extra));
        return true;
      }
      case Frame::failed: {
        auto reason = r.str(wire::kMaxReasonBytes);
        r.done();
        caf::anon_send(c.stand_in, failed_atom::value, std::move(reason));
        return true;
      }
      case Frame::leave:
        r.done();
        caf::anon_send(c.stand_in, leave_atom::value);
        return true;
      default:
        return false;
    }
  } catch (const comm::Error&) {
    return false;
  }
}

void FrontDoor::Impl::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (!stopping) {
    take_outbox();
    const auto next_deadline = poll_set(fds, ids);
    const auto wait =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - Clock::now());
    const int r =
        ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, wait.count())));
    if (r < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto n = ::read(outbox->wake_fd, &v, sizeof(v));
    }
    const auto now = Clock::now();
    for (size_t i = 0; i < ids.size(); ++i) serve(connections.at(ids[i]), fds[i + 2].revents, now);
    for (auto it = connections.begin(); it != connections.end();)
      it = it->second.stream ? std::next(it) : connections.erase(it);
    if (fds[1].revents & POLLIN) accept_all();
  }
}

void FrontDoor::Impl::take_outbox() {
  std::lock_guard<std::mutex> lock(outbox->mutex);
  for (auto& [id, bytes] : outbox->pending) {
    auto it = connections.find(id);
    if (it != connections.end() && it->second.stream) it->second.out += bytes;
  }
  outbox->pending.clear();
  long unsent = 0;
  for (auto& [id, c] : connections) unsent += static_cast<long>(c.out.size());
  outbox->unsent = unsent;
  if (unsent == 0) outbox->drained.notify_all();
}

Clock::time_point FrontDoor::Impl::poll_set(std::vector<pollfd>& fds, std::vector<uint64_t>& ids) {
  fds.clear();
  ids.clear();
  fds.push_back({outbox->wake_fd, POLLIN, 0});
  fds.push_back({listener, POLLIN, 0});
  auto next_deadline = Clock::now() + std::chrono::seconds(1);
  for (auto& [id, c] : connections) {
    const bool write = !c.out.empty() || c.wants_write;
    fds.push_back({c.stream->fd(), static_cast<short>(POLLIN | (write ? POLLOUT : 0)), 0});
    ids.push_back(id);
    if (c.stage != Stage::open) next_deadline = std::min(next_deadline, c.deadline);
  }
  return next_deadline;
}

void FrontDoor::Impl::serve(Connection& c, short ev, Clock::time_point now) {
  if (ev) c.wants_write = false;
  if (c.stage == Stage::tls && !tls_step(c, ev)) return;
  if (c.stage != Stage::tls && ((ev & (POLLIN | POLLHUP | POLLERR)) || c.stream->buffered())) {
    if (!read_units(c)) {
      close(c, c.stage == Stage::open
                   ? (c.in.empty() && c.header ? nullptr : &FrontDoorCounts::dropped)
                   : &FrontDoorCounts::failed);
      return;
    }
  }
  if (c.stream && !c.out.empty() && (ev & (POLLOUT | POLLIN))) {
    size_t moved = 0;
    const auto io = c.stream->write_some(c.out.data(), c.out.size(), moved);
    c.out.erase(0, moved);
    if (io == wire::Stream::Io::closed || io == wire::Stream::Io::failed) close(c, nullptr);
  }
  if (c.stream && c.stage != Stage::open && now >= c.deadline) close(c, &FrontDoorCounts::failed);
}

bool FrontDoor::Impl::tls_step(Connection& c, short ev) {
  if ((ev & POLLIN) && !c.tls_record_seen) {
    // A TLS connection opens with a handshake record (type 22). Anything else would make
    // OpenSSL wait for however long a record its first bytes announce: close it now.
    unsigned char first = 0;
    const ssize_t n = ::recv(c.stream->fd(), &first, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n == 1 && first != 22)) {
      close(c, &FrontDoorCounts::failed);
      return false;
    }
    c.tls_record_seen = n == 1;
  }
  if (!ev) return true;
  const auto io = c.stream->handshake();
  if (io == wire::Stream::Io::done) {
    c.stage = Stage::hello;  // a hello may already be buffered: read on
  } else if (io == wire::Stream::Io::want_write) {
    c.wants_write = true;
  } else if (io != wire::Stream::Io::want_read) {
    close(c, &FrontDoorCounts::failed);
    return false;
  }
  return true;
}

bool FrontDoor::Impl::read_units(Connection& c) {
  // Read what the current unit still needs, never more: a unit's size is known and capped.
  bool ok = true;
  while (ok && c.stream) {
    const size_t need = c.want - c.in.size();
    if (need == 0) {
      ok = handle(c);
      if (ok) c.in.clear();
      continue;
    }
    const size_t before = c.in.size();
    c.in.resize(c.want);
    size_t got = 0;
    const auto io = c.stream->read_some(c.in.data() + before, need, got);
    c.in.resize(before + got);
    if (io == wire::Stream::Io::done) continue;
    if (io == wire::Stream::Io::want_write) c.wants_write = true;
    if (io == wire::Stream::Io::closed || io == wire::Stream::Io::failed) ok = false;
    break;
  }
  return ok;
}

}  // namespace troupe::actors
