// The troupe tool as users run it: info, and the allreduce benchmark's JSON over both transports.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/command.h"

namespace {

using troupe::test::Output;
using troupe::test::run;

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> rows;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace

TEST_CASE("troupe info names the versions of troupe, CAF, UCX and LibTorch") {
  auto out = run(std::string(TROUPE_BIN) + " info");
  INFO(out.text);
  CHECK(out.status == 0);
  CHECK(out.text.find("troupe 0.") != std::string::npos);
  CHECK(out.text.find("CAF 0.17.") != std::string::npos);
  CHECK(out.text.find("UCX 1.") != std::string::npos);
  CHECK(out.text.find("transports: ") != std::string::npos);
  CHECK(out.text.find("LibTorch ") != std::string::npos);
}

TEST_CASE("troupe bench allreduce prints one JSON object per size over ucx and inproc") {
  for (std::string transport : {"ucx", "inproc"}) {
    CAPTURE(transport);
    auto out = run(std::string(TROUPE_BIN) + " bench allreduce --world 2 --transport " + transport +
                   " --bytes 4KiB,1MiB --seconds 0.02 --json");
    INFO(out.text);
    REQUIRE(out.status == 0);
    auto rows = json_lines(out.text);
    REQUIRE(rows.size() == 2);
    CHECK(rows[0]["bytes"] == 4096);
    CHECK(rows[1]["bytes"] == 1048576);
    for (auto& row : rows) {
      CHECK(row["world"] == 2);
      CHECK(row["transport"] == transport);
      CHECK(row["sec"].get<double>() > 0);
      double algbw = row["bytes"].get<double>() / row["sec"].get<double>() / 1e9;
      CHECK(row["algbw_GBps"].get<double>() == doctest::Approx(algbw).epsilon(1e-3));
      CHECK(row["busbw_GBps"].get<double>() == doctest::Approx(algbw).epsilon(1e-3));
    }
  }
}

TEST_CASE("troupe rejects a bad size and a bad transport naming the value") {
  auto bad_size = run(std::string(TROUPE_BIN) + " bench allreduce --bytes 4XB");
  CHECK(bad_size.status != 0);
  CHECK(bad_size.text.find("'4XB'") != std::string::npos);
  auto bad_transport = run(std::string(TROUPE_BIN) + " bench allreduce --transport pigeon");
  CHECK(bad_transport.status != 0);
  CHECK(bad_transport.text.find("pigeon") != std::string::npos);
}

TEST_CASE(
    "troupe launch --link and --link-rank set TROUPE_LINK and TROUPE_LINK_RANKS for every rank") {
  auto out = run(std::string(TROUPE_BIN) +
                 " launch --link 1gbit,5ms --link-rank 1=100mbit,20ms --link-rank 0=1ms -n 2 --"
                 " sh -c 'echo \"link=$TROUPE_LINK ranks=$TROUPE_LINK_RANKS\"'");
  INFO(out.text);
  CHECK(out.status == 0);
  for (std::string rank : {"0", "1"})
    CHECK(out.text.find("[rank " + rank + "] link=1gbit,5ms ranks=1=100mbit,20ms;0=1ms") !=
          std::string::npos);
  auto bad_shape = run(std::string(TROUPE_BIN) + " launch --link 1gbt -n 2 -- true");
  CHECK(bad_shape.status != 0);
  CHECK(bad_shape.text.find("TROUPE_LINK: link shape '1gbt'") != std::string::npos);
  auto bad_rank = run(std::string(TROUPE_BIN) + " launch --link-rank 5=1ms -n 2 -- true");
  CHECK(bad_rank.status != 0);
  CHECK(bad_rank.text.find("names rank 5") != std::string::npos);
}

TEST_CASE("troupe bench allreduce --link makes every allreduce wait at least the link's latency") {
  for (std::string transport : {"ucx", "inproc"}) {
    CAPTURE(transport);
    auto out = run(std::string(TROUPE_BIN) + " bench allreduce --world 2 --transport " + transport +
                   " --bytes 4KiB --seconds 0.02 --json --link 1gbit,2ms");
    INFO(out.text);
    REQUIRE(out.status == 0);
    auto rows = json_lines(out.text);
    REQUIRE(rows.size() == 1);
    CHECK(rows[0]["link"] == "1gbit,2ms");
    // Each rank needs the other's 4 KiB, which cross a 2 ms link.
    CHECK(rows[0]["sec"].get<double>() >= 0.002);
  }
}

namespace {

// Writes `text` to a job file of its own and returns its path.
std::string job_file(const std::string& name, const std::string& text) {
  std::string path = "/tmp/troupe_cli_test_" + std::to_string(getpid()) + "_" + name + ".toml";
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path;
}

}  // namespace

TEST_CASE("troupe run trains Fashion-MNIST from a job file, as threads and as processes") {
  const std::string trainer = "[trainer]\nmodel = \"mlp\"\nepochs = 1\nlog_every = 200\n";
  SUBCASE("decentralized SGD on a ring, ranks as threads") {
    auto path = job_file("threads",
                         "[job]\nworld_size = 3\nmode = \"threads\"\n"
                         "[topology]\nkind = \"ring\"\n"
                         "[algorithm]\nname = \"decentralized\"\n" +
                             trainer);
    auto out = run(std::string(TROUPE_BIN) + " run " + path);
    INFO(out.text);
    CHECK(out.status == 0);
    CHECK(out.text.find("decentralized(ring(3, uniform), overlap), 3 rank(s) as threads") !=
          std::string::npos);
    for (const char* rank : {"[rank 0] epoch 1 step 200 loss", "[rank 1] epoch 1 step 200 loss",
                             "[rank 2] epoch 1 step 200 loss", "consensus distance"})
      CHECK(out.text.find(rank) != std::string::npos);
    std::remove(path.c_str());
  }
  SUBCASE("asynchronous gossip as processes over emulated links") {
    auto path = job_file("processes",
                         "[job]\nworld_size = 2\nmode = \"processes\"\n"
                         "[topology]\nkind = \"ring\"\n"
                         "[algorithm]\nname = \"async_gossip\"\n" +
                             trainer + "[links]\nall = \"10gbit,1ms\"\n");
    auto out = run(std::string(TROUPE_BIN) + " run " + path);
    INFO(out.text);
    CHECK(out.status == 0);
    CHECK(out.text.find("[rank 0] epoch 1 test accuracy") != std::string::npos);
    CHECK(out.text.find("[rank 1] finished: ") != std::string::npos);
    std::remove(path.c_str());
  }
}

TEST_CASE("troupe run names the key, the value and what is allowed in a bad job file") {
  auto path = job_file("bad", "[job]\nworld_size = 4\n[algorithm]\nname = \"gossip\"\n");
  auto out = run(std::string(TROUPE_BIN) + " run " + path);
  INFO(out.text);
  CHECK(out.status != 0);
  CHECK(out.text.find("algorithm.name = \"gossip\"") != std::string::npos);
  CHECK(out.text.find("decentralized") != std::string::npos);  // among the allowed names
  std::remove(path.c_str());
}

TEST_CASE("troupe run refuses SGD momentum on top of a compressor's momentum correction") {
  auto path = job_file("momentum",
                       "[job]\nworld_size = 2\nmode = \"threads\"\n"
                       "[algorithm]\nname = \"topk\"\nmomentum = 0.9\n"
                       "[trainer]\nmodel = \"mlp\"\nepochs = 1\nmomentum = 0.5\n");
  auto out = run(std::string(TROUPE_BIN) + " run " + path);
  INFO(out.text);
  CHECK(out.status != 0);
  CHECK(out.text.find("momentum 0.5 given, expected 0") != std::string::npos);
  CHECK(out.text.find("epoch 1") == std::string::npos);  // refused before training
  std::remove(path.c_str());
}

TEST_CASE("troupe bench ddp --interleave runs the three kinds of step in one job") {
  const std::string trace = "/tmp/troupe_cli_test_" + std::to_string(getpid()) + "_{rank}.json";
  auto out = run(std::string(TROUPE_BIN) +
                 " bench ddp --world 2 --interleave --batch 8 --steps 2 --json --trace " + trace);
  INFO(out.text);
  REQUIRE(out.status == 0);
  auto rows = json_lines(out.text);
  REQUIRE(rows.size() == 1);
  auto& row = rows[0];
  CHECK(row["interleave"] == true);
  CHECK(row["world"] == 2);
  CHECK(row["steps"] == 2);
  CHECK(row["gradient_path"] == "cpu via shared memory");
  for (const char* key :
       {"step_sec", "compute_step_sec", "alone_step_sec", "backward_sec", "compute_backward_sec"})
    CHECK_MESSAGE(row[key].get<double>() > 0, key);
  // Through shared memory each rank writes its half of every bucket into the other's memory:
  // half of the MLP's 7,912,458 float32 gradients, padded per bucket by at most 64 bytes.
  const double half = 7912458 * 4 / 2.0;
  CHECK(row["bytes_sent_per_step"].get<double>() >= half);
  CHECK(row["bytes_sent_per_step"].get<double>() <= half + 4 * 64);
  // Only the data-parallel steps reduce: 5 warm-up iterations and 2 measured ones, one each,
  // while the compute and alone steps run under no_sync() and leave no wait in the trace.
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    const std::string path =
        "/tmp/troupe_cli_test_" + std::to_string(getpid()) + "_" + std::to_string(rank) + ".json";
    std::ifstream in(path);
    REQUIRE(in.good());
    auto events = nlohmann::json::parse(in)["traceEvents"];
    int waits = 0;
    for (auto& e : events) waits += e["name"] == "wait for reductions";
    CHECK(waits == 7);
    std::remove(path.c_str());
  }

  auto alone = run(std::string(TROUPE_BIN) + " bench ddp --world 1 --interleave --steps 1");
  CHECK(alone.status != 0);
  CHECK(alone.text.find("--interleave needs --world >= 2") != std::string::npos);
  CHECK(alone.text.find("got --world 1") != std::string::npos);
}
