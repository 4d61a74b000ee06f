#include "rank/env.h"

#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/status.h"

namespace {

using troupe::RankInfo;
using troupe::comm::Error;

/// A fake environment: only the variables in the map are set.
troupe::GetEnv fake(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

/// The message of the comm::Error that reading `vars` throws, or "" when it does not throw.
std::string error_of(std::map<std::string, std::string> vars) {
  try {
    troupe::rank_info_from_env(fake(std::move(vars)));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("torchrun's variables give rank, sizes and rendezvous") {
  RankInfo info = troupe::rank_info_from_env(fake({{"RANK", "3"},
                                                   {"WORLD_SIZE", "8"},
                                                   {"LOCAL_RANK", "1"},
                                                   {"LOCAL_WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "10.0.0.7"},
                                                   {"MASTER_PORT", "12345"}}));
  CHECK(info.source == "torchrun");
  CHECK(info.rank == 3);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "10.0.0.7");
  CHECK(info.master_port == 12345);
}

TEST_CASE("RANK and WORLD_SIZE alone mean one node with the default rendezvous") {
  RankInfo info = troupe::rank_info_from_env(fake({{"RANK", "2"}, {"WORLD_SIZE", "4"}}));
  CHECK(info.source == "torchrun");
  CHECK(info.local_rank == 2);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);
}

TEST_CASE("Open MPI's variables are read under mpirun, with MASTER_ADDR and MASTER_PORT applied") {
  RankInfo info = troupe::rank_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "5"},
                                                   {"OMPI_COMM_WORLD_SIZE", "6"},
                                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                                                   {"MASTER_ADDR", "node0"},
                                                   {"MASTER_PORT", "4000"}}));
  CHECK(info.source == "mpirun");
  CHECK(info.rank == 5);
  CHECK(info.world_size == 6);
  CHECK(info.local_rank == 2);
  CHECK(info.local_world_size == 3);
  CHECK(info.master_addr == "node0");
  CHECK(info.master_port == 4000);
}

TEST_CASE("Slurm's variables are read, the local size expanded from SLURM_TASKS_PER_NODE") {
  RankInfo info = troupe::rank_info_from_env(fake({{"SLURM_PROCID", "6"},
                                                   {"SLURM_NTASKS", "7"},
                                                   {"SLURM_LOCALID", "0"},
                                                   {"SLURM_NODEID", "3"},
                                                   {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                                                   {"SLURM_LAUNCH_NODE_IPADDR", "192.168.1.9"}}));
  CHECK(info.source == "slurm");
  CHECK(info.rank == 6);
  CHECK(info.world_size == 7);
  CHECK(info.local_rank == 0);
  CHECK(info.local_world_size == 1);
  CHECK(info.master_addr == "192.168.1.9");
  CHECK(info.master_port == 29500);
}

TEST_CASE("SLURM_NTASKS_PER_NODE gives the local size and MASTER_ADDR overrides the launch node") {
  RankInfo info = troupe::rank_info_from_env(fake({{"SLURM_PROCID", "3"},
                                                   {"SLURM_NTASKS", "4"},
                                                   {"SLURM_LOCALID", "1"},
                                                   {"SLURM_NTASKS_PER_NODE", "2"},
                                                   {"SLURM_TASKS_PER_NODE", "3,1"},
                                                   {"SLURM_LAUNCH_NODE_IPADDR", "192.168.1.9"},
                                                   {"MASTER_ADDR", "head"},
                                                   {"MASTER_PORT", "29600"}}));
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "head");
  CHECK(info.master_port == 29600);
}

TEST_CASE("an unreadable SLURM_TASKS_PER_NODE falls back to one node") {
  RankInfo info = troupe::rank_info_from_env(
      fake({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "3"}, {"SLURM_TASKS_PER_NODE", "two"}}));
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 3);
}

TEST_CASE("without a launcher the process is rank 0 of 1") {
  RankInfo info = troupe::rank_info_from_env(fake({{"PATH", "/bin"}}));
  CHECK(info.source == "default");
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
  CHECK(info.local_world_size == 1);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);
}

TEST_CASE("torchrun's variables win over Open MPI's and Slurm's") {
  RankInfo info = troupe::rank_info_from_env(fake({{"RANK", "1"},
                                                   {"WORLD_SIZE", "2"},
                                                   {"OMPI_COMM_WORLD_RANK", "0"},
                                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                                   {"SLURM_PROCID", "3"},
                                                   {"SLURM_NTASKS", "5"}}));
  CHECK(info.source == "torchrun");
  CHECK(info.rank == 1);
  CHECK(info.world_size == 2);
}

