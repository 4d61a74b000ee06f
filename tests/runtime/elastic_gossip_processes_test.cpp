// Elastic gossip and asynchronous jobs between real processes: `troupe launch --elastic`
// (troupe::launch) of troupe_elastic_gossip_rank (D-PSGD, Choco-SGD or AsyncGossip on a ring,
// AsyncModelAverage) with a rank killed by TROUPE_FAULT, and restarted where --max-restarts
// allows. The ranks print each formation they lived, the
// steps each had completed when its world ended, and their final parameters
// (tests/runtime/elastic_gossip_rank.cpp); for D-PSGD the test simulates that whole membership
// history in one process (each rank's replica and optimizer; the launch world's ring until each
// survivor's last completed step, then the next world's ring from the step the job went on
// from, a rejoining rank starting from its source's replica) and every finisher's parameters
// must be the simulation's.
#include "tests/support/torch_doctest.h"  // first: torch, then doctest

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

#include "comm/gossip/topology.h"
#include "elastic/launch.h"
#include "tests/runtime/elastic_gossip_job.h"
#include "tests/support/elastic_launch.h"

using namespace troupe;
using namespace troupe::test::elastic_gossip;

namespace {

using Run = test::ElasticRun;

Run run_elastic(int ranks, int max_restarts, const std::string& faults, int until_world,
                const std::string& algorithm) {
  return test::launch_elastic_job(
      {TROUPE_ELASTIC_GOSSIP_RANK_BIN, "40", std::to_string(until_world), algorithm}, ranks,
      /*min_ranks=*/2, max_restarts, faults);
}

// What the ranks printed.
struct Formation {
  int slot = 0, generation = 0, rank = 0, world = 0, source = 0;
  int64_t from = 0;
  std::string how, hash;
};
struct Ending {
  int slot = 0, generation = 0;
  int64_t completed = 0;
};
struct Finish {
  int slot = 0, rank = 0, world = 0, generation = 0;
  int64_t steps = 0;
  double loss_first = 0, loss_last = 0;
  uint64_t rounds = 0;  // background rounds in its last world (the asynchronous algorithms)
  std::vector<float> params;
};
struct Printed {
  std::vector<Formation> formations;
  std::vector<Ending> endings;
  std::vector<Finish> finishes;
};

Printed parse(const std::string& out) {
  Printed p;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t at = line.find("slot ");
    if (at == std::string::npos) continue;
    std::istringstream in(line.substr(at));
    std::string word, what;
    int slot = 0;
    in >> word >> slot >> what;
    if (what == "generation") {
      Formation f;
      f.slot = slot;
      in >> f.generation >> word >> f.rank >> word >> f.world >> word >> f.source >> word >>
          f.from >> word >> f.how >> word >> f.hash;
      if (in) p.formations.push_back(f);
    } else if (what == "completed") {
      Ending e;
      e.slot = slot;
      in >> e.completed >> word >> word >> e.generation;
      if (in) p.endings.push_back(e);
    } else if (what == "finished") {
      Finish f;
      f.slot = slot;
      in >> f.steps;
      const size_t as = line.find(" as rank ");
      const size_t loss = line.find("; loss ");
      const size_t rounds = line.find("; rounds ");
      const size_t params = line.find("; params:");
      if (as == std::string::npos || loss == std::string::npos || rounds == std::string::npos ||
          params == std::string::npos)
        continue;
      f.rounds = std::stoull(line.substr(rounds + 9));
      std::istringstream tail(line.substr(as));
      tail >> word >> word >> f.rank >> word >> f.world >> word >> word >> f.generation;
      std::istringstream losses(line.substr(loss + 7));
      losses >> f.loss_first >> word >> f.loss_last;
      const char* c = line.c_str() + params + 9;
      char* next = nullptr;
      for (float v = std::strtof(c, &next); next != c; v = std::strtof(c, &next)) {
        f.params.push_back(v);
        c = next;
      }
      p.finishes.push_back(std::move(f));
    }
  }
  return p;
}

