// Jobs across emulated hosts of the network test bed (scripts/netbed: one network namespace, host
// name, /dev/shm and PID space per host, links shaped by tc tbf), one troupe_netbed_rank per rank:
// results against closed forms and one process, the bytes that really crossed each host's link,
// the path each pair of ranks took, and a link taken down mid-run. Needs root, ip, tc and
// unshare; elsewhere every case reports itself skipped.
#include <unistd.h>

#include <doctest/doctest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/command.h"
#include "tests/support/skip.h"

namespace {

const std::string kNetbed = std::string(TROUPE_SOURCE_DIR) + "/scripts/netbed";

// A bed name of this test process (at most 4 characters), so that cases run in parallel by ctest
// get their own namespaces and bridges.
std::string bed_name() { return "t" + std::to_string(getpid() % 1000); }

// Why no bed can be made here, or "" when one can: tried by making and removing a one-host bed.
std::string netbed_unavailable() {
  if (geteuid() != 0) return "not root (network namespaces need CAP_NET_ADMIN)";
  for (const char* tool : {"ip", "tc", "unshare", "nsenter"})
    if (troupe::test::run(std::string("command -v ") + tool).status != 0)
      return std::string("no '") + tool + "' on PATH";
  const std::string env = "NETBED_NAME=" + bed_name() + " ";
  auto up = troupe::test::run(env + kNetbed + " up 1");
  troupe::test::run(env + kNetbed + " down");
  if (up.status != 0) return "scripts/netbed cannot make a namespace here: " + up.text;
  return "";
}

struct Job {
  int status = -1;
  std::string output;               // the netbed's own output
  std::vector<std::string> logs;    // each rank's log, by rank
  std::vector<long long> sent;      // bytes out of each host over its link, by host
  std::vector<long long> received;  // bytes into each host
};

// What ranks 0 .. ranks-1 of a job printed, from the logs directory netbed wrote them in.
std::vector<std::string> rank_logs(const std::string& dir, int ranks) {
  std::vector<std::string> logs;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".log");
    std::ostringstream text;
    text << in.rdbuf();
    logs.push_back(text.str());
  }
  return logs;
}

// `netbed job`: a bed of `hosts` hosts for one run of troupe_netbed_rank ARGS, torn down after.
Job run_job(int hosts, const std::string& options, const std::string& args, int ranks) {
  char dir[] = "/tmp/netbed-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string logs = dir;
  Job job;
  auto out = troupe::test::run("NETBED_NAME=" + bed_name() + " " + kNetbed + " job " +
                               std::to_string(hosts) + " " + options + " --quiet --logs " + logs +
                               " -- " + TROUPE_NETBED_RANK_BIN + " " + args);
  job.status = out.status;
  job.output = out.text;
  job.logs = rank_logs(logs, ranks);
  std::ifstream bytes(logs + "/bytes");
  std::regex line(R"(host (\d+) veth \S+ sent_bytes (\d+) received_bytes (\d+))");
  for (std::string text; std::getline(bytes, text);) {
    std::smatch m;
    if (!std::regex_match(text, m, line)) continue;
    job.sent.push_back(std::stoll(m[2]));
    job.received.push_back(std::stoll(m[3]));
  }
  troupe::test::run("rm -rf " + logs);
  return job;
}

std::string all_logs(const Job& job) {
  std::string text = job.output;
  for (size_t r = 0; r < job.logs.size(); ++r)
    text += "--- rank " + std::to_string(r) + "\n" + job.logs[r];
  return text;
}

}  // namespace

TEST_CASE(
    "an allreduce and a data-parallel job across 3 emulated hosts are right and cross the links") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  const int hosts = 3, mib = 8;
  auto job = run_job(hosts, "--rate 1gbit --timeout 50", "network " + std::to_string(mib), hosts);
  INFO(all_logs(job));
  CHECK(job.status == 0);
  for (int r = 0; r < hosts; ++r) {
    CHECK(job.logs[r].find("allreduce of 8 MiB correct") != std::string::npos);
    CHECK(job.logs[r].find("(cpu): ddp largest difference") != std::string::npos);
    CHECK(job.logs[r].find("WRONG") == std::string::npos);
  }
  // A ring allreduce sends 2 (W - 1) / W of the buffer out of every rank, and receives as much.
  const long long payload = 2LL * (hosts - 1) * (static_cast<long long>(mib) << 20) / hosts;
  REQUIRE(job.sent.size() == static_cast<size_t>(hosts));
  for (int h = 0; h < hosts; ++h) {
    CAPTURE(h);
    CHECK(job.sent[h] >= payload);
    CHECK(job.received[h] >= payload);
  }
}

