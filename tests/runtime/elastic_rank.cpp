// troupe_elastic_rank: one rank of an elastic test job, started by
// tests/runtime/elastic_processes_test.cpp through `troupe launch --elastic`, with faults from
// TROUPE_FAULT. It trains a small MLP for argv[1] steps on synthetic data with an
// ElasticTrainer (and on, while the world is smaller than argv[2], so that a restarted rank
// rejoins before the end; at most kMaxSteps), then checks that every member holds the same parameters (bit for bit) and that
// they match one process trained on the same global batches (the global batch divides evenly by
// every world size the tests reach, so the average of the ranks' means is the batch mean).
// argv[3] picks the algorithm: allreduce (the default), topk (top-k 10% with error feedback and
// momentum correction) or powersgd (rank 1 with error feedback, from step 2); the compressed
// ones are not compared with the reference (they follow their own trajectory), but each rank
// reports what happened to its algorithm state: after a re-form a survivor's must be what it was
// after its last completed step ("kept"), a restarted rank's error feedback must be zero, and
// the shared part (PowerSGD's Qs) is printed as a hash per step for the test to compare.
// argv[3] = diloco runs DiLoCo (h = 4, allreduce outer reduction; inner SGD with momentum, each
// rank's own): the job ends at an outer sync (where the replicas are equal), and each member that
// lived through every change compares its parameters with a one-process reference of the same
// run (reference_diloco: each rank's replica on its shard, the world of each recovery from its
// rollback step on; the highest launch slots are the ones that died, and a rank that rejoins
// takes rank 0's replica, the generation's source, as the real one does). When a re-form caught
// a member behind the source (its outer sync failed where the source's completed), that member
// took the source's inner optimizer, which the reference does not model: no member compares then.
// Exit: 0 held, 2 replicas differ, 3 off the reference, 1 an error (printed).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "runtime/elastic.h"
#include "runtime/runtime.h"

using namespace troupe;

namespace {

constexpr int64_t kSamples = 480;
constexpr int64_t kGlobalBatch = 24;  // divides by 1, 2, 3, 4
constexpr uint64_t kSeed = 7;
constexpr int64_t kMaxSteps = 20000;

struct Data {
  torch::Tensor x, y;
};

Data make_data() {
  torch::manual_seed(1234);
  Data d;
  d.x = torch::randn({kSamples, 16});
  d.y = torch::randint(0, 4, {kSamples});
  return d;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(99);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return torch::cat(parts);
}

torch::Tensor as_index(const std::vector<int64_t>& v) {
  return torch::tensor(std::vector<int64_t>(v.begin(), v.end()), torch::kLong);
}

torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// One process on the whole global batches: the reference trajectory.
torch::Tensor reference(const Data& d, int64_t steps) {
  auto net = make_model();
  auto opt = make_sgd(*net);
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  for (int64_t s = 0; s < steps; ++s) {
    auto idx = as_index(sampler.indices(s, 0, 1));
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(d.x.index({idx})), d.y.index({idx}))
        .backward();
    opt.step();
  }
  return flat(*net);
}

constexpr int kDiLoCoH = 4;

DiLoCo make_diloco() {
  DiLoCo c;
  c.inner_steps = kDiLoCoH;
  // Milder than the paper's 0.7 and 0.9: a survivor trains alone for hundreds of steps until the
  // restarted rank is back, and this small problem diverges under the paper's.
  c.outer_lr = 0.5;
  c.outer_momentum = 0.5;
  c.nesterov = true;
  return c;
}

// The world from a step on: {0, launch world}, then one per recovery (a later one at the same
// step replaces an earlier).
struct Segment {
  int64_t from;
  int world;
};

// One process running the elastic DiLoCo job: a replica (model and inner optimizer) per rank,
// each stepping on its shard of the global batch; at every 4th step the outer step of
// diloco.h (the mean of global - local, Nesterov SGD into the global weights) and every replica
// goes on from the global weights. From a segment's step on the world is its size: the first
// ranks' replicas go on as they were at that (rolled-back) step, a new rank takes rank 0's.
torch::Tensor reference_diloco(const Data& d, std::vector<Segment> segments, int64_t steps) {
  struct Replica {
    torch::nn::Sequential net;
    std::unique_ptr<torch::optim::SGD> opt;
  };
  auto make_replica = [] {
    Replica r{make_model(), nullptr};
    r.opt = std::make_unique<torch::optim::SGD>(make_sgd(*r.net));
    return r;
  };
  std::vector<Replica> replicas;
  torch::Tensor global = flat(*make_model()).clone();
  torch::Tensor momentum = torch::zeros_like(global);
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  const DiLoCo c = make_diloco();
  segments.push_back({steps, 0});
  for (size_t i = 0; i + 1 < segments.size(); ++i) {
    const int world = segments[i].world;
    while (static_cast<int>(replicas.size()) > world) replicas.pop_back();
    while (static_cast<int>(replicas.size()) < world) {
      auto r = make_replica();
      if (!replicas.empty()) {
        auto from = troupe::module_state(replicas[0].net.ptr(), *replicas[0].opt);
        troupe::module_state(r.net.ptr(), *r.opt).load(from.save());
      }
      replicas.push_back(std::move(r));
    }
    for (int64_t s = segments[i].from; s < segments[i + 1].from; ++s) {
      for (int r = 0; r < world; ++r) {
        auto& rep = replicas[static_cast<size_t>(r)];
        auto idx = as_index(sampler.indices(s, r, world));
        rep.opt->zero_grad();
        torch::nn::functional::cross_entropy(rep.net->forward(d.x.index({idx})),
                                             d.y.index({idx}))
            .backward();
        rep.opt->step();
      }
      if ((s + 1) % c.inner_steps != 0) continue;
      torch::Tensor mean = torch::zeros_like(global);
      for (auto& rep : replicas) mean += global - flat(*rep.net);
      mean /= world;
      momentum.mul_(c.outer_momentum).add_(mean);
      global.sub_(mean.add(momentum, c.outer_momentum), c.outer_lr);
      for (auto& rep : replicas) {
        torch::NoGradGuard no_grad;
        int64_t at = 0;
        for (auto& p : rep.net->parameters()) {
          p.copy_(global.narrow(0, at, p.numel()).view(p.sizes()));
          at += p.numel();
        }
      }
    }
  }
  return global;
}

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
  throw comm::Error("elastic rank: algorithm '" + name + "' (expected allreduce, topk or powersgd)");
}

