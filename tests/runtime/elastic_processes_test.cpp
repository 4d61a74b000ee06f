// Elastic jobs between real processes: `troupe launch --elastic` (troupe::launch) of
// troupe_elastic_rank with faults injected by TROUPE_FAULT. Each rank trains a small MLP for 40
// steps (on, in the restart cases, until the restarted rank is back) and checks, at the end, that
// every member holds bit-identical parameters and that they match one process trained on the same
// global batches (tests/runtime/elastic_rank.cpp); these tests check which ranks finished, in which
// world, and what the launcher reported.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "elastic/launch.h"
#include "tests/support/elastic_launch.h"

using namespace troupe;

namespace {

using Run = test::ElasticRun;

Run run_elastic(int ranks, int min_ranks, int max_restarts, const std::string& faults,
                int until_world = 0, const std::string& algorithm = "allreduce", int spares = 0) {
  return test::launch_elastic_job(
      {TROUPE_ELASTIC_RANK_BIN, "40", std::to_string(until_world), algorithm}, ranks, min_ranks,
      max_restarts, faults, spares);
}

/// Every finisher's line says the replicas (`what`) were identical and matched the reference.
void check_finished(const Run& run, int finishers, int world,
                    const std::string& what = "replicas") {
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err << "\nlaunch: " << run.result.message);
  CHECK(run.result.exit_code == 0);
  CHECK(run.count(" finished ") == static_cast<size_t>(finishers));
  CHECK(run.count("of " + std::to_string(world) + " in generation") ==
        static_cast<size_t>(finishers));
  CHECK(run.count(what + " identical") == static_cast<size_t>(finishers));
  CHECK(run.out.find("DIFFER") == std::string::npos);
}

/// The hashes of the shared algorithm state the ranks printed, by step ("slot S shared state at
/// step N: H").
std::map<long, std::set<std::string>> shared_hashes(const Run& run) {
  std::map<long, std::set<std::string>> by_step;
  const std::string key = " shared state at step ";
  for (size_t at = run.out.find(key); at != std::string::npos; at = run.out.find(key, at + 1)) {
    const size_t colon = run.out.find(": ", at);
    const size_t end = run.out.find('\n', colon);
    by_step[std::stol(run.out.substr(at + key.size(), colon - at - key.size()))].insert(
        run.out.substr(colon + 2, end - colon - 2));
  }
  return by_step;
}

}  // namespace

TEST_CASE("an elastic job goes on without a rank killed during backward") {
  auto run = run_elastic(3, 2, 0, "kill:rank=1,step=10");
  check_finished(run, 2, 2);
  CHECK(run.err.find("kills itself at step 10 (backward)") != std::string::npos);
  CHECK(run.err.find("generation 2 in force") != std::string::npos);
  CHECK(run.out.find("stepping again in generation 2") != std::string::npos);
}

TEST_CASE(
    "a member stopped with SIGSTOP is dropped within twice the membership deadline, and the rest "
    "finish") {
  // Slot 2 stops itself before step 10 and never runs again. The survivors' collectives fail at
  // their deadline (20 s, elastic_rank.cpp), they join generation 2, which waits its deadline
  // (--membership-timeout 20) for slot 2 and forms without it. The survivors' wait for their
  // assignment is derived from that deadline (before, both were 20 s, and they gave up just as
  // the generation formed); once they finish, the launcher ends the stopped process instead of
  // waiting for it.
  auto run = test::launch_elastic_job({TROUPE_ELASTIC_RANK_BIN, "40", "0", "allreduce"}, 3, 2, 0,
                                      "", 0, {{"TROUPE_TEST_STOP", "2:10"}});
  check_finished(run, 2, 2);
  CHECK(run.out.find("slot 2 stops itself (SIGSTOP) before step 10") != std::string::npos);
  CHECK(run.err.find("rank slot 2 did not join generation 2 within 20000 ms") != std::string::npos);
  CHECK(run.err.find("the job is over: stopping rank slot 2") != std::string::npos);
  const std::string formed = "generation 2 in force after ";
  const size_t at = run.err.find(formed);
  REQUIRE(at != std::string::npos);
  const long ms = std::stol(run.err.substr(at + formed.size()));
  CHECK(ms <= 2 * 20000);
}

TEST_CASE("an elastic job goes on without a rank killed during the reduction") {
  auto run = run_elastic(3, 2, 0, "kill:rank=2,step=10,phase=reduce");
  check_finished(run, 2, 2);
  CHECK(run.err.find("kills itself at step 10 (reduce)") != std::string::npos);
}

TEST_CASE("an elastic job goes on without a rank killed during the optimizer step") {
  auto run = run_elastic(3, 2, 0, "kill:rank=0,step=10,phase=optimizer");
  check_finished(run, 2, 2);
  CHECK(run.err.find("kills itself at step 10 (optimizer)") != std::string::npos);
}

