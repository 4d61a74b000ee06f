// The membership link between nodes (elastic/membership_link.h) against real sockets: node 0's
// hub served on this thread, real relays (node 1's side) on others, and raw connections that
// behave as an outsider would: a replayed hello, a node of another job, idle connections, a huge
// frame header, and a flood under a low descriptor limit.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/status.h"
#include "elastic/launch.h"
#include "elastic/membership.h"
#include "elastic/membership_link.h"
#include "rank/membership_client.h"

using namespace troupe;
using namespace troupe::elastic;
using namespace std::chrono_literals;

namespace {

const std::string kSecret = "membership-link-test-secret-0123456789";

/// Node 0's side of a job of two nodes of two ranks: a membership server and its hub on a free
/// port, served on the test's thread by pump().
struct Hub {
  std::ostringstream log;
  MembershipServer server{4, 2, 5s, log, 4};
  int port = pick_free_port();
  MembershipHub hub;
  Hub(const std::string& secret, const std::string& job, HandshakeLimits limits = {},
      std::chrono::milliseconds silence = 10s)
      : hub(server, {2, 2, 0}, "127.0.0.1", port, secret, log, job, limits, silence) {}
  /// Serves until `done()` or `limit` passed; whether done() came true.
  bool pump(const std::function<bool()>& done, std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!done()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::vector<pollfd> fds;
      std::vector<int> tags;
      hub.add_poll_fds(fds, tags);
      poll(fds.data(), fds.size(), 20);
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents) hub.on_ready(tags[i], fds[i].revents);
      hub.tick();
    }
    return true;
  }
};

/// A relay of node 1 connecting on another thread (its constructor blocks until welcomed).
std::future<std::string> relay_of(int port, const std::string& secret, const std::string& job,
                                  std::unique_ptr<MembershipRelay>& out) {
  return std::async(std::launch::async, [port, secret, job, &out]() -> std::string {
    try {
      out =
          std::make_unique<MembershipRelay>(NodeShape{2, 2, 1}, "127.0.0.1", port, secret, 5s, job);
    } catch (const comm::Error& e) {
      return e.what();
    }
    return "";
  });
}

bool ready(std::future<std::string>& f) { return f.wait_for(0s) == std::future_status::ready; }
bool ready_assignment(std::future<Assignment>& f) {
  return f.wait_for(0s) == std::future_status::ready;
}

int connect_raw(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

/// What a raw connection holds now: bytes read (without waiting), and whether it ended.
struct Seen {
  std::string bytes;
  bool ended = false;
};
void take(int fd, Seen& seen) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n > 0) {
      seen.bytes.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) seen.ended = true;
    return;
  }
}

/// The frames in `bytes` (u32 length, u8 type, i32 slot, payload).
std::vector<std::pair<int, std::string>> frames_of(const std::string& bytes) {
  std::vector<std::pair<int, std::string>> out;
  size_t at = 0;
  while (bytes.size() - at >= 9) {
    uint32_t length = 0;
    std::memcpy(&length, bytes.data() + at, 4);
    if (bytes.size() - at < 4 + length) break;
    out.emplace_back(static_cast<uint8_t>(bytes[at + 4]), bytes.substr(at + 9, length - 5));
    at += 4 + length;
  }
  return out;
}

