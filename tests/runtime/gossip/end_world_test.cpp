// AsynchronousModule::end_world: a rank whose world ends (an elastic re-form) ends its background
// rounds at once, while its peers still run theirs and will not say goodbye until it has.
#include "tests/support/torch_doctest.h"  // first: torch, then doctest

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "algorithms/gossip/decentralized.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

using Clock = std::chrono::steady_clock;

torch::nn::Linear make_net(int rank) {
  torch::nn::Linear net(8, 4);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.fill_(static_cast<float>(rank));
  return net;
}

// Waits until `done` holds; throws naming `what` after 20 s.
template <typename Done>
void wait_until(Done done, const std::string& what) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!done()) {
    if (Clock::now() > deadline) throw comm::Error("waited 20 s for " + what);
    std::this_thread::yield();
  }
}

// Three thread ranks run `algorithm`; rank 0 ends its world once every rank has had 3 rounds
// (had it ended at its own 3, a rank still short of them would lose its partners: rank 2 ends
// right after rank 0, and rank 1 waited in vain, seen once in CI), the others only after it has
// (so a cooperative stop of rank 0, which waits for the others' goodbyes or last round, could
// wait its whole 20 s deadline). Rank 0's end_world must return within 5 s.
template <typename Algorithm>
void check_end_world(Algorithm algorithm) {
  std::atomic<bool> ended{false};
  std::atomic<int> ready{0};
  std::atomic<int> others{0};
  double seconds = -1;
  auto errors = test::run_threads(3, [&](int rank, Runtime& rt) {
    auto net = make_net(rank);
    GossipOptions options;
    options.timeout = std::chrono::seconds(20);
    options.broadcast_parameters = false;
    AsynchronousModule module(rt, net.ptr(), algorithm, options);
    wait_until([&] { return module.stats().background_rounds >= 3; }, "3 background rounds");
    ++ready;
    if (rank == 0) {
      wait_until([&] { return ready.load() == 3; }, "every rank's 3 background rounds");
      const auto start = Clock::now();
      module.end_world("the test ends rank 0's world");
      seconds = std::chrono::duration<double>(Clock::now() - start).count();
      ended = true;
      CHECK_THROWS_WITH_AS(module.resume(), doctest::Contains("resume() after end_world()"),
                           comm::Error);
      // Rank 0 hosts the directory: it stays until the others have ended too.
      wait_until([&] { return others.load() == 2; }, "the others' end_world");
    } else {
      wait_until([&] { return ended.load(); }, "rank 0's end_world");
      module.end_world("rank 0's world ended");
      ++others;
    }
  });
  for (const auto& e : errors) CHECK(e == "");
  MESSAGE("end_world took " << seconds << " s");
  CHECK(seconds >= 0);
  CHECK(seconds < 5.0);
}

}  // namespace

TEST_CASE("end_world ends asynchronous gossip's exchanges at once while the neighbours gossip on") {
  AsyncGossip algorithm;
  algorithm.topology.kind = comm::TopologyKind::ring;
  algorithm.min_interval_ms = 1;
  check_end_world(algorithm);
}

TEST_CASE(
    "end_world ends asynchronous model averaging's rounds at once while the others average "
    "on") {
  AsyncModelAverage algorithm;
  algorithm.sync_interval_ms = 2;
  check_end_world(algorithm);
}