// One rank's replica in the simulation: its model and its optimizer.
struct Replica {
  torch::nn::Sequential net = make_model();
  torch::optim::SGD opt = make_sgd(*net);
  std::string save() { return module_state(net.ptr(), opt).save(); }
  void load(const std::string& bytes) { module_state(net.ptr(), opt).load(bytes); }
  void set(const torch::Tensor& x) {
    torch::NoGradGuard no_grad;
    int64_t at = 0;
    for (auto& p : net->parameters()) {
      p.copy_(x.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
};

// x_r := sum_j W_rj x_j over the ring's round, in the order and precision of comm::mix.
std::vector<torch::Tensor> mix(const comm::Topology& topology, uint64_t round,
                               const std::vector<torch::Tensor>& x) {
  std::vector<torch::Tensor> out;
  for (int r = 0; r < static_cast<int>(x.size()); ++r) {
    const auto peers = topology.round(r, round);
    auto o = x[static_cast<size_t>(r)].clone();
    float* po = o.data_ptr<float>();
    const float* self = x[static_cast<size_t>(r)].data_ptr<float>();
    const float ws = static_cast<float>(peers.self_weight);
    for (int64_t i = 0; i < o.numel(); ++i) po[i] = ws * self[i];
    for (size_t j = 0; j < peers.recv_from.size(); ++j) {
      const float w = static_cast<float>(peers.recv_weights[j]);
      const float* pj = x[static_cast<size_t>(peers.recv_from[j])].data_ptr<float>();
      for (int64_t i = 0; i < o.numel(); ++i) po[i] += w * pj[i];
    }
    out.push_back(o);
  }
  return out;
}

// The whole elastic D-PSGD job in one process, from what its ranks printed: each finisher's
// parameters, by slot.
std::map<int, torch::Tensor> simulate_dpsgd(const Printed& p, const Decentralized& algo) {
  const Data d = make_data();
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  std::map<int, std::map<int, int>> members;  // generation -> rank -> slot
  std::map<int, int64_t> from;
  std::map<int, int> source;
  std::map<std::pair<int, int>, std::string> how;  // (generation, slot)
  for (const auto& f : p.formations) {
    members[f.generation][f.rank] = f.slot;
    from[f.generation] = f.from;
    source[f.generation] = f.source;
    how[{f.generation, f.slot}] = f.how;
  }
  std::map<std::pair<int, int>, int64_t> ends;  // (generation, slot) -> steps completed in it
  for (const auto& e : p.endings) ends[{e.generation, e.slot}] = e.completed;
  for (const auto& f : p.finishes) ends[{f.generation, f.slot}] = f.steps;
  std::map<int, std::string> state;  // slot -> its replica when its last world ended
  for (const auto& [generation, ranks] : members) {
    const int world = static_cast<int>(ranks.size());
    REQUIRE(ranks.rbegin()->first == world - 1);  // every member printed its formation
    const int source_slot = ranks.at(source[generation]);
    std::vector<Replica> replicas(static_cast<size_t>(world));
    for (const auto& [rank, slot] : ranks) {
      if (how[{generation, slot}] == "first") continue;  // the launch's model, as every rank's
      const int from_slot = how[{generation, slot}] == "joined" ? source_slot : slot;
      REQUIRE(state.count(from_slot));
      replicas[static_cast<size_t>(rank)].load(state[from_slot]);
    }
    int64_t last = from[generation];
    for (const auto& [rank, slot] : ranks) {
      auto end = ends.find({generation, slot});
      if (end == ends.end()) continue;  // it died in this world
      last = std::max(last, end->second);
      if (end->second == from[generation]) state[slot] = replicas[static_cast<size_t>(rank)].save();
    }
    comm::Topology topology(algo.topology, world);
    for (int64_t s = from[generation]; s < last; ++s) {
      const uint64_t round = static_cast<uint64_t>(s - from[generation]);
      std::vector<torch::Tensor> x;
      for (int r = 0; r < world; ++r) {
        auto& rep = replicas[static_cast<size_t>(r)];
        x.push_back(flat(*rep.net).clone());
        rep.opt.zero_grad();
        loss_and_backward(rep.net, d, sampler, s, r, world);
      }
      if (algo.exchange == Decentralized::Exchange::overlap) {
        // x_{t+1} = sum_j W_ij x_j,t, then the step with the gradient at x_i,t.
        const auto mixed = mix(topology, round, x);
        for (int r = 0; r < world; ++r) {
          replicas[static_cast<size_t>(r)].set(mixed[static_cast<size_t>(r)]);
          replicas[static_cast<size_t>(r)].opt.step();
        }
      } else {
        std::vector<torch::Tensor> stepped;
        for (auto& rep : replicas) {
          rep.opt.step();
          stepped.push_back(flat(*rep.net).clone());
        }
        const auto mixed = mix(topology, round, stepped);
        for (int r = 0; r < world; ++r)
          replicas[static_cast<size_t>(r)].set(mixed[static_cast<size_t>(r)]);
      }
      for (const auto& [rank, slot] : ranks) {
        auto end = ends.find({generation, slot});
        if (end != ends.end() && end->second == s + 1)
          state[slot] = replicas[static_cast<size_t>(rank)].save();
      }
    }
  }
  std::map<int, torch::Tensor> finals;
  for (const auto& f : p.finishes) {
    Replica r;
    r.load(state.at(f.slot));
    finals[f.slot] = flat(*r.net).clone();
  }
  return finals;
}

// Every finisher's loss over its last steps is under half the loss the job started from (a
// restarted rank's first steps are after its heal, so the start is the highest first loss).
void check_learned(const Printed& printed) {
  double start = 0;
  for (const auto& f : printed.finishes) start = std::max(start, f.loss_first);
  for (const auto& f : printed.finishes) {
    CAPTURE(f.slot);
    CHECK(f.loss_last < 0.5 * start);
  }
}

// Every finisher of `run` ended in a world of `world`, and matches the simulation.
void check_dpsgd(const Run& run, const std::string& algorithm, int finishers, int world) {
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err << "\nlaunch: " << run.result.message);
  REQUIRE(run.result.exit_code == 0);
  const auto printed = parse(run.out);
  REQUIRE(printed.finishes.size() == static_cast<size_t>(finishers));
  const auto finals = simulate_dpsgd(printed, std::get<Decentralized>(make_algorithm(algorithm)));
  for (const auto& f : printed.finishes) {
    CAPTURE(f.slot);
    CHECK(f.world == world);
    const auto got = torch::tensor(f.params);
    REQUIRE(got.numel() == finals.at(f.slot).numel());
    const double off = (got - finals.at(f.slot)).abs().max().item<double>();
    MESSAGE("slot " << f.slot << ": max |param - simulation| = " << off);
    CHECK(off <= 1e-6);
  }
  check_learned(printed);
}

// The restarted rank's parameters where it joined are its source's there (the same hash).
void check_healed(const Run& run, int slot) {
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err);
  const auto printed = parse(run.out);
  int healed = 0;
  for (const auto& f : printed.formations) {
    if (f.how != "joined") continue;
    CHECK(f.slot == slot);
    for (const auto& g : printed.formations)
      if (g.generation == f.generation && g.rank == f.source && g.slot != f.slot) {
        CHECK(g.hash == f.hash);
        ++healed;
      }
  }
  CHECK(healed == 1);
}

}  // namespace

