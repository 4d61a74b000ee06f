#include "runtime/membership_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "actors/rendezvous_wire.h"
#include "comm/status.h"

namespace troupe::elastic {

namespace {

constexpr uint32_t kVersion = 2;  // 2: the hello names the spares per node
constexpr size_t kHeaderBytes = 4 + 1 + 4;
// The largest frame: one membership message (a table of every rank's address) and its header.
constexpr size_t kMaxFrameBytes = kMaxMessageBytes + 64;
// Queued bytes a peer that stopped reading may hold before the link counts as lost.
constexpr size_t kMaxQueuedBytes = 64u << 20;
constexpr std::chrono::seconds kHelloWithin{10};

int above_stdio(int fd) {
  if (fd < 0 || fd > 2) return fd;
  const int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  ::close(fd);
  return moved;
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

std::string shape_text(const NodeShape& s) {
  return "--nnodes " + std::to_string(s.nnodes) + " -n " + std::to_string(s.nprocs) +
         (s.spares > 0 ? " --spares " + std::to_string(s.spares) : std::string());
}

// The IPv4 address of `host` (a dotted quad or a name), or "" with `error` set.
bool resolve(const std::string& host, int port, sockaddr_in& out, std::string& error) {
  out = {};
  out.sin_family = AF_INET;
  out.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty()) {
    out.sin_addr.s_addr = htonl(INADDR_ANY);
    return true;
  }
  if (inet_pton(AF_INET, host.c_str(), &out.sin_addr) == 1) return true;
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    error = "cannot resolve '" + host + "': " + gai_strerror(rc);
    return false;
  }
  out.sin_addr = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
  freeaddrinfo(found);
  return true;
}

}  // namespace

std::string hello_proof(const std::string& secret, const std::string& nonce, const NodeShape& s) {
  if (secret.empty()) return "";
  return actors::wire::mac(secret, "node", nonce,
                           std::to_string(s.node_rank) + "/" + std::to_string(s.nnodes) + "/" +
                               std::to_string(s.nprocs) + "/" + std::to_string(s.spares));
}

// ---- LinkStream

LinkStream::LinkStream(int fd) : fd_(fd) {
  set_nonblocking(fd_);
  const int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

LinkStream::~LinkStream() {
  if (fd_ >= 0) ::close(fd_);
}

void LinkStream::send(LinkFrame type, int slot, const std::string& payload) {
  if (!error_.empty()) return;
  const uint32_t length = static_cast<uint32_t>(1 + 4 + payload.size());
  const int32_t s = slot;
  out_.append(reinterpret_cast<const char*>(&length), 4);
  out_.push_back(static_cast<char>(type));
  out_.append(reinterpret_cast<const char*>(&s), 4);
  out_ += payload;
  if (out_.size() > kMaxQueuedBytes) {
    error_ = "the peer took no bytes while " + std::to_string(out_.size()) + " were queued";
    return;
  }
  flush();
}

bool LinkStream::flush() {
  while (error_.empty() && !out_.empty()) {
    const ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0) {
      error_ = std::string("send: ") + strerror(errno);
      break;
    }
    out_.erase(0, static_cast<size_t>(n));
  }
  return error_.empty();
}

bool LinkStream::read(std::vector<Frame>& frames) {
  char buffer[64 * 1024];
  for (;;) {
    const ssize_t n = ::recv(fd_, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      if (error_.empty())
        error_ = n == 0 ? "the connection was closed" : std::string("recv: ") + strerror(errno);
      break;
    }
    in_.append(buffer, static_cast<size_t>(n));
  }
  while (in_.size() >= kHeaderBytes) {
    uint32_t length = 0;
    std::memcpy(&length, in_.data(), 4);
    if (length < 5 || length > kMaxFrameBytes) {
      error_ = "a frame of " + std::to_string(length) + " bytes (expected 5.." +
               std::to_string(kMaxFrameBytes) + ")";
      return false;
    }
    if (in_.size() < 4 + length) break;
    Frame f;
    f.type = static_cast<LinkFrame>(in_[4]);
    int32_t slot = 0;
    std::memcpy(&slot, in_.data() + 5, 4);
    f.slot = slot;
    f.payload = in_.substr(kHeaderBytes, length - 5);
    in_.erase(0, 4 + length);
    frames.push_back(std::move(f));
  }
  return error_.empty();
}

