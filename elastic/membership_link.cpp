#include "elastic/membership_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "comm/status.h"
#include "comm/wire/rendezvous_wire.h"

namespace troupe::elastic {

namespace {

constexpr uint32_t kVersion = 3;  // 3: a challenge first; the hello names the job id
constexpr size_t kHeaderBytes = 4 + 1 + 4;
// The largest frame: one membership message (a table of every rank's address) and its header.
constexpr size_t kMaxFrameBytes = kMaxMessageBytes + 64;
// Queued bytes a peer that stopped reading may hold before the link counts as lost.
constexpr size_t kMaxQueuedBytes = 64u << 20;
// The longest job id a hello may name (launch checks --job-id against the same bound).
constexpr size_t kMaxJobIdBytes = 128;
// How long accepting pauses after the launcher ran out of descriptors (EMFILE): the connection
// that found it out is closed at once, and those behind it wait in the backlog meanwhile.
constexpr std::chrono::milliseconds kAcceptPause{200};

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

std::chrono::milliseconds node_silence(std::chrono::milliseconds membership_deadline) {
  return std::clamp<std::chrono::milliseconds>(membership_deadline / 3, std::chrono::seconds(3),
                                               std::chrono::seconds(10));
}

std::string hello_proof(const std::string& secret, const std::string& nonces,
                        const std::string& job_id, const NodeShape& s) {
  if (secret.empty()) return "";
  // The job id's length first: no job id and shape can read as another's.
  return actors::wire::mac(secret, "node", nonces,
                           std::to_string(job_id.size()) + ":" + job_id + "/" +
                               std::to_string(s.node_rank) + "/" + std::to_string(s.nnodes) + "/" +
                               std::to_string(s.nprocs) + "/" + std::to_string(s.spares));
}

std::string welcome_proof(const std::string& secret, const std::string& nonces,
                          const std::string& job_id) {
  if (secret.empty()) return "";
  return actors::wire::mac(secret, "hub", nonces, job_id);
}

// ---- LinkStream

LinkStream::LinkStream(int fd) : fd_(fd), max_frame_(kMaxFrameBytes) {
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

bool LinkStream::take_frames(std::vector<Frame>& frames) {
  size_t at = 0;
  while (in_.size() - at >= 4) {
    uint32_t length = 0;
    std::memcpy(&length, in_.data() + at, 4);
    // Checked as soon as the length arrives: a peer never makes this end buffer a body larger
    // than the cap.
    if (length < 5 || 4 + static_cast<size_t>(length) > max_frame_) {
      error_ = "a frame of " + std::to_string(length) + " bytes (expected 5.." +
               std::to_string(max_frame_ - 4) + ")";
      in_.clear();
      return false;
    }
    if (in_.size() - at < 4 + length) break;
    Frame f;
    f.type = static_cast<LinkFrame>(in_[at + 4]);
    int32_t slot = 0;
    std::memcpy(&slot, in_.data() + at + 5, 4);
    f.slot = slot;
    f.payload = in_.substr(at + kHeaderBytes, length - 5);
    at += 4 + length;
    frames.push_back(std::move(f));
  }
  in_.erase(0, at);
  return true;
}

bool LinkStream::read(std::vector<Frame>& frames) {
  char buffer[16 * 1024];
  for (;;) {
    // Never more than a frame's worth beyond what is buffered: what a header claims is checked
    // before its body accumulates.
    const size_t room = std::min(sizeof buffer, max_frame_ + 4);
    const ssize_t n = ::recv(fd_, buffer, room, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      if (error_.empty())
        error_ = n == 0 ? "the connection was closed" : std::string("recv: ") + strerror(errno);
      break;
    }
    last_heard_ = Clock::now();
    in_.append(buffer, static_cast<size_t>(n));
    if (!take_frames(frames)) return false;
  }
  if (!take_frames(frames)) return false;
  return error_.empty();
}

// ---- MembershipHub

MembershipHub::MembershipHub(MembershipServer& server, NodeShape shape,
                             const std::string& bind_address, int port, std::string secret,
                             std::ostream& log, std::string job_id, HandshakeLimits limits,
                             std::chrono::milliseconds silence)
    : server_(server),
      shape_(shape),
      secret_(std::move(secret)),
      log_(log),
      job_id_(std::move(job_id)),
      limits_(limits),
      silence_(silence) {
  const std::string where =
      (bind_address.empty() ? "*" : bind_address) + ":" + std::to_string(port);
  sockaddr_in address{};
  std::string error;
  if (!resolve(bind_address, port, address, error))
    throw comm::Error("elastic membership service: cannot listen at " + where + ": " + error);
  listen_fd_ = above_stdio(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (listen_fd_ < 0 ||
      bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      listen(listen_fd_, 64) != 0) {
    const int e = errno;
    if (listen_fd_ >= 0) ::close(listen_fd_);
    throw comm::Error("elastic membership service: cannot listen at " + where + ": " + strerror(e) +
                      " (expected a free port on node 0's --master-addr: the "
                      "service of an elastic job of several nodes listens at "
                      "--master-addr:--master-port)");
  }
  set_nonblocking(listen_fd_);
  reserve_fd_ = above_stdio(open("/dev/null", O_RDONLY | O_CLOEXEC));
  server_.set_remote_send(
      [this](int link, int slot, const std::string& bytes) { send(link, slot, bytes); });
  if (secret_.empty()) {
    // As the rendezvous warns (runtime.cpp): a service that takes anyone must say so.
    log_ << "troupe: elastic: WARNING: the membership service at " << where
         << " accepts any process that reaches it as a node of this job: no TROUPE_JOB_SECRET "
            "is set (export the same value of 16 or more characters on every node's launcher)\n";
    log_.flush();
  }
}

MembershipHub::~MembershipHub() {
  server_.set_remote_send(nullptr);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

void MembershipHub::add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const {
  if (Clock::now() >= accept_paused_until_) {
    fds.push_back({listen_fd_, POLLIN, 0});
    tags.push_back(-1);
  }
  for (size_t l = 0; l < links_.size(); ++l) {
    if (!links_[l].stream) continue;
    const short events =
        static_cast<short>(POLLIN | (links_[l].stream->wants_write() ? POLLOUT : 0));
    fds.push_back({links_[l].stream->fd(), events, 0});
    tags.push_back(static_cast<int>(l));
  }
}

bool MembershipHub::connected() const {
  for (const Link& l : links_)
    if (l.stream && l.node >= 0) return true;
  return false;
}

int MembershipHub::in_handshake() const {
  int n = 0;
  for (const Link& l : links_)
    if (l.stream && l.node < 0) ++n;
  return n;
}

std::string MembershipHub::node_text(int link) const {
  const Link& l = links_[static_cast<size_t>(link)];
  return (l.node >= 0 ? "the launcher of node " + std::to_string(l.node) : "a connection") +
         " (from " + (l.from.empty() ? "?" : l.from) + ")";
}

void MembershipHub::accept_all() {
  for (;;) {
    sockaddr_in peer{};
    socklen_t length = sizeof peer;
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
      // Out of descriptors: the listening socket stays readable, so returning would spin. Give
      // up the reserve to take the connection off the backlog and close it (refused), then pause
      // accepting for a while; the nodes already connected go on.
      if (reserve_fd_ >= 0) {
        ::close(reserve_fd_);
        const int taken = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (taken >= 0) ::close(taken);
        reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
      }
      accept_paused_until_ = Clock::now() + kAcceptPause;
      if (Clock::now() >= descriptors_logged_) {
        log_ << "troupe: elastic: the launcher is out of file descriptors (" << strerror(errno)
             << "): refusing new connections to the membership service for now (" << in_handshake()
             << " connections in handshake; raise `ulimit -n`)\n";
        log_.flush();
        descriptors_logged_ = Clock::now() + std::chrono::seconds(10);
      }
      return;
    }
    if (fd < 0) return;  // EAGAIN: the backlog is empty (or the peer already went)
    fd = above_stdio(fd);
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &peer.sin_addr, text, sizeof text);
    int from_there = 0, all = 0;
    for (const Link& l : links_)
      if (l.stream && l.node < 0) {
        ++all;
        if (l.from == text) ++from_there;
      }
    if (from_there >= limits_.per_address || all >= limits_.in_all) {
      ::close(fd);  // a word would tell an outsider something: a relay retries until its deadline
      continue;
    }
    Link link;
    link.stream = std::make_unique<LinkStream>(fd);
    link.stream->set_max_frame(limits_.max_frame);
    link.hello_by = Clock::now() + limits_.hello_within;
    link.from = text;
    link.nonce = actors::wire::random_bytes(actors::wire::kNonceBytes);
    link.stream->send(LinkFrame::challenge, -1, link.nonce);
    // A place whose connection never proved itself is taken again; a node's place is kept (its
    // slots may still name it).
    auto free = std::find_if(links_.begin(), links_.end(),
                             [](const Link& l) { return !l.stream && l.node < 0; });
    if (free != links_.end())
      *free = std::move(link);
    else
      links_.push_back(std::move(link));
  }
}

void MembershipHub::on_ready(int tag, short revents) {
  if (tag < 0) return accept_all();
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
}

void MembershipHub::tick() {
  const auto now = Clock::now();
  for (size_t l = 0; l < links_.size(); ++l) {
    Link& link = links_[l];
    if (!link.stream) continue;
    if (link.node < 0) {
      // Whether or not it sends: an idle connection holds a descriptor and a handshake place.
      if (now >= link.hello_by) link.stream.reset();
      continue;
    }
    if (now - link.stream->last_heard() > silence_) {
      lose(static_cast<int>(l), "nothing heard for " + std::to_string(silence_.count()) +
                                    " ms (it sends a heartbeat "
                                    "every " +
                                    std::to_string(kHeartbeatEvery.count()) +
                                    " s; the silence allowed is a "
                                    "third of --membership-timeout, within 3..10 s)");
      continue;
    }
    if (now >= link.heartbeat_at) {
      link.heartbeat_at = now + kHeartbeatEvery;
      link.stream->send(LinkFrame::heartbeat, -1, "");
    }
  }
}

Clock::time_point MembershipHub::next_deadline() const {
  Clock::time_point next = Clock::time_point::max();
  if (accept_paused_until_ > Clock::now()) next = accept_paused_until_;
  for (const Link& l : links_) {
    if (!l.stream) continue;
    if (l.node < 0)
      next = std::min(next, l.hello_by);
    else
      next = std::min({next, l.heartbeat_at, l.stream->last_heard() + silence_});
  }
  return next;
}

void MembershipHub::hello(int tag, const LinkStream::Frame& f) {
  Link& link = links_[static_cast<size_t>(tag)];
  // Until the proof is checked the peer learns nothing of the job: the refusal says "refused",
  // and this launcher's log says why.
  auto refuse = [&](const std::string& why, const std::string& told = "refused") {
    log_ << "troupe: elastic: refused " << node_text(tag) << ": " << why << "\n";
    log_.flush();
    link.stream->send(LinkFrame::refuse, -1, told);
    link.closing = true;
    if (!link.stream->wants_write()) link.stream.reset();
  };
  if (f.type != LinkFrame::hello) return refuse("it spoke before its hello");
  std::vector<std::string> fields;
  try {  // a hello's payload is the fields of a membership message without its type byte
    fields = decode(std::string(1, static_cast<char>(Message::join)) + f.payload, "hello").second;
  } catch (const comm::Error& e) {
    return refuse(e.what());
  }
  NodeShape theirs;
  try {
    if (fields.size() != 8 || std::stoul(fields[0]) != kVersion)
      return refuse("a hello of another version (expected version " + std::to_string(kVersion) +
                    " of " + std::to_string(8) + " fields)");
    theirs.node_rank = std::stoi(fields[1]);
    theirs.nnodes = std::stoi(fields[2]);
    theirs.nprocs = std::stoi(fields[3]);
    theirs.spares = std::stoi(fields[4]);
  } catch (const std::logic_error&) {
    return refuse("a malformed hello");
  }
  const std::string& their_nonce = fields[5];
  const std::string& their_job = fields[6];
  if (their_nonce.size() != actors::wire::kNonceBytes || their_job.size() > kMaxJobIdBytes)
    return refuse("a malformed hello (a nonce of " + std::to_string(their_nonce.size()) +
                  " bytes, a job id of " + std::to_string(their_job.size()) + ")");
  const std::string nonces = their_nonce + link.nonce;
  const std::string other_job =
      "node " + std::to_string(theirs.node_rank) + " is of job '" + their_job +
      "' (--job-id, TROUPE_JOB_ID), and this service serves another (expected every node of a "
      "job to be given the same job id)";
  if (!secret_.empty()) {
    if (!actors::wire::same_mac(fields[7], hello_proof(secret_, nonces, job_id_, theirs))) {
      // It holds the secret but names another job: one of the operator's own launchers, which
      // may be told why.
      if (their_job != job_id_ &&
          actors::wire::same_mac(fields[7], hello_proof(secret_, nonces, their_job, theirs)))
        return refuse(other_job, "refused: " + other_job);
      return refuse(
          "no proof of this job's TROUPE_JOB_SECRET and job id for this connection "
          "(a different secret, a replayed hello, or another job)");
    }
  } else if (their_job != job_id_) {
    return refuse(other_job, "refused: " + other_job);  // without a secret there is nothing to hide
  }
  auto refuse_known = [&](const std::string& why) { refuse(why, "refused: " + why); };
  if (theirs.nnodes != shape_.nnodes || theirs.nprocs != shape_.nprocs ||
      theirs.spares != shape_.spares)
    return refuse_known("node " + std::to_string(theirs.node_rank) + " was launched with " +
                        shape_text(theirs) + " (expected " + shape_text(shape_) +
                        ", as node 0 was)");
  if (theirs.node_rank < 1 || theirs.node_rank >= shape_.nnodes)
    return refuse_known("--node-rank " + std::to_string(theirs.node_rank) + " (expected 1.." +
                        std::to_string(shape_.nnodes - 1) + ": node 0 hosts the service)");
  for (size_t l = 0; l < links_.size(); ++l)
    if (links_[l].stream && links_[l].node == theirs.node_rank)
      return refuse_known("node " + std::to_string(theirs.node_rank) +
                          " is connected already (expected each --node-rank once)");
  link.node = theirs.node_rank;
  link.stream->set_max_frame(kMaxFrameBytes);
  link.heartbeat_at = Clock::now() + kHeartbeatEvery;
  link.stream->send(LinkFrame::welcome, -1,
                    welcome_proof(secret_, link.nonce + their_nonce, job_id_));
  log_ << "troupe: elastic: " << node_text(tag) << " connected\n";
  log_.flush();
}

void MembershipHub::handle(int tag, const LinkStream::Frame& f) {
  Link& link = links_[static_cast<size_t>(tag)];
  if (link.closing) return;
  if (link.node < 0) return hello(tag, f);
  if (f.type == LinkFrame::heartbeat) return;
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
    return lose(tag,
                "it named rank slot " + std::to_string(f.slot) + " (expected " + expected + ")");
  }
  switch (f.type) {
    case LinkFrame::attach:
      server_.attach_remote(f.slot, tag, f.payload == "1");
      break;
    case LinkFrame::relay:
      server_.on_message(f.slot, f.payload);
      break;
    case LinkFrame::closed:
      server_.on_closed(f.slot, f.payload);
      break;
    case LinkFrame::exited: {
      const size_t space = f.payload.find(' ');
      if (f.payload.compare(0, space, "0") == 0) ++finished_;
      server_.on_closed(f.slot,
                        space == std::string::npos ? f.payload : f.payload.substr(space + 1));
      break;
    }
    default:
      lose(tag, "it sent a frame of type " + std::to_string(static_cast<int>(f.type)) +
                    " the service does not expect");
  }
}

void MembershipHub::send(int link, int slot, const std::string& bytes) {
  if (link < 0 || static_cast<size_t>(link) >= links_.size()) return;
  Link& l = links_[static_cast<size_t>(link)];
  if (l.stream) l.stream->send(LinkFrame::relay, slot, bytes);
}

void MembershipHub::lose(int link, std::string why) {
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

namespace {

using Fail = std::function<comm::Error(const std::string&)>;

// A bounded connect of non-blocking `fd` to `target`: 0, or -1 with errno set (ETIMEDOUT when
// `until` came first).
int connect_until(int fd, const sockaddr_in& target, Clock::time_point until) {
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof target);
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
  return rc;
}

// The first frames `stream` reads before `until`; `open` false when the connection ended.
std::vector<LinkStream::Frame> first_frames(LinkStream& stream, Clock::time_point until,
                                            bool& open) {
  std::vector<LinkStream::Frame> frames;
  open = true;
  while (frames.empty() && open && Clock::now() < until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    pollfd p{stream.fd(), POLLIN, 0};
    poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    open = stream.read(frames);
  }
  return frames;
}

// Connects to the hub at `target` and returns its challenge, trying again until `until`: node 0's
// launcher may not listen yet, or may close a connection while it holds as many in handshake as
// it takes. `stream` is left connected to the hub; `within` names the deadline in messages.
std::string await_challenge(const sockaddr_in& target, Clock::time_point until,
                            const std::string& within, std::unique_ptr<LinkStream>& stream,
                            const Fail& fail) {
  std::string last;
  auto expired = [&] {
    return fail("no challenge from the service" + within + "; the last try: " + last);
  };
  for (;;) {
    if (Clock::now() >= until) throw expired();
    const int fd = above_stdio(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd < 0) throw fail(std::string("socket: ") + strerror(errno));
    set_nonblocking(fd);
    if (connect_until(fd, target, until) != 0) {
      last = strerror(errno);
      ::close(fd);
    } else {
      stream = std::make_unique<LinkStream>(fd);
      bool open = true;
      const std::vector<LinkStream::Frame> frames = first_frames(*stream, until, open);
      if (!frames.empty() && frames[0].type == LinkFrame::challenge &&
          frames[0].payload.size() == actors::wire::kNonceBytes)
        return frames[0].payload;
      if (!frames.empty())
        throw fail("it answered with a frame of type " +
                   std::to_string(static_cast<int>(frames[0].type)) +
                   " where a challenge was expected (another program, or another version of "
                   "troupe)");
      last = open ? std::string("connected, but no challenge came")
                  : "the connection ended before a challenge: " + stream->error();
      stream.reset();
    }
    if (Clock::now() >= until) throw expired();
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(100), until - Clock::now()));
  }
}

// The hub's first frame after this node's hello, before `until`.
LinkStream::Frame await_answer(LinkStream& stream, Clock::time_point until,
                               const std::string& within, const Fail& fail) {
  std::vector<LinkStream::Frame> frames;
  while (frames.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) throw fail("no answer to this node's hello" + within);
    pollfd p{stream.fd(), static_cast<short>(POLLIN | (stream.wants_write() ? POLLOUT : 0)), 0};
    poll(&p, 1, static_cast<int>(left.count()));
    if (!stream.flush() || (!stream.read(frames) && frames.empty()))
      throw fail("the connection ended before an answer to this node's hello: " + stream.error());
  }
  return frames[0];
}

}  // namespace

