// The in-process transport: matching, sizes, failure.
#include <doctest/doctest.h>

#include <cstring>
#include <future>
#include <vector>

#include "comm/transport/inproc/transport.h"

using namespace troupe;

namespace {
struct Result {
  std::promise<comm::Status> promise;
  comm::Callback callback() {
    return [this](const comm::Status& s) { promise.set_value(s); };
  }
  comm::Status get() { return promise.get_future().get(); }
};
}  // namespace

TEST_CASE("inproc messages match by peer and tag in any posting order") {
  comm::InprocFabric fabric(2);
  auto a = fabric.transport(0), b = fabric.transport(1);
  std::vector<int> x = {1, 2, 3}, y = {4, 5}, gx(3), gy(2);
  Result s1, s2, r1, r2;
  a->send(1, 7, x.data(), 12, s1.callback());
  a->send(1, 9, y.data(), 8, s2.callback());
  b->recv(0, 9, gy.data(), 8, r2.callback());
  b->recv(0, 7, gx.data(), 12, r1.callback());
  CHECK(r1.get().ok());
  CHECK(r2.get().ok());
  CHECK(s1.get().ok());
  CHECK(s2.get().ok());
  CHECK(gx == x);
  CHECK(gy == y);
}

TEST_CASE("an inproc receive whose size differs from the message fails naming both sizes") {
  comm::InprocFabric fabric(2);
  auto a = fabric.transport(0), b = fabric.transport(1);
  std::vector<char> buf(16);
  Result s, r;
  b->recv(0, 1, buf.data(), 16, r.callback());
  a->send(1, 1, buf.data(), 8, s.callback());
  auto st = r.get();
  CHECK_FALSE(st.ok());
  CHECK(st.message().find("has 8 bytes, but the receive expects 16") != std::string::npos);
  CHECK_FALSE(s.get().ok());
}

TEST_CASE("fail_peer fails pending and later operations with that peer") {
  comm::InprocFabric fabric(3);
  auto a = fabric.transport(0);
  char c = 0;
  Result pending, later, other;
  a->recv(2, 1, &c, 1, pending.callback());
  a->fail_peer(2, "rank 2 is gone");
  auto st = pending.get();
  CHECK_FALSE(st.ok());
  CHECK(st.message() == "rank 2 is gone");
  CHECK(st.peer() == 2);
  a->send(2, 1, &c, 1, later.callback());
  CHECK(later.get().message() == "rank 2 is gone");
  a->send(5, 1, &c, 1, other.callback());
  CHECK(other.get().message().find("outside [0, 3)") != std::string::npos);
}
