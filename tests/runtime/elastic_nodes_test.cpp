// Elastic jobs of several nodes on this host: one `troupe launch --elastic --nnodes 2` per node
// (launch() on a thread each, or the troupe tool for a launcher that is killed), node 0's
// launcher serving the membership at the master address and node 1's relaying its ranks to it
// (elastic/membership_link.h); and what a node that cannot reach, or is refused by, the service
// is told. Across real (emulated) hosts: elastic_netbed_test.cpp.
#include <poll.h>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <sstream>
#include <string>
#include <thread>

#include "comm/status.h"
#include "elastic/launch.h"
#include "elastic/membership.h"
#include "elastic/membership_link.h"
#include "tests/support/command.h"

using namespace troupe;

namespace {

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

struct Node {
  LaunchResult result;
  std::string out, err, error;
};

LaunchOptions node_options(int node_rank, int port, int max_restarts) {
  LaunchOptions o;
  o.nnodes = 2;
  o.node_rank = node_rank;
  o.nprocs = 2;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.elastic = true;
  o.min_ranks = 2;
  o.max_restarts = max_restarts;
  o.membership_timeout_sec = 20;
  o.timeout_sec = 150;
  o.grace_sec = 2;
  return o;
}

Node run_node(LaunchOptions o) {
  Node node;
  std::ostringstream out, err;
  try {
    node.result = launch(o, out, err);
  } catch (const std::exception& e) {
    node.error = e.what();
  }
  node.out = out.str();
  node.err = err.str();
  return node;
}

/// Two nodes of two ranks (and `spares` spares each) of troupe_elastic_rank (40 steps; on until
/// the world is `until_world`).
std::pair<Node, Node> run_two_nodes(int max_restarts, const std::string& faults, int until_world,
                                    int spares = 0) {
  const int port = pick_free_port();
  std::vector<std::string> command = {TROUPE_ELASTIC_RANK_BIN, "40", std::to_string(until_world),
                                      "allreduce"};
  std::vector<std::pair<std::string, std::string>> env = {
      {"TROUPE_FAULT", faults},
      {"OMP_NUM_THREADS", "1"},
      {"TROUPE_JOB_SECRET", "elastic-nodes-test-secret-0123456789"}};
  LaunchOptions o0 = node_options(0, port, max_restarts), o1 = node_options(1, port, max_restarts);
  o0.spares = o1.spares = spares;
  o0.command = o1.command = command;
  o0.extra_env = o1.extra_env = env;
  auto first = std::async(std::launch::async, run_node, o0);
  auto second = std::async(std::launch::async, run_node, o1);
  return {first.get(), second.get()};
}

std::string describe(const Node& n) {
  return "error: " + n.error + "\nmessage: " + n.result.message + "\nstdout:\n" + n.out +
         "\nstderr:\n" + n.err;
}

}  // namespace

TEST_CASE(
    "an elastic job of two nodes goes on without a rank killed on node 1, identical to the "
    "reference") {
  const auto nodes = run_two_nodes(0, "kill:rank=3,step=10", 0);
  const Node& node0 = nodes.first;
  const Node& node1 = nodes.second;
  INFO("node 0:\n" << describe(node0) << "\nnode 1:\n" << describe(node1));
  CHECK(node0.error.empty());
  CHECK(node1.error.empty());
  CHECK(node0.result.exit_code == 0);
  CHECK(node1.result.exit_code == 0);
  const std::string out = node0.out + node1.out;
  // Slots 0 and 1 on node 0, slot 2 on node 1 finish in a world of 3, bit-identical and equal to
  // one process trained on the same global batches (troupe_elastic_rank checks both).
  CHECK(count(out, " finished ") == 3);
  CHECK(count(out, "of 3 in generation") == 3);
  CHECK(count(out, "replicas identical") == 3);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(node1.err.find("kills itself at step 10") != std::string::npos);
  CHECK(node0.err.find("connected") != std::string::npos);
  CHECK(node0.err.find("generation 2 in force") != std::string::npos);
  CHECK(node0.result.message.find("3 of 4 rank slots finished") != std::string::npos);
}

TEST_CASE(
    "a rank killed on node 1 of an elastic job is restarted there and heals, and the replicas are "
    "identical") {
  const auto nodes = run_two_nodes(1, "kill:rank=3,step=10", 4);
  const Node& node0 = nodes.first;
  const Node& node1 = nodes.second;
  INFO("node 0:\n" << describe(node0) << "\nnode 1:\n" << describe(node1));
  CHECK(node0.result.exit_code == 0);
  CHECK(node1.result.exit_code == 0);
  const std::string out = node0.out + node1.out;
  CHECK(count(out, " finished ") == 4);
  CHECK(count(out, "of 4 in generation") == 4);
  CHECK(count(out, "replicas identical") == 4);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(node1.err.find("restarting rank slot 3 (restart 1 of 1") != std::string::npos);
  CHECK(out.find("slot 3 healed, stepping from step") != std::string::npos);
}