TEST_CASE("an elastic job forms without a rank killed during rendezvous, and during a re-form") {
  // Slot 3 dies before the first generation; slot 1 dies at step 8, and slot 2 while the
  // survivors re-form after it.
  auto run = run_elastic(4, 1, 0,
                         "kill:rank=3,step=0,phase=rendezvous;kill:rank=1,step=8;"
                         "kill:rank=2,step=8,phase=rendezvous");
  check_finished(run, 1, 1);
  CHECK(run.err.find("kills itself at step 0 (rendezvous)") != std::string::npos);
  CHECK(run.err.find("kills itself at step 8 (rendezvous)") != std::string::npos);
}

TEST_CASE("an elastic job survives two kills in a row") {
  auto run = run_elastic(4, 2, 0, "kill:rank=1,step=8;kill:rank=3,step=20,phase=reduce");
  check_finished(run, 2, 2);
  CHECK(run.err.find("generation 3 in force") != std::string::npos);
}

TEST_CASE("a killed rank is restarted, heals from a live peer, and the replicas are identical") {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3);
  check_finished(run, 3, 3);
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1") != std::string::npos);
  CHECK(run.out.find("slot 2 healed, stepping from step") != std::string::npos);
}

TEST_CASE("a rank killed while it heals is restarted again, and the job still ends identical") {
  auto run = run_elastic(3, 2, 2, "kill:rank=2,step=6;kill:rank=2,step=any,phase=heal,life=1", 3);
  check_finished(run, 3, 3);
  CHECK(run.err.find("(heal)") != std::string::npos);
  CHECK(run.err.find("restart 2 of 2") != std::string::npos);
}

TEST_CASE("survivors below --min-ranks stop with an error naming the generation and min-ranks") {
  auto run = run_elastic(3, 3, 0, "kill:rank=1,step=5");
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err);
  CHECK(run.result.exit_code != 0);
  CHECK(run.result.message.find("generation 2 has no quorum") != std::string::npos);
  CHECK(run.result.message.find("--min-ranks 3") != std::string::npos);
  CHECK(run.err.find("the job stops: generation 2 has no quorum: ranks (launch slots) 0, 2 "
                     "reported") != std::string::npos);
  CHECK(run.out.find("finished") == std::string::npos);
}

TEST_CASE("survivors keep their top-k error feedback and momentum correction across a re-form") {
  // Slot 1 dies in backward at step 10, after the survivors' buckets folded step 10's gradient
  // into their memories: each survivor must go on with its memory of the end of step 9.
  auto run = run_elastic(3, 2, 0, "kill:rank=1,step=10", 0, "topk");
  check_finished(run, 2, 2);
  CHECK(run.count("algorithm state after re-form: kept") == 2);
  CHECK(run.count("algorithm state after re-form: LOST") == 0);
}

TEST_CASE("a healed rank starts with zero error feedback and the peers' PowerSGD Qs") {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, "powersgd");
  check_finished(run, 3, 3);
  CHECK(run.count("slot 2 residual after heal: zero") == 1);
  CHECK(run.count("residual after heal: NONZERO") == 0);
  CHECK(run.count("algorithm state after re-form: LOST") == 0);
  // Every member printed its shared state after each change and at the end; at each step all
  // the hashes agree.
  const auto by_step = shared_hashes(run);
  CHECK(by_step.size() >= 2);
  for (const auto& entry : by_step) {
    INFO("step " << entry.first);
    CHECK(entry.second.size() == 1);
  }
}

TEST_CASE("a spare takes a killed rank's place at once, heals, and the replicas are identical") {
  // Slot 3 is a spare, waiting past its start-up. Slot 2 dies at step 10: generation 2 takes the
  // spare beside the survivors, and the launcher starts a new spare in slot 2, which no
  // generation needs and which is stopped at the end.
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, "allreduce", 1);
  check_finished(run, 3, 3);
  CHECK(run.err.find("spare slot 3 joins generation 2") != std::string::npos);
  CHECK(run.out.find("slot 3 healed, stepping from step") != std::string::npos);
  CHECK(run.out.find("slot 2 healed") == std::string::npos);
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1; this slot's 1) as a spare") !=
        std::string::npos);
  CHECK(run.err.find("stopping the waiting spare in slot 2") != std::string::npos);
  size_t stops = 0;  // said once, not at every turn of the launcher's loop until it is reaped
  for (size_t at = run.err.find("stopping the waiting spare"); at != std::string::npos;
       at = run.err.find("stopping the waiting spare", at + 1))
    ++stops;
  CHECK(stops == 1);
  CHECK(run.result.message.find("1 waiting spares stopped") != std::string::npos);
}

