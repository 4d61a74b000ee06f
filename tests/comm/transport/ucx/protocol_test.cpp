// Which protocols UCX uses for tagged sends, by where the ranks are: across hosts troupe turns
// UCX's rendezvous off (a round trip per message over tcp), unless UCX_RNDV_THRESH says
// otherwise. Read from the endpoints UCX actually built (UcxTransport::peer_protocols), for two
// transports of this process connected to each other.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/tags.h"
#include "comm/transport/ucx/transport.h"

namespace troupe::comm {
namespace {

/// Sets (or, with nullopt, unsets) an environment variable for the scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value->c_str(), 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// Rank 0's tag-send protocols towards rank 1, two transports of this process connected.
std::string protocols_to_peer(bool single_host) {
  UcxTransport a(0, 2, single_host);
  UcxTransport b(1, 2, single_host);
  const std::vector<std::string> addresses{a.local_address(), b.local_address()};
  a.connect(addresses);
  b.connect(addresses);
  const auto protocols = a.peer_protocols();
  REQUIRE(protocols.size() == 2);
  return protocols[1];
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("across hosts ucx sends every message eagerly unless UCX_RNDV_THRESH is set") {
  ScopedEnv tls("UCX_TLS", std::nullopt);
  {
    ScopedEnv rndv("UCX_RNDV_THRESH", std::nullopt);
    const std::string across = protocols_to_peer(/*single_host=*/false);
    INFO("across hosts: " << across);
    CHECK(has(across, "<egr/"));
    CHECK_FALSE(has(across, "<rndv>"));
    // On one host UCX keeps its default, which has a rendezvous above some size.
    const std::string one_host = protocols_to_peer(/*single_host=*/true);
    INFO("one host: " << one_host);
    CHECK(has(one_host, "<rndv>"));
  }
  {
    ScopedEnv rndv("UCX_RNDV_THRESH", std::string("65536"));
    const std::string across = protocols_to_peer(/*single_host=*/false);
    INFO("across hosts, UCX_RNDV_THRESH=65536: " << across);
    CHECK(has(across, "65536..<rndv>"));
  }
}

// On one host the endpoints go through shared memory alone (tcp, which UCX has for
// survive_peer_loss, takes no lane of theirs); a module that must survive a peer's death gets
// endpoints that avoid the shared FIFO, or a reason naming UCX_TLS where none can.
TEST_CASE(
    "on one host ucx endpoints stay in shared memory, and survive_peer_loss says when it cannot "
    "hold") {
  const uint32_t prefix = tags::module_prefix(3);
  {
    ScopedEnv tls("UCX_TLS", std::nullopt);
    UcxTransport a(0, 2, /*single_host=*/true);
    UcxTransport b(1, 2, /*single_host=*/true);
    CHECK_THROWS_WITH(a.survive_peer_loss(prefix),
                      doctest::Contains("not connected (call connect() first)"));
    const std::vector<std::string> addresses{a.local_address(), b.local_address()};
    a.connect(addresses);
    b.connect(addresses);
    const std::string lanes = a.peer_transports()[1];
    INFO("rank 0's lanes to rank 1: " << lanes);
    CHECK((has(lanes, "sysv/") || has(lanes, "posix/")));
    CHECK_FALSE(has(lanes, "tcp"));
    CHECK(a.survive_peer_loss(prefix) == "");
    CHECK(b.survive_peer_loss(prefix) == "");
  }
  {
    ScopedEnv tls("UCX_TLS", std::string("sm,self"));
    UcxTransport a(0, 2, /*single_host=*/true);
    UcxTransport b(1, 2, /*single_host=*/true);
    const std::vector<std::string> addresses{a.local_address(), b.local_address()};
    a.connect(addresses);
    b.connect(addresses);
    const std::string gap = a.survive_peer_loss(prefix);
    CHECK(has(gap, "messages to ranks 1 go through UCX's shared-memory FIFO"));
    CHECK(has(gap, "UCX_TLS=sm,self offers no transport that survives a peer's death (add tcp)"));
  }
}

}  // namespace
}  // namespace troupe::comm
