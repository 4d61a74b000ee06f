// The Runtime's own options, as thread ranks over inproc: link emulation wraps the transport.
#include "rank/runtime.h"

#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST_CASE(
    "a Runtime with link emulation sends through emulated links and still reduces correctly") {
  const int world = 3;
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  comm::LinkEmulation links;
  links.all = comm::parse_link_shape("1gbit,1ms");
  links.ranks = {{2, comm::parse_link_shape("100mbit,10ms")}};
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < world; ++r) {
    options.push_back(test::thread_rank(r, world, port, fabric));
    options.back().links = links;
  }
  std::vector<std::string> names(world);
  std::vector<Clock::duration> round_trip(world);  // rank 0 to each peer and back
  auto errors = test::run_ranks(options, [&](int r, Runtime& rt) {
    names[r] = rt.transport()->name();
    double x = r + 1;
    rt.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
    CHECK(x == 6.0);
    // Ping-pong between rank 0 and each peer under a tag no collective uses.
    auto& t = *rt.transport();
    for (int peer = 1; peer < world; ++peer) {
      if (r != 0 && r != peer) continue;
      const int other = r == 0 ? peer : 0;
      std::promise<comm::Status> got, sent;
      auto send = [&] {
        t.send(other, comm::kTagMask, nullptr, 0,
               [&](const comm::Status& s) { sent.set_value(s); });
      };
      auto start = Clock::now();
      if (r == 0) send();
      t.recv(other, comm::kTagMask, nullptr, 0, [&](const comm::Status& s) { got.set_value(s); });
      auto received = got.get_future();
      REQUIRE(received.wait_for(10s) == std::future_status::ready);
      CHECK(received.get().ok());
      if (r != 0) send();
      auto delivered = sent.get_future();
      REQUIRE(delivered.wait_for(10s) == std::future_status::ready);
      CHECK(delivered.get().ok());
      if (r == 0) round_trip[peer] = Clock::now() - start;
    }
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(errors[r] == "");
    CHECK(names[r] == "inproc+emulated");
  }
  // 0 -> 1 -> 0 over 1 ms links; 0 -> 2 -> 0 over rank 2's 10 ms links, each way.
  CHECK(round_trip[1] >= 2ms);
  CHECK(round_trip[2] >= 20ms);
}

TEST_CASE("link emulation naming a rank outside the job fails the Runtime naming the option") {
  auto fabric = std::make_shared<comm::InprocFabric>(1);
  auto options = test::thread_rank(0, 1, pick_free_port(), fabric);
  options.links = comm::LinkEmulation{{}, {{3, comm::parse_link_shape("5ms")}}};
  CHECK_THROWS_WITH_AS(Runtime{options}, doctest::Contains("RuntimeOptions.links"), comm::Error);
  CHECK_THROWS_WITH_AS(Runtime{options}, doctest::Contains("rank 3"), comm::Error);
}