TEST_CASE("a spare heals with zero error feedback and the peers' PowerSGD Qs") {
  auto run = run_elastic(3, 2, 0, "kill:rank=1,step=10", 3, "powersgd", 1);
  check_finished(run, 3, 3);
  CHECK(run.count("slot 3 residual after heal: zero") == 1);
  CHECK(run.count("residual after heal: NONZERO") == 0);
  CHECK(run.count("algorithm state after re-form: LOST") == 0);
  for (const auto& entry : shared_hashes(run)) {
    INFO("step " << entry.first);
    CHECK(entry.second.size() == 1);
  }
}

// DiLoCo (h = 4): a re-form goes back to the last completed outer sync. Each survivor compares
// its parameters with a one-process reference of 3 ranks to that sync and 2 from there
// (tests/runtime/elastic_rank.cpp), so a survivor that went on from its live state, or lost its
// own inner optimizer, exits 3.
TEST_CASE("an elastic DiLoCo job killed in an inner step goes on from its last outer sync") {
  auto run = run_elastic(3, 2, 0, "kill:rank=2,step=10", 0, "diloco");
  check_finished(run, 2, 2);
  CHECK(run.err.find("kills itself at step 10 (backward)") != std::string::npos);
  CHECK(run.count("finished 40 steps of diloco(h=4, outer_lr=0.5, outer_momentum=0.5") == 2);
  CHECK(run.count("to step 8, world 2") == 2);  // the sync after step 8, not the kill's step
  CHECK(run.count("recovery: generation 2, world 2, from step 8") == 2);
  CHECK(run.count("max |param - reference| = ") == 2);
}

TEST_CASE("an elastic DiLoCo job killed during its outer sync goes on from the sync before") {
  // Step 11 ends the third inner run: slot 2 dies as the survivors wait in its reduction.
  auto run = run_elastic(3, 2, 0, "kill:rank=2,step=11,phase=reduce", 0, "diloco");
  check_finished(run, 2, 2);
  CHECK(run.err.find("kills itself at step 11 (reduce)") != std::string::npos);
  CHECK(run.count("rolled back from step 11 to step 8, world 2") == 2);
  CHECK(run.count("recovery: generation 2, world 2, from step 8") == 2);
  CHECK(run.count("max |param - reference| = ") == 2);
}

TEST_CASE("a killed DiLoCo rank is restarted, heals at an outer sync, and ends identical") {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, "diloco");
  check_finished(run, 3, 3);
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1") != std::string::npos);
  CHECK(run.out.find("slot 2 healed, stepping from step") != std::string::npos);
  // The survivors went to a world of 2 and back to 3, each time from an outer sync, and still
  // match the reference (the rejoined rank took the source's replica), also when the rejoin
  // caught a survivor in an outer sync that completed on the other only: that one lands the sync
  // from the source's global weights and keeps its own inner optimizer.
  CHECK(run.count("max |param - reference| = ") == 2);
  CHECK(run.count("reference not compared (this rank joined late)") == 1);
}

namespace {

// Streaming DiLoCo variants of the rank program (h = 4, 2 fragments, delay 2), killed in inner
// step 7 (before fragment 1's start after step 8): each of the 2 survivors goes back to where a
// fragment last landed and matches the reference. `variant_line` is what every member prints of
// the variant's set-up ("" to skip).
void check_streaming_kill(const char* algorithm, const std::string& variant_line) {
  auto run = run_elastic(3, 2, 0, "kill:rank=2,step=7", 0, algorithm);
  check_finished(run, 2, 2, "global weights");
  CHECK(run.err.find("kills itself at step 7 (backward)") != std::string::npos);
  CHECK(run.count("finished 40 steps of streaming_diloco(h=4, fragments=2, delay=2") == 2);
  if (!variant_line.empty()) CHECK(run.count(variant_line) == 2);
  CHECK(run.count("recovery: generation 2, world 2, from step 8") +
            run.count("recovery: generation 2, world 2, from step 6") ==
        2);
  CHECK(run.count("max |param - reference| = ") == 2);
}

// The same variants killed in step 10 and restarted: all 3 finish, the restarted rank heals from
// a survivor, and the survivors match the reference (the rejoined rank joined late: not compared).
void check_streaming_restart(const char* algorithm, const std::string& variant_line) {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, algorithm);
  check_finished(run, 3, 3, "global weights");
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1") != std::string::npos);
  CHECK(run.out.find("slot 2 healed, stepping from step") != std::string::npos);
  if (!variant_line.empty()) CHECK(run.count(variant_line) == 3);
  CHECK(run.count("max |param - reference| = ") == 2);
  CHECK(run.count("reference not compared (this rank joined late)") == 1);
}

}  // namespace

