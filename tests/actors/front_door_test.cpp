// The rendezvous' front door against what an outsider on the network can do: bytes that are not
// troupe's, a frame that claims gigabytes, silence, a flood of connections, a wrong or missing
// secret, and a registration as a rank of a job it does not belong to. The job must go on, the
// outsider must learn nothing about it, and rank 0 must not allocate what it is told to.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <caf/all.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <future>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/rendezvous.h"
#include "comm/transport/inproc/transport.h"
#include "comm/wire/rendezvous_wire.h"
#include "elastic/launch.h"
#include "rank/runtime.h"
#include "tests/support/skip.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kSecret = "0123456789abcdef0123456789abcdef";

int connect_local(int port, const char* ip = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip, &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True when the door closes `fd` (EOF or reset) within `within`; bytes it sends first are skipped.
bool closed_by_door(int fd, std::chrono::milliseconds within) {
  const auto deadline = Clock::now() + within;
  char buf[256];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<long long>(left.count(), 0))) <= 0) return false;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
  }
  return false;
}

// A certificate authority, two rank certificates it signed, and one signed by another authority,
// made with the openssl command in a folder of their own.
struct Certificates {
  std::string dir = "/tmp/troupe_tls_test_" + std::to_string(::getpid());
  bool made = false;

  Certificates() {
    const std::string key = " -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes ";
    std::string script = "set -e; rm -rf " + dir + "; mkdir -p " + dir + "; cd " + dir + "; ";
    for (const char* ca : {"ca", "rogue-ca"})
      script += std::string("openssl req -x509") + key + "-keyout " + ca + ".key -out " + ca +
                ".pem -days 1 -subj /CN=" + ca + "; ";
    for (std::string name : {"rank0:ca", "rank1:ca", "rogue:rogue-ca"}) {
      const auto cert = name.substr(0, name.find(':')), ca = name.substr(name.find(':') + 1);
      script += "openssl req" + key + "-keyout " + cert + ".key -out " + cert +
                ".csr -subj /CN=" + cert + "; openssl x509 -req -in " + cert + ".csr -CA " + ca +
                ".pem -CAkey " + ca + ".key -CAcreateserial -out " + cert + ".pem -days 1; ";
    }
    made = std::system(("(" + script + ") >/dev/null 2>&1").c_str()) == 0;
  }
  ~Certificates() { std::system(("rm -rf " + dir).c_str()); }

  actors::wire::TlsFiles files(const std::string& cert, const std::string& ca = "ca") const {
    return {dir + "/" + cert + ".pem", dir + "/" + cert + ".key", dir + "/" + ca + ".pem"};
  }
};

// Rank 0's directory and front door in an actor system of the test's own.
struct Door {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  actors::PublishedDirectory published;

  explicit Door(int world, std::string secret = kSecret, std::chrono::milliseconds timeout = 10s,
                actors::wire::TlsFiles tls = {}) {
    config.set("scheduler.max-threads", 1);
    system = std::make_unique<caf::actor_system>(config);
    actors::RendezvousRequest request;
    request.world_size = world;
    request.master_port = 0;
    request.secret = std::move(secret);
    request.timeout = timeout;
    request.tls = std::move(tls);
    published = actors::publish_directory(*system, request);
  }
  ~Door() {
    published.door.reset();
    caf::anon_send_exit(published.directory, caf::exit_reason::user_shutdown);
  }
  int port() const { return published.door->port(); }
  actors::FrontDoorCounts counts() const { return published.door->counts(); }
};

// A rank as a thread with an actor system of its own, registering with `secret`; returns what
// the rendezvous threw ("" when it got the table) and the table's hosts.
std::pair<std::string, std::vector<std::string>> join(int rank, int world, int port,
                                                      const std::string& secret,
                                                      std::chrono::milliseconds timeout = 10s,
                                                      caf::actor directory = {},
                                                      caf::actor_system* on = nullptr,
                                                      actors::wire::TlsFiles tls = {}) {
  caf::actor_system_config config;
  config.set("scheduler.max-threads", 1);
  std::unique_ptr<caf::actor_system> own;
  if (!on) {
    own = std::make_unique<caf::actor_system>(config);
    on = own.get();
  }
  auto worker = on->spawn([](caf::event_based_actor* self) -> caf::behavior {
    self->set_default_handler(caf::drop);
    return {[](int) {}};
  });
  actors::RendezvousRequest request;
  request.rank = rank;
  request.world_size = world;
  request.master_port = port;
  request.host = "host-" + std::to_string(rank);
  request.secret = secret;
  request.timeout = timeout;
  request.tls = std::move(tls);
  std::pair<std::string, std::vector<std::string>> out;
  try {
    auto table = actors::rendezvous(*on, request, worker, directory);
    out.second = table.hosts;
  } catch (const std::exception& e) {
    out.first = e.what();
  }
  caf::anon_send_exit(worker, caf::exit_reason::user_shutdown);
  return out;
}

}  // namespace