TEST_CASE("Open MPI's variables win over Slurm's") {
  RankInfo info = troupe::rank_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "0"},
                                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                                   {"SLURM_PROCID", "3"},
                                                   {"SLURM_NTASKS", "5"}}));
  CHECK(info.source == "mpirun");
  CHECK(info.world_size == 4);
}

TEST_CASE("a non-integer WORLD_SIZE is an error naming the variable and the value") {
  std::string message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "abc"}});
  CHECK(message == "WORLD_SIZE='abc' is not an integer (expected a positive integer)");
}

TEST_CASE("trailing garbage, spaces and empty values are not integers") {
  CHECK(contains(error_of({{"RANK", "3x"}, {"WORLD_SIZE", "4"}}), "RANK='3x' is not an integer"));
  CHECK(contains(error_of({{"RANK", " 1"}, {"WORLD_SIZE", "4"}}), "RANK=' 1' is not an integer"));
  CHECK(contains(error_of({{"RANK", ""}, {"WORLD_SIZE", "4"}}), "RANK='' is not an integer"));
  CHECK(contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1.5"}}),
                 "LOCAL_RANK='1.5' is not an integer"));
}

TEST_CASE("negative, zero and overflowing values are errors naming the variable") {
  CHECK(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}) ==
        "RANK='-1' is negative (expected a non-negative integer)");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}) ==
        "WORLD_SIZE='0' is out of range (expected a positive integer)");
  CHECK(contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}),
                 "WORLD_SIZE='99999999999' is out of range"));
  CHECK(contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "123456789012345678901234567890"}}),
                 "is out of range"));
  CHECK(contains(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "-2"}}),
                 "OMPI_COMM_WORLD_SIZE='-2' is negative"));
  CHECK(contains(error_of({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}),
                 "SLURM_PROCID='x' is not an integer"));
  CHECK(contains(
      error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NTASKS_PER_NODE", "0"}}),
      "SLURM_NTASKS_PER_NODE='0' is out of range"));
}

TEST_CASE("MASTER_PORT must be a port and MASTER_ADDR must not be empty") {
  CHECK(error_of({{"MASTER_PORT", "70000"}}) ==
        "MASTER_PORT='70000' is out of range (expected a port in 1..65535)");
  CHECK(contains(error_of({{"MASTER_PORT", "0"}}), "MASTER_PORT='0' is out of range"));
  CHECK(contains(error_of({{"MASTER_PORT", "80a"}}), "MASTER_PORT='80a' is not an integer"));
  CHECK(contains(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", ""}}),
                 "MASTER_ADDR='' is empty"));
}

TEST_CASE("a partial torchrun environment names the missing variable") {
  CHECK(error_of({{"RANK", "1"}}) ==
        "WORLD_SIZE is not set but RANK is (expected a positive integer)");
  CHECK(contains(error_of({{"WORLD_SIZE", "2"}}), "RANK is not set but WORLD_SIZE is"));
  CHECK(contains(error_of({{"OMPI_COMM_WORLD_RANK", "1"}}),
                 "OMPI_COMM_WORLD_SIZE is not set but OMPI_COMM_WORLD_RANK is"));
  CHECK(contains(error_of({{"SLURM_PROCID", "1"}}), "SLURM_NTASKS is not set but SLURM_PROCID is"));
}