// Streaming DiLoCo (h = 4, 2 fragments, delay 2, alpha 0.5): a re-form goes back to where a
// fragment last landed (after an even step), each survivor to its own weights and inner
// optimizer of then; the fragment due there starts again in the new world. The replicas differ
// (each merges its own), so each survivor compares every member's weights with the reference's
// replicas, and the members' global weights must agree.
TEST_CASE(
    "an elastic Streaming DiLoCo job killed in an inner step goes on from its last landed "
    "fragment") {
  // Slot 2 dies in inner step 8, after it started fragment 0's reduction (after step 6) and
  // before it starts fragment 1's (after step 8), which therefore fails on the others: they go
  // back to where fragment 0 landed, after step 8, and start fragment 1 there again; or, when
  // the death reached them before fragment 0's reduction ended, to where fragment 1 landed after
  // step 6, starting fragment 0 again (seen in both ways). The reference follows either.
  check_streaming_kill("streaming-diloco", "");
}

TEST_CASE(
    "a killed Streaming DiLoCo rank is restarted, takes the source's weights, and the job "
    "matches the reference") {
  check_streaming_restart("streaming-diloco", "");
}

// With eager updates the landing point also holds each rank's others' average (its own: a
// survivor goes back to it) and each fragment's last average and its world (shared: a restarted
// rank takes the average as the others'); the reference models both
// (tests/support/elastic_reference.h, itself checked against non-elastic runs by
// tests/runtime/elastic_reference_test.cpp).
TEST_CASE(
    "an elastic Streaming DiLoCo job with eager updates killed in an inner step goes on "
    "from its last landed fragment") {
  check_streaming_kill("streaming-diloco-eager", ", allreduce, eager) as rank");
}

// The rejoin often catches one survivor behind the other (its fragment's reduction failed where
// the other's completed: "rolled back from step N to step N + 1"), which then lands that
// fragment from its own provisional step (seen in 5 of 6 runs here; the reference holds either
// way, and land_missed_sync_test checks that landing deterministically).
TEST_CASE(
    "a killed Streaming DiLoCo rank with eager updates is restarted, takes the source's "
    "weights and the last averages, and the job matches the reference") {
  check_streaming_restart("streaming-diloco-eager", ", allreduce, eager) as rank");
}

// A top-k outer reduction (a quarter of each fragment, exact values, through an allgather) with
// error feedback: each survivor goes back to its residuals of the landing point, a restarted
// rank starts with zero ones, and the reference computes the same top-k sums in rank order.
TEST_CASE(
    "a killed Streaming DiLoCo rank with a top-k outer reduction is restarted with zero "
    "residuals and the job matches the reference") {
  check_streaming_restart("streaming-diloco-topk", ", top-k(0.25)+ef) as rank");
}

// SparseLoCo (h = 4, top quarter of each chunk, exact values): each survivor goes back to its
// error-feedback memory of the last sync, a restarted rank starts from zero memory; the reference
// models both.
TEST_CASE("an elastic SparseLoCo job killed in an inner step goes on from its last outer sync") {
  auto run = run_elastic(3, 2, 0, "kill:rank=2,step=10", 0, "sparseloco");
  check_finished(run, 2, 2);
  CHECK(run.count("finished 40 steps of sparseloco(h=4") == 2);
  CHECK(run.count("recovery: generation 2, world 2, from step 8") == 2);
  CHECK(run.count("max |param - reference| = ") == 2);
}

TEST_CASE(
    "a killed SparseLoCo rank is restarted with zero memory and the job matches the "
    "reference") {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, "sparseloco");
  check_finished(run, 3, 3);
  CHECK(run.out.find("slot 2 healed, stepping from step") != std::string::npos);
  CHECK(run.count("max |param - reference| = ") == 2);
  CHECK(run.count("reference not compared (this rank joined late)") == 1);
}

// DiLoCo with a compressed outer reduction that keeps a residual (top-k 10% with error
// feedback): the residual is each rank's own, kept by a survivor and zero on a restarted rank.
TEST_CASE(
    "an elastic DiLoCo job with a top-k outer reduction keeps each survivor's residual and "
    "starts a restarted rank's at zero") {
  auto run = run_elastic(3, 2, 1, "kill:rank=2,step=10", 3, "diloco-topk");
  check_finished(run, 3, 3);
  // Each first life at step 0, and slot 2's second life where it healed: all zero.
  CHECK(run.count("slot 2 outer residual at step ") == 2);
  CHECK(run.count("outer residual at step ") == 4);
  CHECK(run.count(": zero") == 4);
  // Two re-forms (the kill, the rejoin), each lived by two survivors.
  CHECK(run.count("outer residual after re-form: LOST") == 0);
  CHECK(run.count("outer residual after re-form: kept") +
            run.count("outer residual after re-form: behind the source") ==
        4);
}