MembershipRelay::MembershipRelay(NodeShape shape, const std::string& address, int port,
                                 std::string secret, std::chrono::milliseconds deadline,
                                 std::string job_id, std::chrono::milliseconds silence)
    : shape_(shape),
      where_(address + ":" + std::to_string(port)),
      silence_(silence),
      locals_(static_cast<size_t>(shape.nprocs + shape.spares)) {
  const std::string expected =
      " (expected node 0's launcher of this job, `troupe launch --elastic --nnodes " +
      std::to_string(shape.nnodes) + " --node-rank 0 -n " + std::to_string(shape.nprocs) +
      (shape.spares > 0 ? " --spares " + std::to_string(shape.spares) : std::string()) +
      (job_id.empty() ? std::string() : " --job-id " + job_id) +
      "`, listening at --master-addr:--master-port)";
  const Fail fail = [&](const std::string& why) {
    return comm::Error("node " + std::to_string(shape.node_rank) +
                       " cannot reach the elastic membership service at " + where_ + ": " + why +
                       expected);
  };
  sockaddr_in target{};
  std::string error;
  if (!resolve(address, port, target, error)) throw fail(error);
  const auto until = Clock::now() + deadline;
  const std::string within =
      " within " + std::to_string(deadline.count()) + " ms (--membership-timeout)";
  const std::string challenge = await_challenge(target, until, within, stream_, fail);
  const std::string nonce = actors::wire::random_bytes(actors::wire::kNonceBytes);
  stream_->send(LinkFrame::hello, -1,
                encode(Message::join, {std::to_string(kVersion), std::to_string(shape.node_rank),
                                       std::to_string(shape.nnodes), std::to_string(shape.nprocs),
                                       std::to_string(shape.spares), nonce, job_id,
                                       hello_proof(secret, nonce + challenge, job_id, shape)})
                    .substr(1));
  const LinkStream::Frame answer = await_answer(*stream_, until, within, fail);
  if (answer.type == LinkFrame::refuse) {
    const std::string& told = answer.payload;
    const std::string prefix = "refused: ";
    throw comm::Error(
        "node " + std::to_string(shape.node_rank) + ": the elastic membership service at " +
        where_ + " refused this node" +
        (told.rfind(prefix, 0) == 0
             ? ": " + told.substr(prefix.size())
             : std::string(" (node 0's launcher logs why: expected the same TROUPE_JOB_SECRET, "
                           "--job-id and troupe version on every node)")));
  }
  if (answer.type != LinkFrame::welcome)
    throw fail("it answered the hello with a frame of type " +
               std::to_string(static_cast<int>(answer.type)));
  if (!actors::wire::same_mac(answer.payload, welcome_proof(secret, challenge + nonce, job_id)))
    throw fail(
        "it welcomed this node without proving it holds this job's TROUPE_JOB_SECRET "
        "(another job's launcher, or not troupe's)");
  heartbeat_at_ = Clock::now() + kHeartbeatEvery;
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
  l.expelled = false;
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
  if (stream_)
    stream_->send(LinkFrame::exited, global(local), std::to_string(exit_code) + " " + how);
}