TEST_CASE(
    "an elastic D-PSGD job (overlap) goes on over the survivors' ring on the simulated "
    "trajectory when a rank dies") {
  auto run = run_elastic(3, 0, "kill:rank=1,step=10", 0, "dpsgd-overlap");
  check_dpsgd(run, "dpsgd-overlap", 2, 2);
  CHECK(run.err.find("kills itself at step 10 (backward)") != std::string::npos);
  CHECK(run.count(" completed ") == 2);  // each survivor's world ended once
}

TEST_CASE(
    "an elastic D-PSGD job (after_step) goes on over the survivors' ring on the simulated "
    "trajectory when a rank dies") {
  auto run = run_elastic(3, 0, "kill:rank=2,step=10", 0, "dpsgd-after-step");
  check_dpsgd(run, "dpsgd-after-step", 2, 2);
  CHECK(run.count(" completed ") == 2);
}

TEST_CASE(
    "a killed D-PSGD rank is restarted, takes a live peer's replica, and the job follows "
    "the simulation of its whole membership") {
  auto run = run_elastic(3, 1, "kill:rank=2,step=10", 3, "dpsgd-after-step");
  check_dpsgd(run, "dpsgd-after-step", 3, 3);
  check_healed(run, 2);
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1") != std::string::npos);
}