/// Forwards one connection from a free port to `port`, recording what the client sent.
struct Recorder {
  int port = pick_free_port();
  int target;
  std::string sent;  // client -> service, read after stop()
  std::atomic<bool> done{false};
  std::thread thread;
  explicit Recorder(int target_port) : target(target_port) {
    const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(listen(listener, 4) == 0);
    thread = std::thread([this, listener] {
      const auto until = std::chrono::steady_clock::now() + 20s;
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 10000) != 1) return void(::close(listener));
      const int client = accept(listener, nullptr, nullptr);
      ::close(listener);
      const int service = connect_raw(target);
      char buffer[65536];
      while (!done && std::chrono::steady_clock::now() < until) {
        pollfd fds[2] = {{client, POLLIN, 0}, {service, POLLIN, 0}};
        poll(fds, 2, 20);
        if (fds[0].revents) {
          const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
          if (n <= 0) break;
          sent.append(buffer, static_cast<size_t>(n));
          (void)!::send(service, buffer, static_cast<size_t>(n), MSG_NOSIGNAL);
        }
        if (fds[1].revents) {
          const ssize_t n = ::recv(service, buffer, sizeof buffer, 0);
          if (n <= 0) break;
          (void)!::send(client, buffer, static_cast<size_t>(n), MSG_NOSIGNAL);
        }
      }
      ::close(client);
      ::close(service);
    });
  }
  std::string stop() {
    done = true;
    thread.join();
    return sent;
  }
};

long rss_kib() {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::atol(line + 6);
  if (f) fclose(f);
  return kib;
}

}  // namespace

TEST_CASE("the hub logs the real reason a node's launcher was lost") {
  Hub node0(kSecret, "job-a");
  std::unique_ptr<MembershipRelay> relay;
  auto joined = relay_of(node0.port, kSecret, "job-a", relay);
  REQUIRE(node0.pump([&] { return ready(joined); }, 10s));
  REQUIRE(joined.get() == "");
  relay.reset();  // node 1's launcher goes without bye: its connection closes
  const std::string lost = "troupe: elastic: lost the launcher of node 1 (from 127.0.0.1): ";
  CHECK(node0.pump([&] { return node0.log.str().find(lost) != std::string::npos; }, 10s));
  // The reason is the stream's error, logged after the stream was destroyed (a use after free
  // printed whatever the freed bytes held).
  CHECK(node0.log.str().find(lost + "the connection was closed\n") != std::string::npos);
}

TEST_CASE(
    "a hello recorded from one connection is refused on another, and the refusal says nothing") {
  // Job one: node 1's launcher joins through a recorder, as a passive listener on the wire would.
  std::string recorded;
  {
    Hub first(kSecret, "");
    Recorder wire(first.port);
    std::unique_ptr<MembershipRelay> relay;
    auto joined = relay_of(wire.port, kSecret, "", relay);
    REQUIRE(first.pump([&] { return ready(joined); }, 10s));
    REQUIRE(joined.get() == "");
    recorded = wire.stop();
  }
  REQUIRE(!frames_of(recorded).empty());
  REQUIRE(frames_of(recorded)[0].first == static_cast<int>(LinkFrame::hello));
  // A new job with the same secret, shape and (no) job id: only the connection differs.
  Hub second(kSecret, "");
  const int fd = connect_raw(second.port);
  REQUIRE(::send(fd, recorded.data(), recorded.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(recorded.size()));
  Seen seen;
  second.pump(
      [&] {
        take(fd, seen);
        return seen.ended;
      },
      10s);
  ::close(fd);
  INFO(second.log.str());
  bool welcomed = false, refused = false;
  for (const auto& [type, payload] : frames_of(seen.bytes)) {
    welcomed = welcomed || type == static_cast<int>(LinkFrame::welcome);
    if (type == static_cast<int>(LinkFrame::refuse)) {
      refused = true;
      CHECK(payload == "refused");
    }
  }
  CHECK(!welcomed);
  CHECK(refused);
  CHECK(seen.ended);
  CHECK(second.log.str().find("refused a connection (from 127.0.0.1): no proof") !=
        std::string::npos);
  CHECK(!second.hub.connected());
}

TEST_CASE(
    "a node of another job that shares the secret is refused by name; a wrong secret learns "
    "nothing") {
  Hub node0(kSecret, "job-a");
  std::unique_ptr<MembershipRelay> other_job, other_secret;
  auto a = relay_of(node0.port, kSecret, "job-b", other_job);
  REQUIRE(node0.pump([&] { return ready(a); }, 10s));
  const std::string job_error = a.get();
  auto b = relay_of(node0.port, "another-secret-0123456789abcdef", "job-a", other_secret);
  REQUIRE(node0.pump([&] { return ready(b); }, 10s));
  const std::string secret_error = b.get();
  CHECK(job_error.find(
            "node 1: the elastic membership service at 127.0.0.1:" + std::to_string(node0.port) +
            " refused this node: node 1 is of job "
            "'job-b' (--job-id, TROUPE_JOB_ID), and this service serves another") !=
        std::string::npos);
  CHECK(secret_error.find("refused this node (node 0's launcher logs why") != std::string::npos);
  // Nothing about the job (its shape, its nodes, its id) reaches a peer without the secret.
  CHECK(secret_error.find("job-a") == std::string::npos);
  CHECK(secret_error.find("--nnodes") == std::string::npos);
  CHECK(!node0.hub.connected());
}

TEST_CASE("a connection that never sends is closed at the hello deadline") {
  HandshakeLimits limits;
  limits.hello_within = 300ms;
  Hub node0(kSecret, "job-a", limits);
  std::vector<int> idle;
  for (int i = 0; i < 5; ++i) idle.push_back(connect_raw(node0.port));
  std::vector<Seen> seen(idle.size());
  const auto start = std::chrono::steady_clock::now();
  const bool all_closed = node0.pump(
      [&] {
        bool all = true;
        for (size_t i = 0; i < idle.size(); ++i) {
          take(idle[i], seen[i]);
          all = all && seen[i].ended;
        }
        return all;
      },
      5s);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int fd : idle) ::close(fd);
  CHECK(all_closed);
  CHECK(took < 2.0);
  CHECK(node0.hub.in_handshake() == 0);
}