TEST_CASE("a rank at or past the world size is rejected with both numbers") {
  CHECK(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}) ==
        "rank 4 is out of range (expected 0..3 for world_size 4) (source torchrun)");
  CHECK(contains(error_of({{"OMPI_COMM_WORLD_RANK", "9"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
                 "rank 9 is out of range (expected 0..1 for world_size 2) (source mpirun)"));
  CHECK(contains(
      error_of(
          {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
      "local_rank 2 is out of range (expected 0..1 for local_world_size 2)"));
  CHECK(contains(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}),
                 "local_world_size 3 is out of range (expected 1..2"));
}

TEST_CASE("validate rejects a hand-built RankInfo that cannot be a job") {
  RankInfo info;
  info.source = "explicit";
  CHECK_NOTHROW(troupe::validate(info));
  info.world_size = 0;
  CHECK_THROWS_WITH_AS(troupe::validate(info),
                       "world_size 0 is not positive (expected at least 1) (source explicit)",
                       Error);
  info = RankInfo{};
  info.rank = -1;
  CHECK_THROWS_AS(troupe::validate(info), Error);
  info = RankInfo{};
  info.master_port = 65536;
  CHECK_THROWS_WITH_AS(troupe::validate(info),
                       "master_port 65536 is out of range (expected 1..65535) (source default)",
                       Error);
  info = RankInfo{};
  info.master_addr = "";
  CHECK_THROWS_AS(troupe::validate(info), Error);
}

TEST_CASE(
    "TROUPE_LINK shapes every link and TROUPE_LINK_RANKS the links to and from chosen ranks") {
  auto none = troupe::link_emulation_from_env(4, fake({}));
  CHECK_FALSE(none.active());
  auto links = troupe::link_emulation_from_env(
      4, fake({{"TROUPE_LINK", "1gbit,5ms"}, {"TROUPE_LINK_RANKS", "3=100mbit,20ms;1=2ms"}}));
  CHECK(links.all.bytes_per_sec == doctest::Approx(125e6));
  CHECK(links.all.latency == std::chrono::milliseconds(5));
  REQUIRE(links.ranks.size() == 2);
  CHECK(links.ranks[0].first == 3);
  CHECK(links.ranks[0].second.latency == std::chrono::milliseconds(20));
  CHECK(links.ranks[1].first == 1);
  auto slow_only = troupe::link_emulation_from_env(4, fake({{"TROUPE_LINK_RANKS", "2=10mbit"}}));
  CHECK(slow_only.active());
  CHECK_FALSE(slow_only.all.active());
}

TEST_CASE("a bad TROUPE_LINK or TROUPE_LINK_RANKS is an error naming the variable and the value") {
  auto error = [](std::map<std::string, std::string> vars) {
    try {
      troupe::link_emulation_from_env(4, fake(std::move(vars)));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto bad_link = error({{"TROUPE_LINK", "1gbt,5ms"}});
  CHECK(contains(bad_link, "TROUPE_LINK: link shape '1gbt,5ms'"));
  CHECK(contains(bad_link, "expected a rate such as 1gbit"));
  auto bad_entry = error({{"TROUPE_LINK_RANKS", "three=1gbit"}});
  CHECK(contains(bad_entry, "TROUPE_LINK_RANKS: link ranks 'three=1gbit'"));
  CHECK(contains(bad_entry, "expected RANK=SHAPE"));
  CHECK(error({{"TROUPE_LINK_RANKS", "4=1gbit"}}) ==
        "TROUPE_LINK_RANKS='4=1gbit' names rank 4 (expected a rank in 0..3 for world_size 4)");
}

TEST_CASE("link_emulation_env gives the variables for launched ranks and checks them first") {
  using Vars = std::vector<std::pair<std::string, std::string>>;
  CHECK(troupe::link_emulation_env("", {}, 2).empty());
  CHECK(troupe::link_emulation_env("1gbit,5ms", {"1=100mbit", "0=20ms"}, 2) ==
        Vars{{"TROUPE_LINK", "1gbit,5ms"}, {"TROUPE_LINK_RANKS", "1=100mbit;0=20ms"}});
  CHECK_THROWS_WITH_AS(troupe::link_emulation_env("", {"2=1gbit"}, 2),
                       doctest::Contains("names rank 2"), Error);
  CHECK_THROWS_WITH_AS(troupe::link_emulation_env("fast", {}, 2),
                       doctest::Contains("TROUPE_LINK: link shape 'fast'"), Error);
}

TEST_CASE(
    "the job secret, bind address and TLS files come from the environment under any launcher") {
  auto info = troupe::rank_info_from_env(fake({{"RANK", "1"},
                                               {"WORLD_SIZE", "2"},
                                               {"TROUPE_JOB_SECRET", "0123456789abcdef"},
                                               {"TROUPE_BIND_ADDRESS", "0.0.0.0"},
                                               {"TROUPE_TLS_CERT", "/c.pem"},
                                               {"TROUPE_TLS_KEY", "/k.pem"},
                                               {"TROUPE_TLS_CA", "/ca.pem"}}));
  CHECK(info.job_secret == "0123456789abcdef");
  CHECK(info.bind_address == "0.0.0.0");
  CHECK(info.tls_cert == "/c.pem");
  CHECK(info.tls_key == "/k.pem");
  CHECK(info.tls_ca == "/ca.pem");
  info = troupe::rank_info_from_env(fake(
      {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"TROUPE_JOB_SECRET", "0123456789abcdef"}}));
  CHECK(info.job_secret == "0123456789abcdef");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TROUPE_TLS_CERT", "/c.pem"}}) ==
        "TROUPE_TLS_KEY is not set, but TROUPE_TLS_CERT is (expected all three of TROUPE_TLS_CERT, "
        "TROUPE_TLS_KEY and TROUPE_TLS_CA, or none)");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TROUPE_TLS_CA", "/ca.pem"}})
            .find("TROUPE_TLS_CERT is not set, but TROUPE_TLS_CA is") == 0);
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TROUPE_JOB_SECRET", "short"}})
            .find("TROUPE_JOB_SECRET has 5 characters (expected at least 16") == 0);
}
