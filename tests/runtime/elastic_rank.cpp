// troupe_elastic_rank: one rank of an elastic test job, started by
// tests/runtime/elastic_processes_test.cpp through `troupe launch --elastic`, with faults from
// TROUPE_FAULT. It trains a small MLP for argv[1] steps on synthetic data with an
// ElasticTrainer (and on, while the world is smaller than argv[2], so that a restarted rank
// rejoins before the end; at most kMaxSteps), then checks that every member holds the same
// parameters (bit for bit) and that they match one process trained on the same global batches (the
// global batch divides evenly by every world size the tests reach, so the average of the ranks'
// means is the batch mean). argv[3] picks the algorithm: allreduce (the default), topk (top-k 10%
// with error feedback and momentum correction) or powersgd (rank 1 with error feedback, from step
// 2); the compressed ones are not compared with the reference (they follow their own trajectory),
// but each rank reports what happened to its algorithm state: after a re-form a survivor's must be
// what it was after its last completed step ("kept"), a restarted rank's error feedback must be
// zero, and the shared part (PowerSGD's Qs) is printed as a hash per step for the test to compare.
// argv[3] = diloco, streaming-diloco (and its -eager, -topk and -eager-topk variants:
// tests/support/elastic_reference.h) or sparseloco runs that local-update algorithm (h = 4,
// allreduce outer reduction for DiLoCo, exact top-25% values for SparseLoCo; inner SGD with
// momentum, each rank's own): the job ends where a sync has landed, and each member that lived
// through every change compares every member's weights with a one-process reference of the same
// run (reference_local_update: each rank's replica on its shard, the world of each recovery from
// its rollback step on; the highest launch slots are the ones that died, and a rank that rejoins
// takes the replica of the generation's source, as the real one does). A member behind the source
// at a re-form (its sync failed where the source's completed) lands that sync itself, so the
// reference holds for it too. DiLoCo and SparseLoCo end with bit-identical replicas; Streaming
// DiLoCo's replicas differ (each merges its own), and its members compare their global weights.
// diloco-topk runs DiLoCo with a top-k outer reduction with error feedback, not compared with the
// reference: each member reports its residual after a re-form ("kept": the one of the sync it
// went back to) and a restarted rank's ("zero").
// Exit: 0 held, 2 replicas differ, 3 off the reference, 1 an error (printed).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/local_update/local_update_module.h"
#include "algorithms/local_update/streaming_diloco.h"
#include "comm/state.h"
#include "elastic/elastic.h"
#include "rank/runtime.h"
#include "tests/support/elastic_reference.h"

using namespace troupe;
using namespace troupe::test::elastic;

