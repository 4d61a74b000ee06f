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
  std::string all;
};

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Two hosts, one launcher each (`netbed exec I`), the bed torn down after.
Job run_job(const std::string& launch_options, const std::string& faults, int until_world) {
  char dir[] = "/tmp/elastic-netbed-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string logs = dir, bed = bed_env() + kNetbed;
  std::string script = "set -u; " + bed + " up 2 --rate 1gbit >/dev/null || exit 3; trap '" + bed +
                       " down >/dev/null' EXIT; " + bed + " bytes >" + logs + "/before; ";
  for (int node = 0; node < 2; ++node) {
    script += "( " + bed + " exec " + std::to_string(node) + " -- env TROUPE_FAULT='" + faults +
              "' OMP_NUM_THREADS=1 TROUPE_JOB_SECRET=elastic-netbed-test-secret-0123456789 " +
              TROUPE_BIN + " launch --elastic --nnodes 2 --node-rank " + std::to_string(node) +
              " -n 2 --master-addr " + kSubnet + ".1 --master-port 29561 --min-ranks 2 " +
              "--membership-timeout 20 --timeout 120 " + launch_options + " -- " +
              TROUPE_ELASTIC_RANK_BIN + " 40 " + std::to_string(until_world) +
              " allreduce >" + logs + "/node" + std::to_string(node) + " 2>&1; echo $? >" + logs +
              "/status" + std::to_string(node) + " ) & ";
  }
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
  troupe::test::run("rm -rf " + logs);
  return job;
}

}  // namespace

TEST_CASE("an elastic job across two netbed hosts goes on without a rank killed on host 1, identical to the reference") {
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

TEST_CASE("a rank killed on netbed host 1 of an elastic job is restarted there and heals, and the replicas are identical") {
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