TEST_CASE(
    "connections in handshake are capped per address, and a relay still gets in once they go") {
  HandshakeLimits limits;
  limits.per_address = 3;
  limits.hello_within = 500ms;
  Hub node0(kSecret, "job-a", limits);
  std::vector<int> fds;
  for (int i = 0; i < 8; ++i) fds.push_back(connect_raw(node0.port));
  node0.pump([&] { return false; }, 200ms);  // accepts what the backlog holds
  CHECK(node0.hub.in_handshake() == 3);
  // The relay connects while the cap is reached: closed at once, it retries until the idle ones
  // expire.
  std::unique_ptr<MembershipRelay> relay;
  auto joined = relay_of(node0.port, kSecret, "job-a", relay);
  REQUIRE(node0.pump([&] { return ready(joined); }, 10s));
  for (int fd : fds) ::close(fd);
  CHECK(joined.get() == "");
  CHECK(node0.hub.connected());
}

TEST_CASE(
    "a frame header beyond the handshake's cap ends the connection before its body grows the hub") {
  Hub node0(kSecret, "job-a");
  const long before = rss_kib();
  // 16 connections each claim a 4 MiB frame and send most of it.
  const uint32_t claimed = 4u << 20;
  std::vector<int> fds;
  std::vector<Seen> seen(16);
  const std::string chunk(64 * 1024, 'x');
  for (int i = 0; i < 16; ++i) {
    fds.push_back(connect_raw(node0.port));
    REQUIRE(::send(fds.back(), &claimed, 4, MSG_NOSIGNAL) == 4);
  }
  for (size_t sent = 0; sent + chunk.size() < claimed; sent += chunk.size()) {
    for (size_t i = 0; i < fds.size(); ++i)
      if (!seen[i].ended)
        (void)!::send(fds[i], chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    node0.pump([&] { return false; }, 1ms);
    for (size_t i = 0; i < fds.size(); ++i) take(fds[i], seen[i]);
  }
  node0.pump(
      [&] {
        bool all = true;
        for (size_t i = 0; i < fds.size(); ++i) {
          take(fds[i], seen[i]);
          all = all && seen[i].ended;
        }
        return all;
      },
      3s);
  const long grown = rss_kib() - before;
  for (int fd : fds) ::close(fd);
  for (const Seen& s : seen) CHECK(s.ended);
  INFO("the hub's process grew by " << grown << " KiB");
  CHECK(grown < 16 * 1024);
  CHECK(node0.hub.in_handshake() == 0);
}

TEST_CASE("a hub out of descriptors refuses new connections instead of spinning") {
  const int port = pick_free_port();
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The hub, in a process whose descriptor limit a few connections exhaust: only stdio is
    // left open, so the hub's listening and reserve descriptors are 3 and 4, and 5..7 are free.
    for (int fd = 3; fd < 1024; ++fd) ::close(fd);
    std::ostringstream log;
    MembershipServer server{4, 2, 5s, log, 4};
    HandshakeLimits limits;
    limits.hello_within = 60s;  // the idle connections stay: only the descriptor limit refuses
    limits.per_address = limits.in_all = 1000;
    MembershipHub hub(server, {2, 2, 0}, "127.0.0.1", port, kSecret, log, "job-a", limits);
    rlimit limit{8, 8};
    setrlimit(RLIMIT_NOFILE, &limit);
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    const auto until = std::chrono::steady_clock::now() + 2s;
    while (std::chrono::steady_clock::now() < until) {
      std::vector<pollfd> fds;
      std::vector<int> tags;
      hub.add_poll_fds(fds, tags);
      poll(fds.data(), fds.size(), 20);
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents) hub.on_ready(tags[i], fds[i].revents);
      hub.tick();
    }
    getrusage(RUSAGE_SELF, &after);
    auto ms = [](const rusage& r) {
      return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000L +
             (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1000L;
    };
    const long cpu = ms(after) - ms(before);
    const bool said = log.str().find("out of file descriptors") != std::string::npos;
    _exit(cpu < 500 && said ? 0 : cpu >= 500 ? 10 : 11);
  }
  // Connect as the child listens (retrying until it does), 40 times.
  std::vector<int> fds;
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (fds.size() < 40 && std::chrono::steady_clock::now() < until) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      fds.push_back(fd);
    } else {
      ::close(fd);
      pollfd none{-1, 0, 0};
      poll(&none, 0, 10);  // the child has not listened yet
    }
  }
  int status = -1;
  const auto wait_until = std::chrono::steady_clock::now() + 10s;
  pid_t reaped = 0;
  while ((reaped = waitpid(child, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < wait_until) {
    pollfd none{-1, 0, 0};
    poll(&none, 0, 20);
  }
  if (reaped == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  for (int fd : fds) ::close(fd);
  CHECK(fds.size() >= 10);
  REQUIRE(WIFEXITED(status));
  INFO(
      "10: the hub spun (500 ms of CPU or more in 2 s); 11: it did not say it is out of "
      "descriptors");
  CHECK(WEXITSTATUS(status) == 0);
}

namespace {

/// One local slot of `server` driven by hand (the rank's end of its socket).
void send_message(int fd, Message type, const std::vector<std::string>& fields) {
  const std::string bytes = encode(type, fields);
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
}

/// Serves `server`'s local slots until `done()` or `limit`.
bool serve(MembershipServer& server, const std::function<bool()>& done,
           std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::vector<pollfd> fds;
    std::vector<int> slots;
    server.add_poll_fds(fds, slots);
    poll(fds.data(), fds.size(), 20);
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) server.on_readable(slots[i]);
    server.tick();
  }
  return true;
}

/// What a real rank's exchange() returns (or throws) when its peer in slot 1 registers
/// `peer_address`; this rank's own address starts with header byte 0x11.
std::string exchange_with(const std::string& peer_address, std::ostringstream& log) {
  MembershipServer server(2, 1, 5s, log, 2);
  const int mine = server.attach(0);
  const int peer = server.attach(1);
  MembershipClient client(mine, nullptr);
  auto joined = std::async(std::launch::async, [&] {
    return client.join(-1, "host-0", std::chrono::steady_clock::now() + 10s);
  });
  send_message(peer, Message::join, {"-1", "host-1"});
  REQUIRE(serve(
      server, [&] { return ready_assignment(joined); }, 10s));
  const Assignment a = joined.get();
  REQUIRE(a.world_size == 2);
  const std::string own = std::string(1, '\x11') + std::string(40, 'u');
  auto table = std::async(std::launch::async, [&]() -> std::string {
    try {
      if (!client.exchange(a.generation, own, std::chrono::steady_clock::now() + 10s))
        return "a newer generation opened";
    } catch (const comm::Error& e) {
      return e.what();
    }
    return "";
  });
  send_message(peer, Message::address, {std::to_string(a.generation), peer_address});
  serve(
      server, [&] { return ready(table); }, 10s);
  const std::string out = table.wait_for(10s) == std::future_status::ready ? table.get() : "hung";
  ::close(peer);
  return out;
}

}  // namespace

