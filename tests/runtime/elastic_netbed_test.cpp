// Elastic jobs across two emulated hosts of the network test bed (scripts/netbed: a network
// namespace, host name, /dev/shm and PID space per host): one `troupe launch --elastic --nnodes
// 2` per host, node 0's launcher serving the membership at its address, two
// troupe_elastic_rank ranks per host. A rank of host 1 is killed: the others finish
// bit-identical and equal to one process on the same global batches, with or without it coming
// back. Needs root, ip, tc and unshare; elsewhere every case reports itself skipped.
#include <unistd.h>

#include <doctest/doctest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "tests/support/command.h"
#include "tests/support/skip.h"

namespace {

const std::string kNetbed = std::string(TROUPE_SOURCE_DIR) + "/scripts/netbed";
// A subnet and bed names of their own ("e" and this process's id; netbed_test.cpp's are "t..."),
// so that these cases and the other netbed tests can run side by side.
const std::string kSubnet = "10.87.0";

std::string bed_env() {
  return "NETBED_NAME=e" + std::to_string(getpid() % 1000) + " NETBED_SUBNET=" + kSubnet + " ";
}

std::string netbed_unavailable() {
  if (geteuid() != 0) return "not root (network namespaces need CAP_NET_ADMIN)";
  for (const char* tool : {"ip", "tc", "unshare", "nsenter"})
    if (troupe::test::run(std::string("command -v ") + tool).status != 0)
      return std::string("no '") + tool + "' on PATH";
  auto up = troupe::test::run(bed_env() + kNetbed + " up 1");
  troupe::test::run(bed_env() + kNetbed + " down");
  if (up.status != 0) return "scripts/netbed cannot make a namespace here: " + up.text;
  return "";
}

struct Job {
  std::string node[2];  // what each host's launcher and its ranks printed
  int status[2] = {-1, -1};
  long long host1_sent = -1;  // bytes out of host 1 over its link during the job
  long long cut_ms = -1;      // when host 1's link went down (unix ms), with `cut_link`
  std::string all;
};

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Two hosts, one launcher each (`netbed exec I`), the bed torn down after. With `cut_link`,
// slot 0 (host 0) holds before step 10 (TROUPE_TEST_HOLD, elastic_rank.cpp) until host 1's link
// has been taken down for good, so that the cut comes mid-run whatever the machine's speed.
Job run_job(const std::string& launch_options, const std::string& faults, int until_world,
            bool cut_link = false) {
  char dir[] = "/tmp/elastic-netbed-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string logs = dir, bed = bed_env() + kNetbed;
  std::string script = "set -u; " + bed + " up 2 --rate 1gbit >/dev/null || exit 3; trap '" + bed +
                       " down >/dev/null' EXIT; " + bed + " bytes >" + logs + "/before; ";
  for (int node = 0; node < 2; ++node) {
    script += "( " + bed + " exec " + std::to_string(node) + " -- env TROUPE_FAULT='" + faults +
              "' " + (cut_link ? "TROUPE_TEST_HOLD=0:10:" + logs + "/go " : "") +
              "OMP_NUM_THREADS=1 TROUPE_JOB_SECRET=elastic-netbed-test-secret-0123456789 " +
              TROUPE_BIN + " launch --elastic --nnodes 2 --node-rank " + std::to_string(node) +
              " -n 2 --master-addr " + kSubnet + ".1 --master-port 29561 --min-ranks 2 " +
              "--membership-timeout 20 --timeout 120 " + launch_options + " -- " +
              TROUPE_ELASTIC_RANK_BIN + " 40 " + std::to_string(until_world) + " allreduce >" +
              logs + "/node" + std::to_string(node) + " 2>&1; echo $? >" + logs + "/status" +
              std::to_string(node) + " ) & ";
  }
  if (cut_link)
    // Watches node 0's log (at most 120 s) for slot 0's hold, cuts, and lets slot 0 go on.
    script += "for i in $(seq 1200); do grep -q 'holds before step' " + logs +
              "/node0 2>/dev/null && break; sleep 0.1; done; " + bed + " link-down 1 >" + logs +
              "/cut 2>&1; date +%s%3N >" + logs + "/cut_ms; touch " + logs + "/go; ";
  script += "wait; " + bed + " bytes >" + logs + "/after";
  {
    std::ofstream file(logs + "/job.sh");
    file << script << "\n";
  }
  auto out = troupe::test::run("timeout 200 bash " + logs + "/job.sh");
  Job job;
  job.all = out.text;
  for (int node = 0; node < 2; ++node) {
    std::ifstream in(logs + "/node" + std::to_string(node));
    std::ostringstream text;
    text << in.rdbuf();
    job.node[node] = text.str();
    std::ifstream status(logs + "/status" + std::to_string(node));
    status >> job.status[node];
    job.all += "\n--- node " + std::to_string(node) + "\n" + job.node[node];
  }
  std::regex line(R"(host 1 veth \S+ sent_bytes (\d+) received_bytes (\d+))");
  long long before = -1, after = -1;
  for (const char* name : {"before", "after"}) {
    std::ifstream in(logs + "/" + name);
    for (std::string text; std::getline(in, text);) {
      std::smatch m;
      if (std::regex_match(text, m, line)) (name[0] == 'b' ? before : after) = std::stoll(m[1]);
    }
  }
  if (before >= 0 && after >= 0) job.host1_sent = after - before;
  std::ifstream cut(logs + "/cut_ms");
  cut >> job.cut_ms;
  troupe::test::run("rm -rf " + logs);
  return job;
}

}  // namespace