void MembershipRelay::add_poll_fds(std::vector<pollfd>& fds, std::vector<int>& tags) const {
  if (stream_) {
    fds.push_back(
        {stream_->fd(), static_cast<short>(POLLIN | (stream_->wants_write() ? POLLOUT : 0)), 0});
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
        if (!f.payload.empty() && f.payload[0] == static_cast<char>(Message::stop))
          l.expelled = true;
        if (l.fd >= 0) (void)!::send(l.fd, f.payload.data(), f.payload.size(), MSG_NOSIGNAL);
      } else if (f.type == LinkFrame::heartbeat) {
        // The hub is alive: last_heard() moved.
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
    if (stream_)
      stream_->send(LinkFrame::relay, global(tag), buffer.substr(0, static_cast<size_t>(got)));
  }
}

void MembershipRelay::tick() {
  if (!stream_) return;
  const auto now = Clock::now();
  if (now - stream_->last_heard() > silence_)
    return lose("nothing heard for " + std::to_string(silence_.count()) +
                " ms (it sends a "
                "heartbeat every " +
                std::to_string(kHeartbeatEvery.count()) +
                " s; the silence "
                "allowed is a third of --membership-timeout, within 3..10 s)");
  if (now >= heartbeat_at_) {
    heartbeat_at_ = now + kHeartbeatEvery;
    stream_->send(LinkFrame::heartbeat, -1, "");
    if (!stream_->flush()) lose(stream_->error());
  }
}

Clock::time_point MembershipRelay::next_deadline() const {
  if (!stream_) return Clock::time_point::max();
  return std::min(heartbeat_at_, stream_->last_heard() + silence_);
}

void MembershipRelay::lose(const std::string& why) {
  if (!lost_reason_.empty()) return;
  lost_reason_ = "lost the elastic membership service at " + where_ +
                 " (node 0's launcher): " + why +
                 " (expected it to stay until every node's "
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