TEST_CASE("bytes that are not troupe's hello are answered by a closed connection, nothing more") {
  Door door(2);
  const int fd = connect_local(door.port());
  REQUIRE(fd >= 0);
  // What CAF's BASP would read as a header announcing a 4 GiB payload.
  std::string basp(40, '\0');
  basp[0] = 1;
  for (int i = 4; i < 8; ++i) basp[static_cast<size_t>(i)] = '\xff';
  REQUIRE(::send(fd, basp.data(), basp.size(), MSG_NOSIGNAL) == 40);
  CHECK(closed_by_door(fd, 2s));
  ::close(fd);
  CHECK(door.counts().failed == 1);
  CHECK(door.counts().authenticated == 0);
}

TEST_CASE(
    "a rank that proves the secret and then announces a 4 GiB frame is cut off before any "
    "allocation") {
  Door door(2);
  const int fd = connect_local(door.port());
  REQUIRE(fd >= 0);
  actors::wire::Stream stream(fd, nullptr);  // closes fd
  const auto deadline = Clock::now() + 2s;
  const std::string nonce(actors::wire::kNonceBytes, 'n');
  const std::string hello = std::string(actors::wire::kMagic, 8) + nonce;
  actors::wire::send_all(stream, hello.data(), hello.size(), deadline, "hello");
  std::string challenge(actors::wire::kChallengeBytes, '\0');
  actors::wire::recv_exact(stream, challenge.data(), challenge.size(), deadline, "challenge");
  const std::string door_nonce = challenge.substr(0, actors::wire::kNonceBytes);
  CHECK(actors::wire::same_mac(challenge.substr(actors::wire::kNonceBytes),
                               actors::wire::mac(kSecret, "door", nonce, door_nonce)));
  const std::string proof = actors::wire::mac(kSecret, "rank", door_nonce, nonce);
  actors::wire::send_all(stream, proof.data(), proof.size(), deadline, "proof");
  char welcome = 0;
  actors::wire::recv_exact(stream, &welcome, 1, deadline, "welcome");
  CHECK(welcome == 1);
  const char header[5] = {'\xff', '\xff', '\xff', '\xff', 1};  // 4 GiB - 1, a registration
  actors::wire::send_all(stream, header, sizeof(header), deadline, "header");
  CHECK(closed_by_door(fd, 2s));
  CHECK(door.counts().authenticated == 1);
  CHECK(door.counts().dropped == 1);
}

TEST_CASE("a connection that says nothing is closed at the handshake deadline") {
  caf::actor_system_config config;
  config.set("scheduler.max-threads", 1);
  caf::actor_system system(config);
  actors::FrontDoorOptions options;
  options.secret = kSecret;
  options.world_size = 2;
  options.handshake_timeout = 300ms;
  auto dir = system.spawn([](caf::event_based_actor*) -> caf::behavior { return {[](int) {}}; });
  actors::FrontDoor door(system, dir, options);
  const int fd = connect_local(door.port());
  REQUIRE(fd >= 0);
  const auto start = Clock::now();
  CHECK(closed_by_door(fd, 3s));
  const auto took = Clock::now() - start;
  CHECK(took >= 250ms);
  CHECK(took < 2s);
  ::close(fd);
  CHECK(door.counts().failed == 1);
  caf::anon_send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE(
    "a flood of idle connections is turned away at the per-address cap and the job still meets") {
  Door door(2);
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = connect_local(door.port());
    REQUIRE(fd >= 0);
    idle.push_back(fd);
  }
  // The door holds at most 8 handshakes from one address; the rest are closed at once.
  int closed = 0;
  for (int fd : idle) closed += closed_by_door(fd, 50ms);
  CHECK(closed >= 192);
  const auto counts = door.counts();
  CHECK(counts.turned_away >= 192);
  for (int fd : idle) ::close(fd);
  // A real rank gets in once the idle ones are gone (it retries while the door is full).
  auto rank1 = std::async(std::launch::async, [&] { return join(1, 2, door.port(), kSecret); });
  auto rank0 = join(0, 2, door.port(), kSecret, 10s, door.published.directory, door.system.get());
  auto r1 = rank1.get();
  CHECK(rank0.first == "");
  CHECK(r1.first == "");
  CHECK(r1.second == std::vector<std::string>{"host-0", "host-1"});
}

