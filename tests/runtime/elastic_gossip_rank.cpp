// troupe_elastic_gossip_rank: one rank of an elastic gossip or asynchronous test job (D-PSGD,
// Choco-SGD, AsyncModelAverage, AsyncGossip), started by
// tests/runtime/elastic_gossip_processes_test.cpp through `troupe launch --elastic`, with faults
// from TROUPE_FAULT. argv: steps, the world to wait for (0: none; the job trains on while its
// world is smaller, for at most 45 s, then 6 more steps once it is whole, so that a restarted
// rank trains), the algorithm (elastic_gossip_job.h), and the generation to wait for (absent or
// 0: none; the same, while the generation in force is older: an asynchronous rank steps at its
// own pace and could otherwise finish before a fault elsewhere happens), and the background rounds
// to wait for once every member has ended its steps (absent or 0: none; at most 20 s; the members
// end their modules only once every one has counted them), and the rounds the last world's rank 1
// lets pass before it begins to count (absent or 0: none). It prints what the test needs to
// simulate the job's whole membership history in one process:
//   slot S generation G rank R world W source Q from F how H hash X
//       at each formation it lived (H: "first", "joined" for a restarted rank, "re-formed"),
//       with a hash of its parameters there;
//   slot S completed C in generation G     the steps it had completed when its world ended;
//   slot S finished T steps of A as rank R of W in generation G; loss L0 -> L1; rounds N;
//   params: ...
//       at the end, its parameters as hex floats, its mean loss over its first and last 5
//       steps, and the background rounds its module completed in its last world after every
//       member ended its steps (0 for the synchronous gossip algorithms).
// Exit: 0, or 1 on an error (printed).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>

#include "rank/runtime.h"
#include "tests/runtime/elastic_gossip_job.h"

using namespace troupe;
using namespace troupe::test::elastic_gossip;

