// Rendezvous through the directory, with ranks as threads of this process (each with its own actor
// system and Runtime): success, every way it fails with a clear error instead of a hang, the
// opaque per-rank bytes (rank 0's NCCL unique id) it hands to every rank, and what Runtime::nccl
// says when rank 0 published no id.
#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <map>
#include <string>
#include <vector>

#include <caf/all.hpp>

#include "actors/rendezvous.h"
#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "rank/runtime.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

RuntimeOptions options_for(int rank, int world, int port,
                           const std::shared_ptr<comm::InprocFabric>& fabric,
                           std::chrono::milliseconds timeout = 5000ms) {
  auto o = test::thread_rank(rank, world, port, fabric, timeout);
  // Each rank alone on its host.
  o.rank_info->local_rank = 0;
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
  for (auto& e : errors)
    named += e.find("duplicate rank: rank 1 registered twice") != std::string::npos;
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
  CHECK_THROWS_WITH(Runtime{o},
                    doctest::Contains("\"carrier-pigeon\" (expected \"ucx\" or \"inproc\")"));
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
    { Runtime rt(options_for(1, 2, port, fabric)); }
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

TEST_CASE(
    "every rank receives every rank's opaque bytes through the rendezvous, zero bytes included") {
  // Each rank its own actor system, as in separate processes: the bytes cross the front door.
  const int world = 3;
  const int port = pick_free_port();
  std::vector<std::string> blobs;
  std::string id(128, '\0');  // what an NCCL unique id looks like: 128 arbitrary bytes
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>((i * 37 + 1) % 256);
  id[5] = '\0';
  blobs.push_back(id);
  blobs.push_back("");  // ranks without anything to say
  blobs.push_back(std::string("two\0parts", 9));
  std::vector<std::future<std::vector<std::string>>> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(std::async(std::launch::async, [&, r] {
      caf::actor_system_config config;
      config.set("scheduler.max-threads", 1);
      caf::actor_system system(config);
      auto worker = system.spawn([](caf::event_based_actor* self) -> caf::behavior {
        self->set_default_handler(caf::drop);
        return {[](int) {}};
      });
      actors::RendezvousRequest request;
      request.rank = r;
      request.world_size = world;
      request.master_port = port;
      request.host = "host-" + std::to_string(r);
      request.extra = blobs[static_cast<size_t>(r)];
      request.timeout = 10s;
      actors::PublishedDirectory published;
      if (r == 0) published = actors::publish_directory(system, request);
      auto table = actors::rendezvous(system, request, worker, published.directory);
      table.connection.reset();
      published.door.reset();
      if (r == 0) caf::anon_send_exit(published.directory, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(worker, caf::exit_reason::user_shutdown);
      CHECK(table.hosts == std::vector<std::string>{"host-0", "host-1", "host-2"});
      return table.extras;
    }));
  for (auto& rank : ranks) {
    auto extras = rank.get();
    REQUIRE(extras.size() == blobs.size());
    for (size_t i = 0; i < blobs.size(); ++i) CHECK(extras[i] == blobs[i]);
  }
}

TEST_CASE("without an NCCL unique id from rank 0, Runtime::nccl says why on every rank") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options{options_for(0, 2, port, fabric, 10s),
                                      options_for(1, 2, port, fabric, 10s)};
  options[0].nccl = false;  // what rank 0 decides holds for the job, GPU or not
  auto errors = test::run_ranks(options, [](int r, Runtime& rt) {
    CHECK_FALSE(rt.nccl_available());
    try {
      rt.nccl(0);
      FAIL("Runtime::nccl returned without an id");
    } catch (const comm::Error& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("Runtime::nccl(0)") != std::string::npos);
#ifdef TROUPE_HAVE_NCCL
      CHECK(what.find("rank 0 published no NCCL unique id at the rendezvous") != std::string::npos);
      if (r == 0) CHECK(what.find("RuntimeOptions::nccl is off on rank 0") != std::string::npos);
#else
      (void)r;
      CHECK(what.find("built without NCCL") != std::string::npos);
#endif
    }
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE(
    "two jobs that share a secret and a port never meet: the other job's rank is refused by its "
    "job id") {
  const int port = pick_free_port();
  auto ours = std::make_shared<comm::InprocFabric>(2);
  auto theirs = std::make_shared<comm::InprocFabric>(2);
  auto rank_of = [&](int rank, const std::string& job, const std::shared_ptr<comm::InprocFabric>& f,
                     std::chrono::milliseconds timeout) {
    auto o = options_for(rank, 2, port, f, timeout);
    o.rank_info->job_secret = "one-secret-for-two-jobs-0123456789";
    o.rank_info->job_id = job;
    return o;
  };
  // Job b's rank 1 arrives at job a's rendezvous while job a's rank 0 waits for its own rank 1,
  // which starts only once the intruder has been answered: were both of job a's ranks started
  // together, job a could finish its rendezvous and close the port before the intruder connects.
  auto run_one = [](const RuntimeOptions& o) {
    try {
      Runtime rt(o);
      CHECK(rt.world_size() == 2);
      return std::string();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  };
  auto rank0 = std::async(std::launch::async, run_one, rank_of(0, "job-a", ours, 20s));
  std::vector<std::string> errors(3);
  errors[1] = run_one(rank_of(1, "job-b", theirs, 10s));
  errors[2] = run_one(rank_of(1, "job-a", ours, 10s));
  errors[0] = rank0.get();
  CAPTURE(errors[1]);
  CHECK(errors[0] == "");
  CHECK(errors[2] == "");
  CHECK(errors[1].find("rank 1 cannot join the rendezvous at 127.0.0.1:" + std::to_string(port) +
                       ": the process listening there does not hold this job's secret and id "
                       "(this rank's job is 'job-b', TROUPE_JOB_ID") != std::string::npos);
}