TEST_CASE("an outsider without the secret is refused without learning the job, which goes on") {
  Door door(3, kSecret, 10s);
  // An outsider that claims to be rank 5 of 7, without the secret, then with a wrong one.
  for (const std::string& guess :
       {std::string(), std::string("fedcba9876543210fedcba9876543210")}) {
    auto outsider = join(5, 7, door.port(), guess, 3s);
    CAPTURE(outsider.first);
    CHECK(outsider.first.find("does not hold this job's secret") != std::string::npos);
    CHECK(outsider.first.find("world") == std::string::npos);  // nothing about the job
    CHECK(outsider.second.empty());
  }
  // The outsider as rank 1 of 3: refused too, and the real rank 1 takes its place.
  auto impostor = join(1, 3, door.port(), "not-the-secret-but-long-enough", 3s);
  CHECK(impostor.first.find("does not hold this job's secret") != std::string::npos);
  auto r1 = std::async(std::launch::async, [&] { return join(1, 3, door.port(), kSecret); });
  auto r2 = std::async(std::launch::async, [&] { return join(2, 3, door.port(), kSecret); });
  auto r0 = join(0, 3, door.port(), kSecret, 10s, door.published.directory, door.system.get());
  CHECK(r0.first == "");
  CHECK(r1.get().first == "");
  CHECK(r2.get().first == "");
  CHECK(door.counts().authenticated == 2);
}

TEST_CASE(
    "ranks with the same secret meet through Runtime; a rank with another secret is named as "
    "such") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const int port = pick_free_port();
  auto o0 = test::thread_rank(0, 2, port, fabric, 3s);
  auto o1 = test::thread_rank(1, 2, port, fabric, 3s);
  o0.rank_info->job_secret = kSecret;
  o1.rank_info->job_secret = "another-secret-of-32-characters!";
  auto errors = test::run_ranks({o0, o1}, {});
  CAPTURE(errors[0]);
  CAPTURE(errors[1]);
  CHECK(errors[1].find("cannot join the rendezvous at 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(errors[1].find("TROUPE_JOB_SECRET") != std::string::npos);
  CHECK(errors[0].find("rank(s) 1 never arrived") != std::string::npos);

  // The same secret: they meet (with the default deadlines: a busy machine may take seconds to
  // start two runtimes, and the 3 s above are only for the refusal).
  o0 = test::thread_rank(0, 2, port, fabric);
  o1 = test::thread_rank(1, 2, port, fabric);
  o0.rank_info->job_secret = kSecret;
  o1.rank_info->job_secret = kSecret;
  errors = test::run_ranks({o0, o1}, [](int, Runtime& rt) {
    double x = rt.rank() + 1;
    rt.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
    CHECK(x == 3.0);
  });
  CHECK(errors == std::vector<std::string>{"", ""});
}

TEST_CASE("a job secret shorter than 16 characters is refused by name, without printing it") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  auto o = test::thread_rank(1, 2, pick_free_port(), fabric, 1s);
  o.rank_info->job_secret = "hunter2";
  try {
    Runtime rt(o);
    FAIL("a Runtime started with a 7-character secret");
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    CHECK(what.find("TROUPE_JOB_SECRET has 7 characters (expected at least 16") !=
          std::string::npos);
    CHECK(what.find("hunter2") == std::string::npos);
  }
}

TEST_CASE("rank 0 listens on MASTER_ADDR's address only") {
  Door door(2);                                            // MASTER_ADDR 127.0.0.1
  const int fd = connect_local(door.port(), "127.0.0.2");  // also this host, another address
  CHECK(fd < 0);
  if (fd >= 0) ::close(fd);
  const int ok = connect_local(door.port(), "127.0.0.1");
  CHECK(ok >= 0);
  if (ok >= 0) ::close(ok);
}

