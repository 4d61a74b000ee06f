// One launch per host (`troupe launch --nnodes M --node-rank I -n N`): the torchrun variables each
// local rank gets, global ranks in the output and the messages, and the options refused before
// any rank starts. Two launches meeting as one job are in multi_node_processes_test.cpp.
#include <doctest/doctest.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "comm/status.h"
#include "elastic/launch.h"
#include "rank/env.h"

namespace {

using troupe::LaunchOptions;

LaunchOptions nodes(int nnodes, int node_rank, int nprocs) {
  LaunchOptions options;
  options.nnodes = nnodes;
  options.node_rank = node_rank;
  options.nprocs = nprocs;
  options.master_addr = "10.0.0.1";
  options.command = {"/bin/sh", "-c", "true"};
  return options;
}

std::map<std::string, std::string> env_of(const LaunchOptions& options, int local_rank,
                                          int port = 29501) {
  auto vars = troupe::rank_env(options, local_rank, port);
  std::map<std::string, std::string> env(vars.begin(), vars.end());
  REQUIRE(env.size() == vars.size());  // no variable twice
  return env;
}

std::string error_of(const LaunchOptions& options) {
  try {
    troupe::launch(options);
  } catch (const troupe::comm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("each local rank of node 2 of 4 gets its global rank and torchrun's other variables") {
  const LaunchOptions options = nodes(4, 2, 3);
  for (int local = 0; local < 3; ++local) {
    CAPTURE(local);
    const std::map<std::string, std::string> want = {{"RANK", std::to_string(6 + local)},
                                                     {"WORLD_SIZE", "12"},
                                                     {"LOCAL_RANK", std::to_string(local)},
                                                     {"LOCAL_WORLD_SIZE", "3"},
                                                     {"GROUP_RANK", "2"},
                                                     {"GROUP_WORLD_SIZE", "4"},
                                                     {"ROLE_RANK", std::to_string(6 + local)},
                                                     {"ROLE_WORLD_SIZE", "12"},
                                                     {"MASTER_ADDR", "10.0.0.1"},
                                                     {"MASTER_PORT", "29501"}};
    CHECK(env_of(options, local) == want);
  }
}

TEST_CASE("the variables of every rank of every node read back as a job of distinct ranks") {
  // What rank/env.cpp makes of them: each global rank exactly once, on the right node.
  std::vector<int> seen(2 * 3, 0);
  for (int node = 0; node < 2; ++node) {
    for (int local = 0; local < 3; ++local) {
      auto env = env_of(nodes(2, node, 3), local);
      auto info = troupe::rank_info_from_env([&env](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      });
      CHECK(info.world_size == 6);
      CHECK(info.local_world_size == 3);
      CHECK(info.local_rank == local);
      CHECK(info.rank / 3 == node);
      CHECK(info.master_addr == "10.0.0.1");
      CHECK(info.master_port == 29501);
      ++seen.at(info.rank);
    }
  }
  CHECK(seen == std::vector<int>(6, 1));
}

TEST_CASE("one node without an address gets 127.0.0.1 and its ranks are the local ranks") {
  LaunchOptions options = nodes(1, 0, 2);
  options.master_addr.clear();
  CHECK(env_of(options, 1).at("MASTER_ADDR") == "127.0.0.1");
  CHECK(env_of(options, 1).at("RANK") == "1");
  CHECK(env_of(options, 1).at("GROUP_WORLD_SIZE") == "1");
  CHECK_THROWS_WITH_AS(troupe::rank_env(options, 2, 29500),
                       "rank_env: local_rank = 2 is out of range (expected 0..1 for nprocs = 2)",
                       troupe::comm::Error);
}

TEST_CASE("the ranks of node 1 are named by their global rank in the output and the message") {
  LaunchOptions options = nodes(2, 1, 2);
  options.master_port = 29999;  // nothing listens: the ranks only print and exit
  options.command = {"/bin/sh", "-c",
                     "echo rank=$RANK local=$LOCAL_RANK; if [ $RANK = 3 ]; then exit 5; fi"};
  std::ostringstream out, err;
  auto result = troupe::launch(options, out, err);
  CHECK(result.exit_code == 5);
  CHECK(result.failed_rank == 3);
  REQUIRE(result.rank_exit_codes.size() == 2);
  CHECK(result.rank_exit_codes[1] == 5);
  CHECK(result.message.find("rank 3 exited with status 5") == 0);
  CHECK(out.str().find("[rank 2] rank=2 local=0\n") != std::string::npos);
  CHECK(out.str().find("[rank 3] rank=3 local=1\n") != std::string::npos);
}

TEST_CASE(
    "a node rank past the nodes, no nodes, too many ranks and no master address are refused") {
  CHECK(error_of(nodes(4, 4, 2)) ==
        "LaunchOptions.node_rank (--node-rank) = 4 is out of range (expected 0..3 for nnodes "
        "(--nnodes) = 4)");
  CHECK(error_of(nodes(2, -1, 2)) ==
        "LaunchOptions.node_rank (--node-rank) = -1 is out of range (expected 0..1 for nnodes "
        "(--nnodes) = 2)");
  CHECK(error_of(nodes(0, 0, 2)) ==
        "LaunchOptions.nnodes (--nnodes) = 0 is not positive (expected at least 1: the number of "
        "hosts, each running one launch)");
  CHECK(error_of(nodes(20, 0, 4000)) ==
        "LaunchOptions world size nnodes x nprocs (--nnodes 20 x -n 4000) = 80000 is out of "
        "range (expected 1..65536, the most ranks a job may have)");
  // Past int: the product is taken in 64 bits.
  CHECK(error_of(nodes(1 << 20, 0, 4096)).find("= 4294967296 is out of range") !=
        std::string::npos);
  LaunchOptions no_address = nodes(2, 1, 2);
  no_address.master_addr.clear();
  CHECK(error_of(no_address) ==
        "LaunchOptions.master_addr (--master-addr) is not set for nnodes (--nnodes) = 2 (expected "
        "the host name or IP address of node 0, where rank 0 listens, the same on every node)");
  CHECK_THROWS_AS(troupe::rank_env(nodes(4, 4, 2), 0, 29500), troupe::comm::Error);
}