namespace {

// How long a rank trains on while its world is smaller, or its generation older, than the one it
// waits for.
constexpr std::chrono::seconds kWaitAtMost{45};
constexpr int64_t kStepsWhenWhole = 6;

std::string hash_of(const torch::Tensor& t) {
  auto c = t.contiguous();
  return std::to_string(std::hash<std::string>{}(
      std::string(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(float))));
}

std::string hex_floats(const torch::Tensor& t) {
  auto c = t.contiguous();
  std::ostringstream out;
  const float* p = c.data_ptr<float>();
  char buffer[32];
  for (int64_t i = 0; i < c.numel(); ++i) {
    std::snprintf(buffer, sizeof buffer, " %a", static_cast<double>(p[i]));
    out << buffer;
  }
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 40;
  const int until_world = argc > 2 ? std::atoi(argv[2]) : 0;
  const int until_generation = argc > 4 ? std::atoi(argv[4]) : 0;
  const uint64_t rounds_after_end = argc > 5 ? std::strtoull(argv[5], nullptr, 10) : 0;
  const uint64_t skew = argc > 6 ? std::strtoull(argv[6], nullptr, 10) : 0;
  const std::string algorithm = argc > 3 ? argv[3] : "dpsgd-overlap";
  const bool asynchronous = algorithm.rfind("async", 0) == 0;
  const auto deadline = std::chrono::steady_clock::now() + kWaitAtMost;
  try {
    const JobAlgorithm job = make_algorithm(algorithm);
    RuntimeOptions o;
    o.scheduler_threads = 1;
    o.rendezvous_timeout = std::chrono::seconds(20);
    o.collective_timeout = std::chrono::seconds(20);
    Runtime rt(o);
    const Data d = make_data();
    auto net = make_model();
    auto opt = make_sgd(*net);
    DdpOptions ddp;
    ddp.stall_timeout = std::chrono::seconds(20);
    auto owned = std::make_unique<ElasticTrainer>(rt, net.ptr(), opt, job, ddp);
    ElasticTrainer& trainer = *owned;
    int64_t end = steps;
    auto formed = [&](const char* how) {
      const auto g = rt.generation();
      std::cout << "slot " << rt.slot() << " generation " << g.number << " rank " << rt.rank()
                << " world " << rt.world_size() << " source " << g.source << " from "
                << trainer.steps() << " how " << how << " hash " << hash_of(flat(*net))
                << std::endl;
      if ((until_world > 0 || until_generation > 0) && rt.world_size() >= until_world &&
          g.number >= until_generation)
        end = std::max(end, trainer.steps() + kStepsWhenWhole);
    };
    formed(rt.generation().number == 1 && trainer.recoveries().empty() ? "first" : "joined");
    ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
    std::vector<double> losses;
    auto waiting = [&] {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      return rt.world_size() < until_world || rt.generation().number < until_generation;
    };
    while (trainer.steps() < end || waiting()) {
      const int64_t before = trainer.steps();
      const int generation = rt.generation().number;
      double loss = 0;
      const bool done = trainer.step([&] {
        opt.zero_grad();
        loss =
            loss_and_backward(net, d, sampler, before, rt.rank(), rt.world_size()).item<double>();
      });
      if (done) {
        losses.push_back(loss);
        continue;
      }
      std::cout << "slot " << rt.slot() << " completed " << before << " in generation "
                << generation << std::endl;
      formed("re-formed");
    }
    // Every member has ended its last step before any drains its last round (D-PSGD with
    // overlap posts one after each step) and before any leaves (a leave opens a generation).
    if (!trainer.finish())
      throw comm::Error("the world changed while this rank waited for the others' end");
    const int64_t done_steps = trainer.steps();
    const std::string name = trainer.algorithm_name();
    uint64_t rounds = 0;
    if (asynchronous && rounds_after_end > 0) {
      // The background rounds go on in the last world. Under AsyncModelAverage every member's
      // weights are final now; a round whose snapshots all come after that makes them equal, and
      // the last round (at the trainer's end) keeps them so. A round a member started by its
      // timer may hold a snapshot from before its last steps, but no member gets more than one
      // round ahead of another: the third round this rank completes from here on started on
      // every member after every member's last step (so wait for 3 or more).
      const auto wait_until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      auto wait_for = [&](uint64_t count) {
        while (trainer.stats().background_rounds < count &&
               std::chrono::steady_clock::now() < wait_until)
          std::this_thread::yield();
      };
      // A rank that reads its count later than the others (as rank 1 does here when `skew` > 0,
      // after `skew` rounds) needs rounds after theirs.
      if (rt.rank() == 1 && skew > 0) wait_for(trainer.stats().background_rounds + skew);
      const uint64_t at_end = trainer.stats().background_rounds;
      wait_for(at_end + rounds_after_end);
      rounds = trainer.stats().background_rounds - at_end;
      // No member ends its module before every member has counted its rounds: an ended module
      // ends the others' rounds too (AsyncModelAverage's last round carries the stop to every
      // member; AsyncGossip's bye leaves a neighbour that has no other without a partner), so a
      // member that began counting a round or two after the first to finish would wait in vain.
      rt.comm().barrier();
    }
    owned.reset();
    rt.comm().barrier();
    const auto g = rt.generation();
    auto mean = [&](size_t from, size_t to) {
      double sum = 0;
      for (size_t i = from; i < to; ++i) sum += losses[i];
      return to > from ? sum / static_cast<double>(to - from) : 0.0;
    };
    const size_t k = std::min<size_t>(5, losses.size());
    std::cout << "slot " << rt.slot() << " finished " << done_steps << " steps of " << name
              << " as rank " << rt.rank() << " of " << rt.world_size() << " in generation "
              << g.number << "; loss " << mean(0, k) << " -> "
              << mean(losses.size() - k, losses.size()) << "; rounds " << rounds
              << "; params:" << hex_floats(flat(*net)) << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "elastic gossip rank: " << e.what() << std::endl;
    return 1;
  }
}