JobAlgorithm make_job_algorithm(const std::string& name) {
  if (name == "diloco") return make_diloco();
  if (name == "streaming-diloco") {  // refused by ElasticTrainer
    StreamingDiLoCo c;
    c.inner_steps = kDiLoCoH;
    c.fragments = 2;
    return c;
  }
  return make_algorithm(name);
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

// The DiLoCo mode: trains to `steps` (and on while the world is smaller than `until_world`),
// always ending at an outer sync; then the replicas and the reference.
int run_diloco(Runtime& rt, ElasticTrainer& trainer, torch::nn::Sequential& net,
               torch::optim::SGD& opt, const Data& d, int64_t steps, int until_world,
               int launch_world, bool restarted) {
  ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
  bool after_change = false;
  // Whether this rank was behind the source at a re-form (its outer sync failed where the
  // source's completed): it took the source's inner optimizer, which the reference does not model.
  int32_t behind = 0;
  // Once the world is whole again, two more outer syncs, so that a rank that rejoined trains:
  // every member sees the same steps() when a generation starts, so they agree on the end.
  int64_t end = steps;
  auto whole = [&] {
    if (until_world > 0 && rt.world_size() >= until_world)
      end = std::max(end, trainer.steps() + 2 * kDiLoCoH);
  };
  whole();
  while (trainer.steps() < end || trainer.steps() % kDiLoCoH != 0 ||
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
      if (trainer.steps() > before) behind = 1;
      whole();
      std::cout << "slot " << rt.slot() << " rolled back from step " << before << " to step "
                << trainer.steps() << ", world " << rt.world_size() << std::endl;
    } else if (after_change) {
      std::cout << "slot " << rt.slot() << " stepping again in generation "
                << rt.generation().number << " at unix ms " << unix_ms() << std::endl;
      after_change = false;
    }
  }
  auto mine = flat(*net);
  auto theirs = mine.clone();
  rt.comm().broadcast(theirs.data_ptr(), static_cast<size_t>(theirs.numel()),
                      comm::DataType::float32, 0);
  const bool same = torch::equal(mine, theirs);
  int32_t any_behind = behind;
  for (int r = 0; r < rt.world_size(); ++r) {
    int32_t flag = behind;
    rt.comm().broadcast(&flag, 1, comm::DataType::int32, r);
    any_behind |= flag;
  }
  std::cout << "slot " << rt.slot() << " finished " << trainer.steps() << " steps of "
            << trainer.algorithm_name() << " as rank " << rt.rank() << " of " << rt.world_size()
            << " in generation " << rt.generation().number << " after "
            << trainer.recoveries().size() << " recoveries; replicas "
            << (same ? "identical" : "DIFFER");
  double off = 0;
  if (any_behind) {
    std::cout << "; reference not compared (a member was behind the source at a re-form)";
  } else if (!restarted) {
    std::vector<Segment> segments{{0, launch_world}};
    for (auto& r : trainer.recoveries()) {
      while (!segments.empty() && segments.back().from >= r.step) segments.pop_back();
      segments.push_back({r.step, r.world_size});
    }
    off = (mine - reference_diloco(d, segments, trainer.steps())).abs().max().item<double>();
    std::cout << "; max |param - reference| = " << off;
  } else {
    std::cout << "; reference not compared (this rank joined late)";
  }
  std::cout << std::endl;
  for (auto& r : trainer.recoveries())
    std::cout << "slot " << rt.slot() << " recovery: generation " << r.generation << ", world "
              << r.world_size << ", from step " << r.step << ", " << r.seconds << " s"
              << std::endl;
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
    const bool diloco = algorithm == "diloco";
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
        const bool zero =
            residuals_zero(module_state(trainer.module(), StatePart::all), algorithm);
        std::cout << "slot " << rt.slot() << " residual after heal: "
                  << (zero ? "zero" : "NONZERO") << std::endl;
        report_shared();
      }
    }
    if (diloco) return run_diloco(rt, trainer, net, opt, d, steps, until_world, launch_world,
                                  restarted);
    // This rank's algorithm state after its last completed step: what a re-form must keep.
    std::vector<std::string> last = bucket_states(module_state(trainer.module(), StatePart::all));
    int64_t last_step = trainer.steps();
    ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
    bool after_change = false;
    while (trainer.steps() < steps ||
           (rt.world_size() < until_world && trainer.steps() < kMaxSteps)) {
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
          const bool kept =
              bucket_states(module_state(trainer.module(), StatePart::all)) == last;
          std::cout << "slot " << rt.slot() << " algorithm state after re-form: "
                    << (kept ? "kept" : "LOST") << std::endl;
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
    auto theirs = mine.clone();
    rt.comm().broadcast(theirs.data_ptr(), static_cast<size_t>(theirs.numel()),
                        comm::DataType::float32, 0);
    const bool same = torch::equal(mine, theirs);
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