// ---- MembershipHub

MembershipHub::MembershipHub(MembershipServer& server, NodeShape shape,
                             const std::string& bind_address, int port, std::string secret,
                             std::ostream& log)
    : server_(server), shape_(shape), secret_(std::move(secret)), log_(log) {
  const std::string where = (bind_address.empty() ? "*" : bind_address) + ":" + std::to_string(port);
  sockaddr_in address{};
  std::string error;
  if (!resolve(bind_address, port, address, error))
    throw comm::Error("elastic membership service: cannot listen at " + where + ": " + error);
  listen_fd_ = above_stdio(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      listen(listen_fd_, 64) != 0) {
    const int e = errno;
    if (listen_fd_ >= 0) ::close(listen_fd_);
    throw comm::Error("elastic membership service: cannot listen at " + where + ": " +
                      strerror(e) + " (expected a free port on node 0's --master-addr: the "
                      "service of an elastic job of several nodes listens at "
                      "--master-addr:--master-port)");
  }
  set_nonblocking(listen_fd_);
  server_.set_remote_send(
      [this](int link, int slot, const std::string& bytes) { send(link, slot, bytes); });
}

MembershipHub::~MembershipHub() {
  server_.set_remote_send(nullptr);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void MembershipHub::add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const {
  fds.push_back({listen_fd_, POLLIN, 0});
  tags.push_back(-1);
  for (size_t l = 0; l < links_.size(); ++l) {
    if (!links_[l].stream) continue;
    const short events = static_cast<short>(POLLIN | (links_[l].stream->wants_write() ? POLLOUT : 0));
    fds.push_back({links_[l].stream->fd(), events, 0});
    tags.push_back(static_cast<int>(l));
  }
}

bool MembershipHub::connected() const {
  for (const Link& l : links_)
    if (l.stream && l.node >= 0) return true;
  return false;
}

std::string MembershipHub::node_text(int link) const {
  const Link& l = links_[static_cast<size_t>(link)];
  sockaddr_in peer{};
  socklen_t length = sizeof peer;
  std::string from = "?";
  if (l.stream && getpeername(l.stream->fd(), reinterpret_cast<sockaddr*>(&peer), &length) == 0) {
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &peer.sin_addr, text, sizeof text);
    from = text;
  }
  return (l.node >= 0 ? "the launcher of node " + std::to_string(l.node) : "a connection") +
         " (from " + from + ")";
}