TEST_CASE("a killed D-PSGD rank (overlap) is restarted and the job follows the simulation") {
  auto run = run_elastic(3, 1, "kill:rank=0,step=12", 3, "dpsgd-overlap");
  check_dpsgd(run, "dpsgd-overlap", 3, 3);
  check_healed(run, 0);
}

TEST_CASE(
    "a killed Choco-SGD rank is restarted, takes a live peer's replica, and every rank "
    "trains on") {
  auto run = run_elastic(3, 1, "kill:rank=1,step=10", 3, "choco");
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err << "\nlaunch: " << run.result.message);
  REQUIRE(run.result.exit_code == 0);
  const auto printed = parse(run.out);
  REQUIRE(printed.finishes.size() == 3);
  for (const auto& f : printed.finishes) {
    CAPTURE(f.slot);
    CHECK(f.world == 3);
    CHECK(f.steps >= 40);
    for (float v : f.params) REQUIRE(std::isfinite(v));
  }
  check_learned(printed);
  check_healed(run, 1);
  CHECK(run.count("low_precision_decentralized(") == 3);
}

// An asynchronous job of 3 ranks and 200 steps each (rank `killed` killed at its step 60, and
// restarted when `restarts` is 1): every rank that lives to the end finishes in the whole world
// left and learns; a restarted rank healed from its source bit for bit; each survivor went on
// from its own replica. With `rounds_after_end` > 0 each rank also waits (at most 20 s) for that
// many background rounds once every member has ended its steps, and they must happen.
// AsyncModelAverage's rounds that start after every member's last step (the third a rank
// completes from there) average every member's weights, so the finishers' parameters are then
// equal (within the rounding of x + (mean - x)): an independent check that the new world
// averaged with every member. AsyncGossip's replicas differ by design (the rounds run on their
// own schedule, and are not deterministic).
Run run_async(const std::string& algorithm, int killed, int restarts, int rounds_after_end = 0,
              int skew = 0) {
  // Every rank trains on until the death's generation (2) or the rejoin's (3) is in force: the
  // ranks step at their own pace, and one could finish its steps before the fault happens.
  return test::launch_elastic_job(
      {TROUPE_ELASTIC_GOSSIP_RANK_BIN, "200", std::to_string(restarts ? 3 : 0), algorithm,
       std::to_string(restarts ? 3 : 2), std::to_string(rounds_after_end), std::to_string(skew)},
      3, /*min_ranks=*/2, restarts, "kill:rank=" + std::to_string(killed) + ",step=60");
}

Printed check_async(const Run& run, const std::string& name, size_t finishers, int world,
                    uint64_t rounds_after_end = 0) {
  INFO("stdout:\n" << run.out << "\nstderr:\n" << run.err << "\nlaunch: " << run.result.message);
  REQUIRE(run.result.exit_code == 0);
  auto printed = parse(run.out);
  REQUIRE(printed.finishes.size() == finishers);
  for (const auto& f : printed.finishes) {
    CAPTURE(f.slot);
    CHECK(f.world == world);
    CHECK(f.steps >= 200);
    CHECK(f.rounds >= rounds_after_end);
    for (float v : f.params) REQUIRE(std::isfinite(v));
  }
  check_learned(printed);
  CHECK(run.count(name + "(") == finishers);
  CHECK(run.err.find("kills itself at step 60 (backward)") != std::string::npos);
  return printed;
}