TEST_CASE("ranks under one host name on two emulated hosts are grouped by their real hosts") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  // Two hosts of two ranks each, all calling themselves "one-name": pairs within a host use
  // shared memory, pairs across hosts the network, and the hierarchical reduction follows.
  auto job = run_job(2, "--rate 1gbit --timeout 50 --per-host 2 --env TROUPE_HOST_NAME=one-name",
                     "hosts 2", 4);
  INFO(all_logs(job));
  CHECK(job.status == 0);
  for (int r = 0; r < 4; ++r) {
    CHECK(job.logs[r].find("on one-name: host " + std::to_string(r / 2)) != std::string::npos);
    CHECK(job.logs[r].find("(cpu): ddp largest difference") != std::string::npos);
    CHECK(job.logs[r].find("WRONG") == std::string::npos);
  }
  REQUIRE(job.sent.size() == 2u);
  CHECK(job.sent[0] > 0);
  CHECK(job.sent[1] > 0);
}

TEST_CASE(
    "a link taken down mid-run ends every rank's allreduce at its deadline with an error naming "
    "the rank across it") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  auto job = run_job(2, "--rate 1gbit --timeout 50 --when 'allreduce 3 done' --do 'link-down 1'",
                     "link_fault 8", 2);
  INFO(all_logs(job));
  CHECK(job.status == 0);
  CHECK(job.output.find("link of host 1 down") != std::string::npos);
  for (int r = 0; r < 2; ++r) CHECK(job.logs[r].find("failed after") != std::string::npos);
}

TEST_CASE(
    "a host of four cut off for good: every rank's error blames the rank behind the cut link, "
    "never a healthy neighbour") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  // A ring 0 -> 1 -> 2 -> 3 -> 0 with host 3's link down: rank 0 waits for rank 3, but rank 1
  // waits for rank 0 and rank 2 for rank 1, both healthy and blocked behind the cut. Each rank
  // must blame rank 3, and rank 3 every other rank (its own link is the one down).
  const int hosts = 4;
  auto job =
      run_job(hosts, "--rate 1gbit --timeout 60 --when 'allreduce 3 done' --do 'link-down 3'",
              "link_fault 8", hosts);
  INFO(all_logs(job));
  CHECK(job.status == 0);
  CHECK(job.output.find("link of host 3 down") != std::string::npos);
  for (int r = 0; r < hosts; ++r) {
    CAPTURE(r);
    CHECK(job.logs[r].find("failed after") != std::string::npos);
    CHECK(job.logs[r].find(r == 3 ? "blames rank(s) 0, 1, 2\n" : "blames rank(s) 3\n") !=
          std::string::npos);
  }
}

TEST_CASE(
    "netbed --mtu sets both ends of every link, an allreduce across jumbo frames is right, and an "
    "MTU out of range is refused naming it") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  const std::string env = "NETBED_NAME=" + bed_name() + " ";
  // The bridge side of each link, seen from outside the hosts.
  auto up = troupe::test::run(env + kNetbed + " up 2 --mtu 9000");
  INFO(up.text);
  CHECK(up.status == 0);
  for (int h = 0; h < 2; ++h) {
    CAPTURE(h);
    auto mtu = troupe::test::run("cat /sys/class/net/troupe-" + bed_name() + "-v" +
                                 std::to_string(h) + "/mtu");
    CHECK(mtu.text == "9000\n");
  }
  troupe::test::run(env + kNetbed + " down");
  // The host side: each host reads its own interface's.
  char dir[] = "/tmp/netbed-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  auto inside = troupe::test::run(env + kNetbed + " job 2 --mtu 9000 --quiet --timeout 30 --logs " +
                                  dir + " -- sh -c 'echo mtu $(cat /sys/class/net/eth0/mtu)'");
  INFO(inside.text);
  CHECK(inside.status == 0);
  const auto logs = rank_logs(dir, 2);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(logs[static_cast<size_t>(r)] == "mtu 9000\n");
  }
  troupe::test::run(std::string("rm -rf ") + dir);
  const auto job = run_job(2, "--rate 1gbit --mtu 9000 --timeout 50", "network 8", 2);
  INFO(all_logs(job));
  CHECK(job.status == 0);
  CHECK(job.output.find("mtu 9000") != std::string::npos);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(job.logs[r].find("allreduce of 8 MiB correct") != std::string::npos);
    CHECK(job.logs[r].find("WRONG") == std::string::npos);
  }
  REQUIRE(job.sent.size() == 2u);
  const long long payload = 2LL * (2 - 1) * (8LL << 20) / 2;
  for (int h = 0; h < 2; ++h) CHECK(job.sent[h] >= payload);

  for (const char* bad : {"100", "70000", "jumbo"}) {
    CAPTURE(bad);
    auto refused = troupe::test::run(env + kNetbed + " up 1 --mtu " + bad);
    CHECK(refused.status != 0);
    CHECK(refused.text.find(std::string("--mtu '") + bad + "'") != std::string::npos);
    CHECK(refused.text.find("576..65535") != std::string::npos);
  }
}