void MembershipHub::on_ready(int tag, short revents) {
  if (tag < 0) {
    for (;;) {
      const int fd = above_stdio(accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
      if (fd < 0) return;
      Link link;
      link.stream = std::make_unique<LinkStream>(fd);
      link.hello_by = Clock::now() + kHelloWithin;
      links_.push_back(std::move(link));
    }
  }
  Link& link = links_[static_cast<size_t>(tag)];
  if (!link.stream) return;
  if (revents & POLLOUT) link.stream->flush();
  if (link.closing && !link.stream->wants_write()) {
    link.stream.reset();
    return;
  }
  std::vector<LinkStream::Frame> frames;
  const bool open = link.stream->read(frames);
  for (const auto& f : frames) {
    if (!links_[static_cast<size_t>(tag)].stream) return;
    handle(tag, f);
  }
  if (!links_[static_cast<size_t>(tag)].stream) return;
  if (!open || !links_[static_cast<size_t>(tag)].stream->flush())
    lose(tag, links_[static_cast<size_t>(tag)].stream->error());
  else if (link.node < 0 && !link.closing && Clock::now() > link.hello_by)
    lose(tag, "no hello within " + std::to_string(kHelloWithin.count()) + " s");
}

void MembershipHub::handle(int tag, const LinkStream::Frame& f) {
  Link& link = links_[static_cast<size_t>(tag)];
  if (link.closing) return;
  auto refuse = [&](const std::string& why) {
    log_ << "troupe: elastic: refused " << node_text(tag) << ": " << why << "\n";
    log_.flush();
    link.stream->send(LinkFrame::refuse, -1, why);
    link.closing = true;
    if (!link.stream->wants_write()) link.stream.reset();
  };
  if (link.node < 0) {
    if (f.type != LinkFrame::hello) return refuse("it spoke before its hello");
    std::vector<std::string> fields;
    try {  // a hello's payload is the fields of a membership message without its type byte
      fields = decode(std::string(1, static_cast<char>(Message::join)) + f.payload, "hello").second;
    } catch (const comm::Error& e) {
      return refuse(e.what());
    }
    NodeShape theirs;
    try {
      if (fields.size() != 7 || std::stoul(fields[0]) != kVersion)
        return refuse("a hello of another version (expected version " +
                      std::to_string(kVersion) + ")");
      theirs.node_rank = std::stoi(fields[1]);
      theirs.nnodes = std::stoi(fields[2]);
      theirs.nprocs = std::stoi(fields[3]);
      theirs.spares = std::stoi(fields[4]);
    } catch (const std::logic_error&) {
      return refuse("a malformed hello");
    }
    if (theirs.nnodes != shape_.nnodes || theirs.nprocs != shape_.nprocs ||
        theirs.spares != shape_.spares)
      return refuse("node " + std::to_string(theirs.node_rank) + " was launched with " +
                    shape_text(theirs) + " (expected " + shape_text(shape_) +
                    ", as node 0 was)");
    if (theirs.node_rank < 1 || theirs.node_rank >= shape_.nnodes)
      return refuse("--node-rank " + std::to_string(theirs.node_rank) + " (expected 1.." +
                    std::to_string(shape_.nnodes - 1) + ": node 0 hosts the service)");
    for (size_t l = 0; l < links_.size(); ++l)
      if (links_[l].stream && links_[l].node == theirs.node_rank)
        return refuse("node " + std::to_string(theirs.node_rank) +
                      " is connected already (expected each --node-rank once)");
    if (!secret_.empty() &&
        !actors::wire::same_mac(fields[6], hello_proof(secret_, fields[5], theirs)))
      return refuse("node " + std::to_string(theirs.node_rank) +
                    " did not prove it holds this job's TROUPE_JOB_SECRET (expected the same "
                    "value on every node)");
    link.node = theirs.node_rank;
    link.stream->send(LinkFrame::welcome, -1, "");
    log_ << "troupe: elastic: " << node_text(tag) << " connected\n";
    log_.flush();
    return;
  }
  if (f.type == LinkFrame::bye) {
    link.stream.reset();
    return;
  }
  if (f.slot < 0 || f.slot >= shape_.slots() || shape_.node_of(f.slot) != link.node) {
    const int first = link.node * shape_.nprocs;
    std::string expected = std::to_string(first) + ".." + std::to_string(first + shape_.nprocs - 1);
    if (shape_.spares > 0) {
      const int spare = shape_.slot(link.node, shape_.nprocs);
      expected += " or its spares' " + std::to_string(spare) + ".." +
                  std::to_string(spare + shape_.spares - 1);
    }
    return lose(tag, "it named rank slot " + std::to_string(f.slot) + " (expected " + expected +
                         ")");
  }
  switch (f.type) {
    case LinkFrame::attach: server_.attach_remote(f.slot, tag, f.payload == "1"); break;
    case LinkFrame::relay: server_.on_message(f.slot, f.payload); break;
    case LinkFrame::closed: server_.on_closed(f.slot, f.payload); break;
    case LinkFrame::exited: {
      const size_t space = f.payload.find(' ');
      if (f.payload.compare(0, space, "0") == 0) ++finished_;
      server_.on_closed(f.slot, space == std::string::npos ? f.payload : f.payload.substr(space + 1));
      break;
    }
    default: lose(tag, "it sent a frame of type " + std::to_string(static_cast<int>(f.type)) +
                           " the service does not expect");
  }
}

void MembershipHub::send(int link, int slot, const std::string& bytes) {
  if (link < 0 || static_cast<size_t>(link) >= links_.size()) return;
  Link& l = links_[static_cast<size_t>(link)];
  if (l.stream) l.stream->send(LinkFrame::relay, slot, bytes);
}

void MembershipHub::lose(int link, const std::string& why) {
  Link& l = links_[static_cast<size_t>(link)];
  const std::string who = node_text(link);
  const int node = l.node;
  l.stream.reset();
  if (node < 0) return;
  log_ << "troupe: elastic: lost " << who << ": " << why << "\n";
  log_.flush();
  for (int local = 0; local < shape_.nprocs + shape_.spares; ++local)
    server_.on_closed(shape_.slot(node, local), "its node's launcher was lost (" + why + ")");
}

void MembershipHub::stopped(const std::string& why) {
  for (Link& l : links_)
    if (l.stream && l.node >= 0) l.stream->send(LinkFrame::stopped, -1, why);
}

void MembershipHub::dismiss() {
  for (Link& l : links_)
    if (l.stream && l.node >= 0) l.stream->send(LinkFrame::dismiss, -1, "");
}

void MembershipHub::drop_all(const std::string& why) {
  for (size_t l = 0; l < links_.size(); ++l)
    if (links_[l].stream) lose(static_cast<int>(l), why);
}

// ---- MembershipRelay

MembershipRelay::MembershipRelay(NodeShape shape, const std::string& address, int port,
                                 std::string secret, std::chrono::milliseconds deadline)
    : shape_(shape), where_(address + ":" + std::to_string(port)),
      locals_(static_cast<size_t>(shape.nprocs + shape.spares)) {
  const std::string expected =
      " (expected node 0's launcher of this job, `troupe launch --elastic --nnodes " +
      std::to_string(shape.nnodes) + " --node-rank 0 -n " + std::to_string(shape.nprocs) +
      (shape.spares > 0 ? " --spares " + std::to_string(shape.spares) : std::string()) +
      "`, listening at --master-addr:--master-port)";
  auto fail = [&](const std::string& why) {
    return comm::Error("node " + std::to_string(shape.node_rank) +
                       " cannot reach the elastic membership service at " + where_ + ": " + why +
                       expected);
  };
  sockaddr_in target{};
  std::string error;
  if (!resolve(address, port, target, error)) throw fail(error);
  const auto until = Clock::now() + deadline;
  int fd = -1;
  std::string last;
  for (;;) {
    fd = above_stdio(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd < 0) throw fail(std::string("socket: ") + strerror(errno));
    // A bounded connect: non-blocking, then poll until the deadline.
    set_nonblocking(fd);
    int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof target);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) == 1) {
        int so_error = 0;
        socklen_t length = sizeof so_error;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &length);
        rc = so_error == 0 ? 0 : -1;
        errno = so_error;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) break;
    last = strerror(errno);
    ::close(fd);
    if (Clock::now() >= until)
      throw fail("no connection within " + std::to_string(deadline.count()) +
                 " ms (--membership-timeout); the last try: " + last);
    // Node 0's launcher may not listen yet: try again soon, within the deadline.
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(100),
                                                          until - Clock::now()));
  }
  stream_ = std::make_unique<LinkStream>(fd);
  const std::string nonce = actors::wire::random_bytes(32);
  stream_->send(LinkFrame::hello, -1,
                encode(Message::join, {std::to_string(kVersion), std::to_string(shape.node_rank),
                                       std::to_string(shape.nnodes), std::to_string(shape.nprocs),
                                       std::to_string(shape.spares), nonce, hello_proof(secret, nonce, shape)})
                    .substr(1));
  // The answer, within the deadline.
  std::vector<LinkStream::Frame> frames;
  while (frames.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) throw fail("no answer to this node's hello within " + std::to_string(deadline.count()) +
                                " ms (--membership-timeout)");
    pollfd p{stream_->fd(), static_cast<short>(POLLIN | (stream_->wants_write() ? POLLOUT : 0)), 0};
    poll(&p, 1, static_cast<int>(left.count()));
    if (!stream_->flush() || (!stream_->read(frames) && frames.empty()))
      throw fail("the connection ended before an answer to this node's hello: " +
                 stream_->error());
  }
  if (frames[0].type == LinkFrame::refuse)
    throw comm::Error("node " + std::to_string(shape.node_rank) +
                      ": the elastic membership service at " + where_ +
                      " refused this node: " + frames[0].payload);
  if (frames[0].type != LinkFrame::welcome)
    throw fail("it answered the hello with a frame of type " +
               std::to_string(static_cast<int>(frames[0].type)));
}

