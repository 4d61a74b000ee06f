// Rendezvous through the directory, with ranks as threads of this process (each with its own actor
// system and Runtime): success, and every way it fails with a clear error instead of a hang.
#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <map>
#include <string>
#include <vector>

#include "runtime/launch.h"
#include "runtime/runtime.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

RuntimeOptions options_for(int rank, int world, int port,
                           const std::shared_ptr<comm::InprocFabric>& fabric,
                           std::chrono::milliseconds timeout = 5000ms) {
  auto o = test::thread_rank(rank, world, port, fabric, timeout);
  o.rank_info->local_world_size = 1;
  o.collective_timeout = std::chrono::seconds(60);
  return o;
}

// Starts one Runtime per entry of `ranks` (rank, world) on threads; returns what each one threw
// ("" when it started). Runtimes that started run `body` before they are destroyed.
std::vector<std::string> start_all(const std::vector<std::pair<int, int>>& ranks, int fabric_world,
                                   std::chrono::milliseconds timeout,
                                   const std::function<void(Runtime&)>& body = {}) {
  // One fabric per world size, so that a rank with a wrong world size reaches the directory.
  std::map<int, std::shared_ptr<comm::InprocFabric>> fabrics;
  fabrics[fabric_world] = std::make_shared<comm::InprocFabric>(fabric_world);
  for (auto [rank, world] : ranks)
    if (!fabrics.count(world)) fabrics[world] = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (auto [rank, world] : ranks)
    options.push_back(options_for(rank, world, port, fabrics[world], timeout));
  return test::run_ranks(options, [&](int, Runtime& rt) {
    if (body) body(rt);
  });
}

}  // namespace

TEST_CASE("four ranks rendezvous, learn every host and pass an allreduce") {
  auto errors = start_all({{0, 4}, {1, 4}, {2, 4}, {3, 4}}, 4, 10s, [](Runtime& rt) {
    CHECK(rt.hosts().size() == 4);
    double x = rt.rank() + 1;
    rt.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
    CHECK(x == 10.0);
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("an unreachable master is named with host:port after the timeout") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const int port = pick_free_port();  // nobody listens there
  auto start = std::chrono::steady_clock::now();
  try {
    Runtime rt(options_for(1, 2, port, fabric, 400ms));
    FAIL("Runtime started without a master");
  } catch (const comm::Error& e) {
    std::string what = e.what();
    CHECK(what.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
    CHECK(what.find("within 400 ms") != std::string::npos);
  }
  auto took = std::chrono::steady_clock::now() - start;
  CHECK(took >= 400ms);
  CHECK(took < 5s);
}

TEST_CASE("a rank that never arrives is named by every rank that did") {
  auto start = std::chrono::steady_clock::now();
  auto errors = start_all({{0, 3}, {1, 3}}, 3, 500ms);
  CHECK(std::chrono::steady_clock::now() - start < 8s);
  for (auto& e : errors) {
    CHECK(e.find("rank(s) 2 never arrived") != std::string::npos);
    CHECK(e.find("world size 3") != std::string::npos);
  }
}

TEST_CASE("a duplicate rank fails the rendezvous at once, naming the rank") {
  auto start = std::chrono::steady_clock::now();
  auto errors = start_all({{0, 3}, {1, 3}, {1, 3}}, 3, 20s);
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // well before the 20 s deadline
  int named = 0;
  for (auto& e : errors) named += e.find("duplicate rank: rank 1 registered twice") != std::string::npos;
  CHECK(named == 3);
}

TEST_CASE("a world size that differs from rank 0's fails the rendezvous, naming both sizes") {
  auto errors = start_all({{0, 2}, {1, 3}}, 3, 20s);
  for (auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("world size mismatch") != std::string::npos);
    CHECK(e.find("WORLD_SIZE=3") != std::string::npos);
    CHECK(e.find("started the job with 2") != std::string::npos);
  }
}

TEST_CASE("a rank outside the world is refused before any connection") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  CHECK_THROWS_WITH(Runtime{options_for(2, 2, pick_free_port(), fabric)},
                    doctest::Contains("rank"));
  CHECK_THROWS_WITH(Runtime{options_for(-1, 2, pick_free_port(), fabric)},
                    doctest::Contains("rank"));
}

TEST_CASE("bad runtime options name the option and the value") {
  auto fabric = std::make_shared<comm::InprocFabric>(1);
  auto o = options_for(0, 1, pick_free_port(), fabric);
  o.transport = "carrier-pigeon";
  CHECK_THROWS_WITH(Runtime{o}, doctest::Contains("\"carrier-pigeon\" (expected \"ucx\" or \"inproc\")"));
  o = options_for(0, 1, pick_free_port(), nullptr);
  CHECK_THROWS_WITH(Runtime{o}, doctest::Contains("needs RuntimeOptions.fabric"));
  o = options_for(0, 1, pick_free_port(), fabric);
  o.scheduler_threads = -3;
  CHECK_THROWS_WITH(Runtime{o}, doctest::Contains("scheduler_threads=-3"));
}

TEST_CASE("a rank that leaves is reported to the others, and a wait for it ends at its deadline") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const int port = pick_free_port();
  std::promise<void> rank1_left;
  auto rank1 = std::async(std::launch::async, [&] {
    {
      Runtime rt(options_for(1, 2, port, fabric));
    }
    rank1_left.set_value();
  });
  Runtime rt0(options_for(0, 2, port, fabric));
  rank1_left.get_future().get();
  rank1.get();
  rt0.comm().set_timeout(500ms);
  double x = 1;
  try {
    rt0.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
    FAIL("allreduce with a rank that left returned normally");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find("waiting for rank(s) 1") != std::string::npos);
  }
  // The directory's notice travelled while the allreduce waited out its deadline.
  CHECK(rt0.dead_ranks() == std::vector<int>{1});
}
