// Sizes are checked before anything is allocated for them: a world size from the environment, a
// job file's world size, and the number of processes a launch starts.
#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <string>

#include "comm/status.h"
#include "elastic/launch.h"
#include "rank/env.h"
#include "rank/runtime.h"
#include "tools/job_config.h"

using namespace troupe;

namespace {

GetEnv fake(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

/// What `f` throws as comm::Error, or "" when it does not throw.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a world size past the largest job is refused from every launcher's variables") {
  const std::string limit = "(expected 1..65536, the most ranks a job may have)";
  CHECK(error_of([] {
          rank_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "2147483647"}}));
        }) == "WORLD_SIZE = 2147483647 is out of range " + limit);
  CHECK(error_of([] {
          rank_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "65537"}}));
        }) == "WORLD_SIZE = 65537 is out of range " + limit);
  CHECK(error_of([] {
          rank_info_from_env(
              fake({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "300000000"}}));
        }) == "OMPI_COMM_WORLD_SIZE = 300000000 is out of range " + limit);
  CHECK(error_of([] {
          rank_info_from_env(fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1000000"}}));
        }) == "SLURM_NTASKS = 1000000 is out of range " + limit);
  const RankInfo largest = rank_info_from_env(fake({{"RANK", "65535"}, {"WORLD_SIZE", "65536"}}));
  CHECK(largest.world_size == kMaxWorldSize);
  CHECK(largest.rank == 65535);
}

TEST_CASE("validate refuses a hand-built RankInfo of 2^31-1 ranks naming the field") {
  RankInfo info;
  info.world_size = 2147483647;
  info.source = "explicit";
  CHECK(error_of([&] { validate(info); }) ==
        "world_size = 2147483647 is out of range (expected 1..65536, the most ranks a job may "
        "have)");
}

TEST_CASE("a job file's world size is capped at the ranks one host starts, and lower as threads") {
  for (const std::string mode : {"threads", "processes"}) {
    CAPTURE(mode);
    const std::string tail = "\nmode = \"" + mode + "\"\n[algorithm]\nname = \"allreduce\"\n";
    CHECK(error_of([&] { parse_job_config("[job]\nworld_size = 100000" + tail, "job.toml"); }) ==
          "job.toml: job.world_size = 100000: expected an integer in [1, 4096] (the most ranks "
          "one host starts; troupe run starts every rank here)");
    CHECK(error_of([&] {
            parse_job_config("[job]\nworld_size = 2147483648" + tail, "job.toml");
          }).find("job.world_size = 2147483648: expected an integer in [1, 4096]") !=
          std::string::npos);
  }
  const std::string allreduce = "\n[algorithm]\nname = \"allreduce\"\n";
  CHECK(parse_job_config("[job]\nworld_size = 4096\nmode = \"processes\"" + allreduce, "job.toml")
            .world_size == 4096);
  CHECK(error_of([&] {
          parse_job_config("[job]\nworld_size = 257\nmode = \"threads\"" + allreduce, "job.toml");
        }) ==
        "job.toml: job.world_size = 257: expected an integer in [1, 256] with mode = "
        "\"threads\" (the most ranks one process runs as threads; mode = \"processes\" "
        "allows 4096)");
  CHECK(parse_job_config("[job]\nworld_size = 256\nmode = \"threads\"" + allreduce, "job.toml")
            .world_size == 256);
}

TEST_CASE("a launch of more processes than one host starts is refused before any starts") {
  LaunchOptions options;
  options.nprocs = 100000;
  // Without the check this fails at rank 0 (no such program) instead of forking 100000 ranks.
  options.command = {"troupe-no-such-program"};
  CHECK(error_of([&] { launch(options); }) ==
        "LaunchOptions.nprocs = 100000 is out of range (expected 1..4096, the most ranks one host "
        "starts)");
  CHECK(error_of([] { check_world_size(0, "--world"); }) ==
        "--world = 0 is out of range (expected 1..65536, the most ranks a job may have)");
  CHECK(error_of([] { check_world_size(kMaxLocalRanks, "-n", kMaxLocalRanks); }).empty());
}

TEST_CASE("a Runtime refuses more scheduler threads than it would sensibly start") {
  RuntimeOptions options;
  RankInfo info;
  info.source = "explicit";
  options.rank_info = info;
  options.scheduler_threads = 100000;
  CHECK(error_of([&] { Runtime rt(options); }) ==
        "RuntimeOptions.scheduler_threads=100000 (expected 0..256; 0 = default)");
}