MembershipRelay::~MembershipRelay() {
  for (Local& l : locals_) {
    if (l.fd >= 0) ::close(l.fd);
    if (l.child_fd >= 0) ::close(l.child_fd);
  }
}

int MembershipRelay::attach(int local, bool standby) {
  Local& l = locals_.at(static_cast<size_t>(local));
  if (l.fd >= 0) close_local(local, "it was started again");
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    throw comm::Error(std::string("membership relay: socketpair: ") + strerror(errno));
  l.fd = above_stdio(fds[0]);
  l.child_fd = above_stdio(fds[1]);
  l.standby = standby;
  set_nonblocking(l.fd);
  if (stream_) stream_->send(LinkFrame::attach, global(local), standby ? "1" : "0");
  return l.child_fd;
}

void MembershipRelay::started(int local) {
  Local& l = locals_.at(static_cast<size_t>(local));
  if (l.child_fd >= 0) ::close(l.child_fd);
  l.child_fd = -1;
}

void MembershipRelay::close_local(int local, const std::string& why) {
  Local& l = locals_[static_cast<size_t>(local)];
  if (l.fd < 0) return;
  ::close(l.fd);
  l.fd = -1;
  if (stream_) stream_->send(LinkFrame::closed, global(local), why);
}

void MembershipRelay::on_exit(int local, int exit_code, const std::string& how) {
  close_local(local, how);
  if (stream_) stream_->send(LinkFrame::exited, global(local), std::to_string(exit_code) + " " + how);
}