TEST_CASE(
    "a peer's transport address that is not a UCX worker address of this build is refused before "
    "UCX sees it") {
  std::ostringstream log;
  // 300 bytes of garbage, as the impostor of issue 35 registered.
  const std::string garbage = exchange_with(std::string(300, '\x7f'), log);
  CHECK(garbage.find("elastic membership: the peer table of generation 1 gives rank 1 (host "
                     "'host-1') a transport address of 300 bytes with header byte 0x7f (expected a "
                     "UCX worker address of 1..65536 bytes with header byte 0x11, as this rank's "
                     "own); refused before UCX sees it") != std::string::npos);
  // The same header as this rank's: accepted.
  CHECK(exchange_with(std::string(1, '\x11') + std::string(100, 'p'), log) == "");
}

TEST_CASE(
    "the membership service drops a rank that registers an address larger than any UCX address") {
  std::ostringstream log;
  const std::string huge = exchange_with(std::string(1, '\x11') + std::string(70 * 1024, 'p'), log);
  CHECK(log.str().find("rank slot 1 died (it sent a transport address of 71681 bytes (expected "
                       "1..65536))") != std::string::npos);
  CHECK(huge == "a newer generation opened");  // it never gets a table with that address
}

TEST_CASE(
    "a node whose launcher falls silent is lost within the silence allowed; heartbeats keep one") {
  Hub node0(kSecret, "job-a", {}, 1500ms);
  std::unique_ptr<MembershipRelay> relay;
  auto joined = std::async(std::launch::async, [&]() -> std::string {
    try {
      relay = std::make_unique<MembershipRelay>(NodeShape{2, 2, 1}, "127.0.0.1", node0.port,
                                                kSecret, 5s, "job-a", 3s);
    } catch (const comm::Error& e) {
      return e.what();
    }
    return "";
  });
  REQUIRE(node0.pump([&] { return ready(joined); }, 10s));
  REQUIRE(joined.get() == "");
  // Node 1's launcher loop runs (a heartbeat every second) for 4 s, longer than the 1.5 s of
  // silence allowed, and the link stays.
  std::atomic<bool> quiet{false};
  std::thread node1([&] {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!quiet && std::chrono::steady_clock::now() < until) {
      std::vector<pollfd> fds;
      std::vector<int> tags;
      relay->add_poll_fds(fds, tags);  // the hub's heartbeats keep the relay's side alive too
      poll(fds.data(), fds.size(), 20);
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents) relay->on_ready(tags[i], fds[i].revents);
      relay->tick();
    }
  });
  const bool lost_early = node0.pump([&] { return !node0.hub.connected(); }, 4s);
  // Then it falls silent (as a stopped launcher, or one behind a cut link, would).
  quiet = true;
  node1.join();
  const auto silent_at = std::chrono::steady_clock::now();
  const bool lost = node0.pump([&] { return !node0.hub.connected(); }, 5s);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - silent_at).count();
  INFO(node0.log.str());
  CHECK(!lost_early);
  CHECK(!relay->lost());
  CHECK(lost);
  CHECK(took < 3.0);  // the 1.5 s allowed after its last heartbeat
  CHECK(node0.log.str().find("lost the launcher of node 1 (from 127.0.0.1): nothing heard for "
                             "1500 ms") != std::string::npos);
}