TEST_CASE(
    "an elastic job across two netbed hosts goes on without a rank killed on host 1, identical to "
    "the reference") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  Job job = run_job("", "kill:rank=3,step=10", 0);
  INFO(job.all);
  CHECK(job.status[0] == 0);
  CHECK(job.status[1] == 0);
  const std::string out = job.node[0] + job.node[1];
  CHECK(count(out, " finished ") == 3);
  CHECK(count(out, "of 3 in generation") == 3);
  CHECK(count(out, "replicas identical") == 3);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(job.node[1].find("kills itself at step 10") != std::string::npos);
  CHECK(job.node[0].find("generation 2 in force") != std::string::npos);
  // The ranks are on two hosts (their own host names), and what they exchanged crossed host 1's
  // link: gradients of 40 steps of a 676-parameter model, at least.
  CHECK(job.node[1].find("on troupe-e") != std::string::npos);
  CHECK(job.node[1].find("-h1 reaches") != std::string::npos);
  CHECK(job.host1_sent > 40 * 676 * 4);
}

TEST_CASE(
    "a rank killed on netbed host 1 of an elastic job is restarted there and heals, and the "
    "replicas are identical") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  Job job = run_job("--max-restarts 1", "kill:rank=3,step=10", 4);
  INFO(job.all);
  CHECK(job.status[0] == 0);
  CHECK(job.status[1] == 0);
  const std::string out = job.node[0] + job.node[1];
  CHECK(count(out, " finished ") == 4);
  CHECK(count(out, "of 4 in generation") == 4);
  CHECK(count(out, "replicas identical") == 4);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(job.node[1].find("restarting rank slot 3 (restart 1 of 1") != std::string::npos);
  CHECK(job.node[1].find("slot 3 healed, stepping from step") != std::string::npos);
}

TEST_CASE(
    "host 1's link cut for good mid-run: node 0's ranks form a new generation and finish within "
    "twice the membership deadline, identical to the reference") {
  if (auto why = netbed_unavailable(); !why.empty()) {
    troupe::test::skip_case("no network test bed: " + why);
    return;
  }
  // Slots 2 and 3 run on host 1. Once its link is down nothing of theirs arrives: node 0's hub
  // loses host 1's launcher when its heartbeats stop (--membership-timeout 20: a third of it),
  // the survivors' collectives end, and slots 0 and 1 go on as a world of 2 from their last
  // step. From the cut to their first step in the new generation must take at most 2 x 20 s.
  Job job = run_job("", "", 0, true);
  INFO(job.all);
  CHECK(job.status[0] == 0);
  REQUIRE(job.cut_ms > 0);
  CHECK(job.node[0].find("slot 0 holds before step 10") != std::string::npos);
  const std::string& out = job.node[0];
  CHECK(count(out, " finished ") == 2);
  CHECK(count(out, "of 2 in generation 2") == 2);
  CHECK(count(out, "replicas identical") == 2);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(out.find("generation 2 in force") != std::string::npos);
  // Each survivor's first step in generation 2, against the cut.
  const std::string again = "stepping again in generation 2 at unix ms ";
  size_t survivors = 0;
  for (size_t at = out.find(again); at != std::string::npos; at = out.find(again, at + 1)) {
    const long long ms = std::stoll(out.substr(at + again.size())) - job.cut_ms;
    MESSAGE("a survivor's first step in generation 2 came " << ms << " ms after the cut");
    CHECK(ms > 0);
    CHECK(ms <= 2 * 20000);
    ++survivors;
  }
  CHECK(survivors == 2);
  // Host 1's launcher ends too (it lost node 0), within the script's deadline.
  CHECK(job.status[1] >= 0);
}