void MembershipRelay::add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const {
  if (stream_) {
    fds.push_back({stream_->fd(), static_cast<short>(POLLIN | (stream_->wants_write() ? POLLOUT : 0)), 0});
    tags.push_back(-1);
  }
  for (size_t i = 0; i < locals_.size(); ++i)
    if (locals_[i].fd >= 0) {
      fds.push_back({locals_[i].fd, POLLIN, 0});
      tags.push_back(static_cast<int>(i));
    }
}

void MembershipRelay::on_ready(int tag, short revents) {
  if (tag < 0) {
    if (!stream_) return;
    if (revents & POLLOUT) stream_->flush();
    std::vector<LinkStream::Frame> frames;
    const bool open = stream_->read(frames);
    for (const auto& f : frames) {
      if (f.type == LinkFrame::relay) {
        if (f.slot < 0 || f.slot >= shape_.slots() || shape_.node_of(f.slot) != shape_.node_rank)
          continue;
        Local& l = locals_[static_cast<size_t>(shape_.local_of(f.slot))];
        // An assignment takes a spare into a generation: it is a rank from now on.
        if (!f.payload.empty() && f.payload[0] == static_cast<char>(Message::assign))
          l.standby = false;
        if (l.fd >= 0) (void)!::send(l.fd, f.payload.data(), f.payload.size(), MSG_NOSIGNAL);
      } else if (f.type == LinkFrame::stopped) {
        stop_reason_ = f.payload;
      } else if (f.type == LinkFrame::dismiss) {
        dismissed_ = true;
      }
    }
    if (!open || !stream_->flush()) lose(stream_->error());
    return;
  }
  Local& l = locals_[static_cast<size_t>(tag)];
  std::string buffer(kMaxMessageBytes, '\0');
  while (l.fd >= 0) {
    const ssize_t got = ::recv(l.fd, buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (got <= 0) {
      close_local(tag, "its process ended");
      return;
    }
    if (stream_) stream_->send(LinkFrame::relay, global(tag), buffer.substr(0, static_cast<size_t>(got)));
  }
}

void MembershipRelay::lose(const std::string& why) {
  if (!lost_reason_.empty()) return;
  lost_reason_ = "lost the elastic membership service at " + where_ +
                 " (node 0's launcher): " + why + " (expected it to stay until every node's "
                 "ranks ended)";
  stream_.reset();
  // The ranks learn it from their sockets closing: their Runtimes fail at once.
  for (Local& l : locals_)
    if (l.fd >= 0) {
      ::close(l.fd);
      l.fd = -1;
    }
}

void MembershipRelay::finish(std::chrono::milliseconds deadline) {
  if (!stream_) return;
  stream_->send(LinkFrame::bye, -1, "");
  const auto until = Clock::now() + deadline;
  while (stream_->wants_write() && stream_->flush() && Clock::now() < until) {
    pollfd p{stream_->fd(), POLLOUT, 0};
    poll(&p, 1, 100);
  }
  stream_.reset();
}

}  // namespace troupe::elastic