// Every finisher's parameters equal the first's within `tolerance`.
void check_equal_replicas(const Printed& printed, double tolerance) {
  const auto first = torch::tensor(printed.finishes.front().params);
  for (const auto& f : printed.finishes) {
    CAPTURE(f.slot);
    const auto got = torch::tensor(f.params);
    REQUIRE(got.numel() == first.numel());
    const double off = (got - first).abs().max().item<double>();
    MESSAGE("slot " << f.slot << ": max |param - slot " << printed.finishes.front().slot
                    << "'s| = " << off);
    CHECK(off <= tolerance);
  }
}

// Each survivor went on from its own replica, not the source's: their hashes where the death's
// generation formed differ (the replicas of both algorithms differ between averages).
void check_own_replicas(const Printed& printed) {
  std::vector<std::string> hashes;
  for (const auto& f : printed.formations)
    if (f.generation == 2 && f.how == "re-formed") hashes.push_back(f.hash);
  REQUIRE(hashes.size() == 2);
  CHECK(hashes[0] != hashes[1]);
}

TEST_CASE(
    "an elastic AsyncModelAverage job ends the old world's rounds when a rank dies and "
    "its survivors go on from their own replicas") {
  auto run = run_async("async-model-average", 1, 0);
  const auto printed = check_async(run, "async_model_average", 2, 2);
  CHECK(run.count(" completed ") == 2);  // each survivor's world ended once
  check_own_replicas(printed);
}

TEST_CASE(
    "a killed AsyncModelAverage rank is restarted, takes a live peer's replica bit for "
    "bit, and trains with the others") {
  auto run = run_async("async-model-average", 2, 1);
  check_async(run, "async_model_average", 3, 3);
  check_healed(run, 2);
  CHECK(run.err.find("restarting rank slot 2 (restart 1 of 1") != std::string::npos);
}

TEST_CASE(
    "an elastic AsyncGossip job ends the old world's exchanges when a rank dies and its "
    "survivors go on from their own replicas") {
  auto run = run_async("async-gossip", 0, 0);
  const auto printed = check_async(run, "async_gossip", 2, 2);
  CHECK(run.count(" completed ") == 2);
  check_own_replicas(printed);
}

TEST_CASE(
    "a killed AsyncGossip rank is restarted, takes a live peer's replica bit for bit, and "
    "trains with the others") {
  auto run = run_async("async-gossip", 1, 1);
  check_async(run, "async_gossip", 3, 3);
  check_healed(run, 1);
}

// The new world's rounds go on after every member's last step. These stalled in about 4 of 9
// runs (one rank waited 20 s and printed "rounds 2"): the ranks began counting at different
// rounds, and the first to reach its count ended its module, which ended the rounds for the
// others (AsyncModelAverage's stop round; AsyncGossip's bye to a rank with no other neighbour in
// a world of 2). The rank program now waits for every member's count before any ends its module.
TEST_CASE(
    "the survivors of an elastic AsyncModelAverage job average again in the new world: "
    "their weights end equal") {
  auto run = run_async("async-model-average", 1, 0, 3);
  const auto printed = check_async(run, "async_model_average", 2, 2, 3);
  check_equal_replicas(printed, 1e-6);
}

TEST_CASE("the survivors of an elastic AsyncGossip job gossip on in the new world") {
  auto run = run_async("async-gossip", 0, 0, 3);
  check_async(run, "async_gossip", 2, 2, 3);
}

// The stall made certain: rank 1 of the new world begins counting 4 rounds after the others, so
// the others reach their 3 first; they must not end the rounds before rank 1 has its 3.
TEST_CASE(
    "a survivor that begins counting the new world's rounds late still gets them: "
    "AsyncModelAverage and AsyncGossip") {
  for (const char* algorithm : {"async-model-average", "async-gossip"}) {
    CAPTURE(algorithm);
    auto run = run_async(algorithm, 0, 0, 3, 4);
    check_async(run,
                std::string(algorithm) == "async-gossip" ? "async_gossip" : "async_model_average",
                2, 2, 3);
  }
}
