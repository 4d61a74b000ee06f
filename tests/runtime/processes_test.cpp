// The same collective checks as the thread tests, as real processes over UCX, started by the
// launcher; a rank killed in the middle of a large allreduce; and, where torch sees a GPU, two
// processes sharing it through UCX with host staging.
#include <torch/cuda.h>

#include <doctest/doctest.h>

#include <sstream>

#include "elastic/launch.h"
#include "tests/support/skip.h"

using namespace troupe;

namespace {
// `ucx_tls`: the UCX transports the ranks may use; empty: troupe's choice for one host.
LaunchResult run_job(int n, const std::string& scenario, bool stop_on_failure, std::string* log,
                     const std::string& ucx_tls = "sm,self") {
  LaunchOptions o;
  o.nprocs = n;
  o.command = {TROUPE_TEST_RANK_BIN, scenario};
  o.timeout_sec = 240;
  o.stop_on_failure = stop_on_failure;
  if (!ucx_tls.empty()) o.extra_env = {{"UCX_TLS", ucx_tls}};
  std::ostringstream out, err;
  auto result = launch(o, out, err);
  *log = out.str() + err.str();
  return result;
}
}  // namespace

TEST_CASE("every collective over UCX between 2 processes matches the reference") {
  std::string log;
  auto r = run_job(2, "collectives", true, &log);
  INFO(log);
  CHECK(r.exit_code == 0);
  CHECK(log.find("allreduce through shared memory: yes") != std::string::npos);
}

TEST_CASE("every collective over UCX between 4 processes matches the reference") {
  std::string log;
  auto r = run_job(4, "collectives", true, &log);
  INFO(log);
  CHECK(r.exit_code == 0);
  CHECK(log.find("allreduce through shared memory: yes") != std::string::npos);
}

TEST_CASE(
    "killing one rank in a large allreduce ends every other rank's call with an error naming it") {
  // Through shared memory (one host's default) and over the transport.
  for (const char* scenario : {"kill_one", "kill_one_transport"}) {
    CAPTURE(scenario);
    std::string log;
    auto r = run_job(4, scenario, false, &log);
    INFO(log);
    REQUIRE(r.rank_exit_codes.size() == 4);
    CHECK(r.rank_exit_codes[3] == 128 + 9);  // SIGKILL
    for (int rank = 0; rank < 3; ++rank) CHECK(r.rank_exit_codes[rank] == 0);
  }
}

TEST_CASE("a rank that dies mid-training ends every survivor's step with an error naming it") {
  std::string log;
  auto r = run_job(3, "ddp_kill_one", false, &log);
  INFO(log);
  REQUIRE(r.rank_exit_codes.size() == 3);
  CHECK(r.rank_exit_codes[2] == 128 + 9);  // SIGKILL
  for (int rank = 0; rank < 2; ++rank) CHECK(r.rank_exit_codes[rank] == 0);
}

TEST_CASE(
    "a step whose peer never enters the reduction fails at the collective timeout, on the "
    "shared-memory path and the transport's") {
  // The scenario's rank 0 checks its error and when it came (tests/runtime/rank_main.cpp).
  for (const std::string scenario : {"ddp_late_rank_shm", "ddp_late_rank_transport"}) {
    INFO(scenario);
    std::string log;
    auto r = run_job(2, scenario, false, &log);
    INFO(log);
    REQUIRE(r.rank_exit_codes.size() == 2);
    CHECK(r.rank_exit_codes[0] == 0);
    CHECK(r.rank_exit_codes[1] == 0);
  }
}

// The victim may die in the middle of a send to a neighbour: over UCX's shared memory that once
// left the neighbour deaf to its other neighbour (twice in CI), so gossip's messages take the
// transport's peer-failure endpoints (Transport::survive_peer_loss), with troupe's own choice of
// UCX transports for one host.
TEST_CASE("decentralized and asynchronous gossip go on without a neighbour that dies") {
  for (const char* scenario : {"gossip_kill_one", "async_gossip_kill_one"}) {
    CAPTURE(scenario);
    std::string log;
    auto r = run_job(4, scenario, false, &log, /*ucx_tls=*/"");
    INFO(log);
    CHECK(log.find("unable to hear each other") == std::string::npos);
    REQUIRE(r.rank_exit_codes.size() == 4);
    CHECK(r.rank_exit_codes[3] == 128 + 9);  // SIGKILL
    for (int rank = 0; rank < 3; ++rank) CHECK(r.rank_exit_codes[rank] == 0);
    CHECK(log.find("dropped rank 3") != std::string::npos);  // the log names the dropped peer
  }
}

TEST_CASE("a hierarchical allreduce over 4 processes pretending to be two hosts sums everything") {
  std::string log;
  auto r = run_job(4, "hierarchical", true, &log);
  INFO(log);
  CHECK(r.exit_code == 0);
  CHECK(log.find("on pretend-host-b: hierarchical allreduce correct") != std::string::npos);
}

TEST_CASE("two processes sharing one GPU train through UCX with host staging like one process") {
  if (!torch::cuda::is_available()) {
    troupe::test::skip_case("torch sees no CUDA device: skipping the GPU scenario");
    return;
  }
  std::string log;
  auto r = run_job(2, "cuda_staging", true, &log);
  INFO(log);
  CHECK(r.exit_code == 0);
  CHECK(log.find("rank 1 (cuda via host staging): largest difference") != std::string::npos);
}