TEST_CASE(
    "a rank killed on node 1 is replaced at once by node 1's spare, which heals, and the replicas "
    "are identical") {
  // Slots: ranks 0, 1 (node 0) and 2, 3 (node 1); spares 4 (node 0) and 5 (node 1). Slot 3 dies
  // at step 10: generation 2 takes node 1's spare (slot 5), not the lower slot 4 of node 0, and
  // node 1's launcher starts a new spare in slot 3 (its own restart); at the end each launcher
  // stops its waiting spare (node 0 tells node 1 when no rank of the job runs).
  const auto nodes = run_two_nodes(1, "kill:rank=3,step=10", 4, 1);
  const Node& node0 = nodes.first;
  const Node& node1 = nodes.second;
  INFO("node 0:\n" << describe(node0) << "\nnode 1:\n" << describe(node1));
  CHECK(node0.error.empty());
  CHECK(node1.error.empty());
  CHECK(node0.result.exit_code == 0);
  CHECK(node1.result.exit_code == 0);
  const std::string out = node0.out + node1.out;
  CHECK(count(out, " finished ") == 4);
  CHECK(count(out, "of 4 in generation 2") == 4);
  CHECK(count(out, "replicas identical") == 4);
  CHECK(out.find("DIFFER") == std::string::npos);
  CHECK(node0.err.find("spare slot 5 joins generation 2 (node 1)") != std::string::npos);
  CHECK(node1.out.find("slot 5 healed, stepping from step") != std::string::npos);
  CHECK(node1.err.find("restarting rank slot 3 (restart 1 of 1; this slot's 1) as a spare") !=
        std::string::npos);
  CHECK(node0.err.find("restarting") == std::string::npos);
  CHECK(node0.err.find("stopping the waiting spare in slot 4") != std::string::npos);
  CHECK(node1.err.find("stopping the waiting spare in slot 3") != std::string::npos);
  CHECK(node0.result.message.find("4 of 4 rank slots finished") != std::string::npos);
  CHECK(node1.result.message.find("1 waiting spares stopped") != std::string::npos);
}

TEST_CASE(
    "an elastic node that cannot reach node 0's membership service fails at its deadline naming "
    "the address") {
  LaunchOptions o = node_options(1, pick_free_port(), 0);  // nothing listens there
  o.membership_timeout_sec = 1;
  o.command = {"/bin/true"};
  const auto start = std::chrono::steady_clock::now();
  const Node node = run_node(o);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(describe(node));
  CHECK(node.error.find("node 1 cannot reach the elastic membership service at 127.0.0.1:" +
                        std::to_string(o.master_port)) != std::string::npos);
  CHECK(node.error.find("within 1000 ms") != std::string::npos);
  CHECK(node.error.find("--node-rank 0") != std::string::npos);
  CHECK(took < 5);
}

TEST_CASE("the elastic membership service refuses a node of another shape, naming both") {
  elastic::MembershipServer server(4, 2, std::chrono::seconds(5), std::cerr, 4);
  const int port = pick_free_port();
  std::ostringstream log;
  elastic::MembershipHub hub(server, {2, 2, 0}, "127.0.0.1", port, "", log);
  std::atomic<bool> done{false};
  std::thread serve([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done && std::chrono::steady_clock::now() < until) {
      std::vector<pollfd> fds;
      std::vector<int> tags;
      hub.add_poll_fds(fds, tags);
      poll(fds.data(), fds.size(), 50);
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents) hub.on_ready(tags[i], fds[i].revents);
    }
  });
  auto refused = [&](elastic::NodeShape shape) -> std::string {
    try {
      elastic::MembershipRelay relay(shape, "127.0.0.1", port, "", std::chrono::seconds(5));
    } catch (const comm::Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string wrong_n = refused({2, 3, 1});
  const std::string wrong_rank = refused({2, 2, 0});
  done = true;
  serve.join();
  CHECK(wrong_n.find("refused this node: node 1 was launched with --nnodes 2 -n 3 (expected "
                     "--nnodes 2 -n 2, as node 0 was)") != std::string::npos);
  CHECK(wrong_rank.find("--node-rank 0 (expected 1..1: node 0 hosts the service)") !=
        std::string::npos);
}

TEST_CASE(
    "an elastic node's launcher and ranks end with an error naming the service when node 0's "
    "launcher dies") {
  const int port = pick_free_port();
  char dir[] = "/tmp/elastic-nodes-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string logs = dir;
  const std::string common = std::string(
                                 " --elastic --nnodes 2 -n 2 --min-ranks 2 --master-addr "
                                 "127.0.0.1 --master-port ") +
                             std::to_string(port) + " --membership-timeout 20 --timeout 120 -- " +
                             TROUPE_ELASTIC_RANK_BIN + " 20000 0 allreduce";
  // Node 0's launcher is SIGKILLed once its first generation is in force (polled with a
  // deadline); node 1's must then end by itself, with the error.
  const std::string script =
      "export OMP_NUM_THREADS=1; "
      "" TROUPE_BIN " launch --node-rank 0" +
      common + " >" + logs +
      "/n0 2>&1 & p0=$!; "
      "" TROUPE_BIN " launch --node-rank 1" +
      common + " >" + logs +
      "/n1 2>&1 & p1=$!; "
      "for i in $(seq 600); do grep -q \"generation 1 in force\" " +
      logs +
      "/n0 && break; "
      "sleep 0.1; done; kill -9 $p0; wait $p1; echo node1 status $?; cat " +
      logs + "/n1";
  const auto start = std::chrono::steady_clock::now();
  auto out = test::run("timeout 100 bash -c '" + script + "'");
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  test::run("rm -rf " + logs);
  INFO(out.text);
  CHECK(out.text.find("node1 status 1") != std::string::npos);
  CHECK(out.text.find("lost the elastic membership service at 127.0.0.1:" + std::to_string(port) +
                      " (node 0's launcher)") != std::string::npos);
  CHECK(took < 60);
}