namespace {

constexpr int64_t kMaxSteps = 20000;

Algorithm make_algorithm(const std::string& name) {
  if (name == "allreduce") return GradientAllReduce{};
  if (name == "topk") {
    Sparsification topk;
    topk.ratio = 0.1;
    topk.momentum = 0.5;
    return topk;
  }
  if (name == "powersgd") {
    PowerSGD power;
    power.rank = 1;
    power.start_iter = 2;
    return power;
  }
  throw comm::Error("elastic rank: algorithm '" + name +
                    "' (expected allreduce, topk or powersgd)");
}

JobAlgorithm make_job_algorithm(const std::string& name) {
  if (name == "diloco") return make_diloco();
  if (name == "diloco-topk") {
    DiLoCo c = make_diloco();
    Sparsification topk;
    topk.ratio = 0.1;
    c.outer_compression = topk;
    return c;
  }
  if (streaming_job(name)) return make_streaming(name);
  if (name == "sparseloco") return make_sparseloco();
  return make_algorithm(name);
}

bool local_update(const std::string& name) {
  return name.rfind("diloco", 0) == 0 || streaming_job(name) || name == "sparseloco";
}

std::string module_state(const DistributedModule& ddp, StatePart part) {
  std::string bytes;
  comm::StateWriter out(bytes);
  ddp.save_state(out, part);
  return bytes;
}

// The buckets' states of a DistributedModule state (its format: the algorithm's name, the step,
// the layout's order and ready times, then one string per bucket).
std::vector<std::string> bucket_states(const std::string& bytes) {
  comm::StateReader in(bytes, "a DistributedModule state");
  in.string();
  in.value<uint32_t>();
  in.vector<int>();
  in.vector<int64_t>();
  std::vector<std::string> out(static_cast<size_t>(in.value<uint64_t>()));
  for (auto& b : out) b = in.string();
  return out;
}

// Whether every bucket's error feedback (and top-k's momentum correction) is zero: top-k writes
// the memory and the velocity, PowerSGD the memory and then its Qs.
bool residuals_zero(const std::string& bytes, const std::string& algorithm) {
  auto zero = [](const std::vector<float>& v) {
    for (float x : v)
      if (x != 0.0f) return false;
    return true;
  };
  for (const auto& b : bucket_states(bytes)) {
    comm::StateReader in(b, "a bucket state");
    if (!zero(in.vector<float>())) return false;
    if (algorithm == "topk" && !zero(in.vector<float>())) return false;
  }
  return true;
}

std::string hash_of(const std::string& bytes) {
  return std::to_string(std::hash<std::string>{}(bytes));
}

long long unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A local-update module's state past OuterStep's (name, counters, global weights, outer
// momentum): DiLoCo's outer reduction's own state (top-k's error feedback).
std::string outer_residual(LocalUpdateModule& lu) {
  std::string bytes;
  comm::StateWriter out(bytes);
  lu.save_state(out, StatePart::all);
  comm::StateReader in(bytes, "a DiLoCo state");
  in.string();
  in.value<int64_t>();
  in.value<int64_t>();
  in.value<uint64_t>();
  in.vector<float>();
  in.vector<float>();
  const size_t rest = in.remaining();
  return std::string(in.take(rest), rest);
}

bool all_zero(const std::string& residual) {
  comm::StateReader in(residual, "a residual");
  while (in.remaining() > 0)
    for (float x : in.vector<float>())
      if (x != 0.0f) return false;
  return true;
}

// Whether rank 0 holds the same weights as this member, bit for bit.
bool same_as_rank0(Runtime& rt, const torch::Tensor& mine) {
  auto theirs = mine.clone();
  rt.comm().broadcast(theirs.data_ptr(), static_cast<size_t>(theirs.numel()),
                      comm::DataType::float32, 0);
  return torch::equal(mine, theirs);
}

// Whether every member holds the same `bytes` (rank 0's hash against each member's).
bool same_everywhere(Runtime& rt, const std::string& bytes) {
  int64_t mine = static_cast<int64_t>(std::hash<std::string>{}(bytes));
  int64_t theirs = mine;
  rt.comm().broadcast(&theirs, 1, comm::DataType::int64, 0);
  int32_t differ = mine != theirs;
  for (int r = 0; r < rt.world_size(); ++r) {
    int32_t flag = differ;
    rt.comm().broadcast(&flag, 1, comm::DataType::int32, r);
    if (flag) return false;
  }
  return true;
}

// The local-update modes: trains to `steps` (and on while the world is smaller than
// `until_world`), always ending where a sync has landed; then the replicas and the reference.
int run_local_update(Runtime& rt, ElasticTrainer& trainer, torch::nn::Sequential& net,
                     torch::optim::SGD& opt, const Data& d, const std::string& algorithm,
                     int64_t steps, int until_world, int launch_world, bool restarted) {
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  const bool streaming = streaming_job(algorithm);
  const bool compressed = algorithm == "diloco-topk";
  bool after_change = false;
  // Once the world is whole again, two more outer syncs, so that a rank that rejoined trains:
  // every member sees the same steps() when a generation starts, so they agree on the end.
  int64_t end = steps;
  auto whole = [&] {
    if (until_world > 0 && rt.world_size() >= until_world)
      end = std::max(end, trainer.steps() + 2 * kH);
  };
  whole();
  // The compressed outer reduction: this rank's residual where each sync landed, by step.
  std::map<int64_t, std::string> residuals;
  if (compressed) {
    const std::string residual = outer_residual(trainer.local_update());
    std::cout << "slot " << rt.slot() << " outer residual at step " << trainer.steps() << ": "
              << (all_zero(residual) ? "zero" : "nonzero") << std::endl;
    residuals[trainer.steps()] = residual;
  }
  while (trainer.steps() < end || !lands_after(algorithm, trainer.steps()) ||
         (rt.world_size() < until_world && trainer.steps() < kMaxSteps)) {
    const int64_t before = trainer.steps();
    auto idx = as_index(sampler.indices(before, rt.rank(), rt.world_size()));
    const bool done = trainer.step([&] {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}))
          .backward();
    });
    if (!done) {
      after_change = true;
      whole();
      std::cout << "slot " << rt.slot() << " rolled back from step " << before << " to step "
                << trainer.steps() << ", world " << rt.world_size() << std::endl;
      if (compressed) {
        // A member at its own landed sync keeps its residual of then; one that was behind the
        // source (its sync failed where the source's completed) has its live one of the sync.
        auto kept = residuals.find(trainer.steps());
        const std::string now = outer_residual(trainer.local_update());
        std::cout << "slot " << rt.slot() << " outer residual after re-form: "
                  << (kept == residuals.end() ? "behind the source"
                      : kept->second == now   ? "kept"
                                              : "LOST")
                  << std::endl;
      }
    } else {
      if (after_change)
        std::cout << "slot " << rt.slot() << " stepping again in generation "
                  << rt.generation().number << " at unix ms " << unix_ms() << std::endl;
      after_change = false;
      if (compressed && lands_after(algorithm, trainer.steps()))
        residuals[trainer.steps()] = outer_residual(trainer.local_update());
    }
  }
  // DiLoCo and SparseLoCo make the replicas equal at a sync; Streaming DiLoCo keeps them apart
  // (each merges its own weights), and only its global weights (the shared state) agree.
  auto mine = flat(*net);
  bool same = false;
  if (streaming) {
    // A fragment is in flight at every step's end: the whole state (which waits for it, not
    // applying it), of which the global weights (after the name and the counters).
    std::string state;
    comm::StateWriter out(state);
    trainer.local_update().save_state(out, StatePart::all);
    comm::StateReader in(state, "a Streaming DiLoCo state");
    in.string();
    in.value<int64_t>();
    in.value<int64_t>();
    in.value<uint64_t>();
    const auto global = in.vector<float>();
    same = same_everywhere(
        rt, std::string(reinterpret_cast<const char*>(global.data()), global.size() * 4));
  } else {
    same = same_as_rank0(rt, mine);
  }
  // Every member's weights, to compare each with its replica in the reference.
  std::vector<torch::Tensor> all;
  for (int r = 0; r < rt.world_size(); ++r) {
    auto w = r == rt.rank() ? mine.clone() : torch::empty_like(mine);
    rt.comm().broadcast(w.data_ptr(), static_cast<size_t>(w.numel()), comm::DataType::float32, r);
    all.push_back(w);
  }
  std::cout << "slot " << rt.slot() << " finished " << trainer.steps() << " steps of "
            << trainer.algorithm_name() << " as rank " << rt.rank() << " of " << rt.world_size()
            << " in generation " << rt.generation().number << " after "
            << trainer.recoveries().size() << " recoveries; "
            << (streaming ? "global weights " : "replicas ") << (same ? "identical" : "DIFFER");
  double off = 0;
  if (compressed) {
    std::cout << "; reference not compared (its outer reduction is top-k)";
  } else if (!restarted) {
    std::vector<Segment> segments{{0, launch_world, 0}};
    for (auto& r : trainer.recoveries()) {
      while (!segments.empty() && segments.back().from >= r.step) segments.pop_back();
      segments.push_back({r.step, r.world_size, r.source});
    }
    const auto ref = reference_local_update(d, algorithm, segments, trainer.steps());
    if (ref.size() != all.size()) {
      std::cout << "; the reference has " << ref.size() << " ranks" << std::endl;
      return 3;
    }
    for (size_t r = 0; r < all.size(); ++r)
      off = std::max(off, (all[r] - ref[r]).abs().max().item<double>());
    std::cout << "; max |param - reference| = " << off;
  } else {
    std::cout << "; reference not compared (this rank joined late)";
  }
  std::cout << std::endl;
  for (auto& r : trainer.recoveries())
    std::cout << "slot " << rt.slot() << " recovery: generation " << r.generation << ", world "
              << r.world_size << ", from step " << r.step << ", " << r.seconds << " s" << std::endl;
  if (!same) return 2;
  // Worlds of 1 and 2 sum as the reference does, bit for bit; 3 ranks' ring sums each chunk in
  // its own order.
  if (!(off <= 1e-5)) return 3;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 40;
  const int until_world = argc > 2 ? std::atoi(argv[2]) : 0;
  const std::string algorithm = argc > 3 ? argv[3] : "allreduce";
  try {
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
    const bool diloco = local_update(algorithm);
    const int launch_world = rt.rank_info().world_size;
    ElasticTrainer trainer(rt, net.ptr(), opt, make_job_algorithm(algorithm), ddp);
    const bool restarted = rt.generation().number > 1 || !trainer.recoveries().empty();
    auto report_shared = [&] {
      std::cout << "slot " << rt.slot() << " shared state at step " << trainer.steps() << ": "
                << hash_of(module_state(trainer.module(), StatePart::shared)) << std::endl;
    };
    if (restarted) {
      std::cout << "slot " << rt.slot() << " healed, stepping from step " << trainer.steps()
                << " at unix ms " << unix_ms() << std::endl;
      if (algorithm != "allreduce" && !diloco) {
        const bool zero = residuals_zero(module_state(trainer.module(), StatePart::all), algorithm);
        std::cout << "slot " << rt.slot() << " residual after heal: " << (zero ? "zero" : "NONZERO")
                  << std::endl;
        report_shared();
      }
    }
    if (diloco)
      return run_local_update(rt, trainer, net, opt, d, algorithm, steps, until_world, launch_world,
                              restarted);
    // This rank's algorithm state after its last completed step: what a re-form must keep.
    std::vector<std::string> last = bucket_states(module_state(trainer.module(), StatePart::all));
    int64_t last_step = trainer.steps();
    ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
    bool after_change = false;
    // TROUPE_TEST_STOP="slot:step": that slot's first process stops itself (SIGSTOP) before that
    // step, a member gone silent without dying (a kill is TROUPE_FAULT's).
    int stop_slot = -1;
    int64_t stop_step = -1;
    if (const char* stop = std::getenv("TROUPE_TEST_STOP"); stop && !restarted) {
      stop_slot = std::atoi(stop);
      stop_step = std::strchr(stop, ':') ? std::atoll(std::strchr(stop, ':') + 1) : -1;
    }
    // TROUPE_TEST_HOLD="slot:step:path": that slot's first process waits before that step until
    // `path` exists (at most 60 s), so that a test can cut a link while the job is mid-run: it
    // watches for the line printed here, acts, then creates the file.
    int hold_slot = -1;
    int64_t hold_step = -1;
    std::string hold_path;
    if (const char* hold = std::getenv("TROUPE_TEST_HOLD"); hold && *hold && !restarted) {
      const std::string spec = hold;
      const size_t a = spec.find(':'), b = spec.find(':', a == std::string::npos ? a : a + 1);
      if (a == std::string::npos || b == std::string::npos)
        throw std::runtime_error("TROUPE_TEST_HOLD='" + spec + "' (expected slot:step:path)");
      hold_slot = std::stoi(spec.substr(0, a));
      hold_step = std::stoll(spec.substr(a + 1, b - a - 1));
      hold_path = spec.substr(b + 1);
    }
    while (trainer.steps() < steps ||
           (rt.world_size() < until_world && trainer.steps() < kMaxSteps)) {
      if (rt.slot() == hold_slot && trainer.steps() == hold_step) {
        hold_slot = -1;
        std::cout << "slot " << rt.slot() << " holds before step " << hold_step << " until "
                  << hold_path << " exists" << std::endl;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!std::filesystem::exists(hold_path)) {
          if (std::chrono::steady_clock::now() > until)
            throw std::runtime_error("TROUPE_TEST_HOLD: " + hold_path + " did not appear in 60 s");
          std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling a file
        }
        std::cout << "slot " << rt.slot() << " goes on at unix ms " << unix_ms() << std::endl;
      }
      if (rt.slot() == stop_slot && trainer.steps() == stop_step) {
        std::cout << "slot " << rt.slot() << " stops itself (SIGSTOP) before step " << stop_step
                  << std::endl;
        stop_slot = -1;
        raise(SIGSTOP);
      }
      auto idx = as_index(sampler.indices(trainer.steps(), rt.rank(), rt.world_size()));
      const bool done = trainer.step([&] {
        opt.zero_grad();
        torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}))
            .backward();
      });
      if (done) {
        last = bucket_states(module_state(trainer.module(), StatePart::all));
        last_step = trainer.steps();
      } else {
        after_change = true;
        if (algorithm != "allreduce" && trainer.steps() != last_step) {
          // This rank was behind the generation's source: it keeps its own residual, but the
          // shared part (step, PowerSGD's Qs) is the source's, so its whole state differs.
          std::cout << "slot " << rt.slot() << " algorithm state after re-form: behind the "
                    << "source (" << last_step << " -> " << trainer.steps() << ")" << std::endl;
          report_shared();
        } else if (algorithm != "allreduce") {
          const bool kept = bucket_states(module_state(trainer.module(), StatePart::all)) == last;
          std::cout << "slot " << rt.slot()
                    << " algorithm state after re-form: " << (kept ? "kept" : "LOST") << std::endl;
          report_shared();
        }
      }
      if (done && after_change) {
        std::cout << "slot " << rt.slot() << " stepping again in generation "
                  << rt.generation().number << " at unix ms " << unix_ms() << std::endl;
        after_change = false;
      }
    }
    // Bit-identical replicas: rank 0's parameters against each member's.
    auto mine = flat(*net);
    const bool same = same_as_rank0(rt, mine);
    const double off = (mine - reference(d, trainer.steps())).abs().max().item<double>();
    std::cout << "slot " << rt.slot() << " finished " << trainer.steps() << " steps as rank "
              << rt.rank() << " of " << rt.world_size() << " in generation "
              << rt.generation().number << " after " << trainer.recoveries().size()
              << " recoveries; replicas " << (same ? "identical" : "DIFFER")
              << "; max |param - reference| = " << off << std::endl;
    for (auto& r : trainer.recoveries())
      std::cout << "slot " << rt.slot() << " recovery: generation " << r.generation << ", world "
                << r.world_size << ", from step " << r.step << ", " << r.seconds << " s"
                << std::endl;
    if (algorithm != "allreduce") report_shared();
    if (!same) return 2;
    if (algorithm == "allreduce" && !(off < 1e-4)) return 3;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "elastic rank: " << e.what() << std::endl;
    return 1;
  }
}