TEST_CASE("a job of one rank publishes nothing, so two of them share a MASTER_PORT") {
  const int port = pick_free_port();
  auto single = [&] {
    auto fabric = std::make_shared<comm::InprocFabric>(1);
    auto o = test::thread_rank(0, 1, port, fabric, 2s);
    return o;
  };
  Runtime a(single());
  Runtime b(single());
  // Nothing listens at the port: binding it succeeds.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  ::close(fd);
  double x = 2;
  a.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
  CHECK(x == 2.0);
  CHECK(a.hosts().size() == 1);
}

TEST_CASE(
    "with TLS, ranks meet over it, and a certificate from another authority or none is refused") {
  Certificates certs;
  if (!certs.made) {
    test::skip_case("the openssl command could not make test certificates");
    return;
  }
  Door door(2, kSecret, 10s, certs.files("rank0"));
  // A rank whose certificate another authority signed: rank 0 refuses it during TLS.
  auto rogue = join(1, 2, door.port(), kSecret, 3s, {}, nullptr, certs.files("rogue"));
  CAPTURE(rogue.first);
  CHECK(rogue.first.find("TLS with rank 0 failed") != std::string::npos);
  // One that trusts another authority refuses rank 0's certificate itself, naming why.
  auto wary = join(1, 2, door.port(), kSecret, 3s, {}, nullptr, certs.files("rogue", "rogue-ca"));
  CAPTURE(wary.first);
  CHECK(wary.first.find("TLS with rank 0 failed") != std::string::npos);
  CHECK(wary.first.find("certificate") != std::string::npos);
  // A rank without TLS: the door closes the connection, and the rank says TLS may differ.
  auto plain = join(1, 2, door.port(), kSecret, 3s);
  CAPTURE(plain.first);
  CHECK(plain.first.find("within 3000 ms") != std::string::npos);
  CHECK(plain.first.find("TLS on one side only") != std::string::npos);
  // The real rank 1 meets rank 0 over TLS.
  auto r1 = std::async(std::launch::async, [&] {
    return join(1, 2, door.port(), kSecret, 10s, {}, nullptr, certs.files("rank1"));
  });
  auto r0 = join(0, 2, door.port(), kSecret, 10s, door.published.directory, door.system.get());
  CHECK(r0.first == "");
  auto got = r1.get();
  CHECK(got.first == "");
  CHECK(got.second == std::vector<std::string>{"host-0", "host-1"});
}

TEST_CASE("a TLS file that cannot be used is named with its variable") {
  actors::wire::TlsFiles files{"/nonexistent/rank.pem", "/nonexistent/rank.key",
                               "/nonexistent/ca.pem"};
  try {
    Door door(2, kSecret, 1s, files);
    FAIL("a front door started with missing TLS files");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find("TROUPE_TLS_CERT='/nonexistent/rank.pem' cannot be used") !=
          std::string::npos);
  }
}

TEST_CASE("a TLS stream whose peer has closed reports it closed instead of raising SIGPIPE") {
  // SIGPIPE's default action would end this test binary: the case fails by crashing.
  const bool default_action = std::signal(SIGPIPE, SIG_DFL) == SIG_DFL;
  REQUIRE(default_action);
  Certificates certificates;
  REQUIRE(certificates.made);
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  auto server = std::make_unique<actors::wire::Stream>(
      fds[0], actors::wire::tls_context(certificates.files("rank0"), /*server=*/true));
  actors::wire::Stream client(fds[1],
                              actors::wire::tls_context(certificates.files("rank1"), false));
  const auto deadline = Clock::now() + 10s;
  auto accepted = std::async(std::launch::async, [&] {
    actors::wire::tls_handshake(*server, deadline, "the server's handshake");
  });
  actors::wire::tls_handshake(client, deadline, "the client's handshake");
  accepted.get();
  server.reset();  // closes its end of the socket
  const std::string bytes(64 * 1024, 'x');
  // TLS 1.3 reads may write too (to answer the peer); both must end in an error, not a signal.
  CHECK_THROWS_WITH(actors::wire::send_all(client, bytes.data(), bytes.size(), deadline, "bytes"),
                    doctest::Contains("bytes"));
  char byte = 0;
  CHECK_THROWS(actors::wire::recv_exact(client, &byte, 1, deadline, "a byte"));
}
