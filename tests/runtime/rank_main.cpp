// troupe_test_rank: one rank of a multi-process test job, started by tests/runtime/processes_test
// through troupe::launch. The scenario is argv[1]; the exit code says whether it held.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <vector>

#include <torch/torch.h>

#include "algorithms/gossip/decentralized.h"
#include "ddp/distributed_module.h"
#include "rank/runtime.h"
#include "tests/support/collective_checks.h"
#include "tests/support/whole_batch_reference.h"

using namespace troupe;

namespace {

int collectives() {
  RuntimeOptions o;
  o.scheduler_threads = 1;
  Runtime rt(o);
  // The ranks share this host: allreduce above 64 KiB goes through shared memory (the Runtime's
  // choice), 600001 elements through several chunks of its staging region.
  const bool shared = rt.comm().uses_shared_memory();
  auto failures = test::check_collectives(rt.comm(), {0, 1, 3, 1000, 100003});
  auto large = test::check_allreduce(rt.comm(), {600001});
  failures.insert(failures.end(), large.begin(), large.end());
  // A second pass with tiny thresholds forces the pipelined ring on every size (a Communicator
  // of its own: over the transport).
  comm::CollectiveOptions ring;
  ring.small_bytes = 0;
  ring.chunk_bytes = 256;
  ring.max_lanes = 4;
  comm::Communicator forced(rt.transport(), ring, std::chrono::seconds(60));
  auto more = test::check_collectives(forced, {5, 4099});
  failures.insert(failures.end(), more.begin(), more.end());
  for (auto& f : failures) std::cerr << "rank " << rt.rank() << ": " << f << "\n";
  if (failures.empty())
    std::cout << "rank " << rt.rank() << " of " << rt.world_size() << ": every collective correct"
              << " (allreduce through shared memory: " << (shared ? "yes" : "no") << ")"
              << std::endl;
  return failures.empty() ? 0 : 1;
}

// Every rank allreduces 64 MiB several times; the last rank kills itself after the first one.
// Every survivor must end its next allreduce with an error naming that rank, well before the
// collective timeout.
int kill_one(bool shared_memory) {
  RuntimeOptions o;
  o.scheduler_threads = 1;
  o.collective_timeout = std::chrono::seconds(30);
  o.collectives.shared_memory = shared_memory;
  Runtime rt(o);
  if (rt.comm().uses_shared_memory() != shared_memory) {
    std::cerr << "rank " << rt.rank() << ": allreduce through shared memory is "
              << (shared_memory ? "off" : "on") << ", expected the opposite\n";
    return 4;
  }
  const int victim = rt.world_size() - 1;
  std::vector<float> data((64u << 20) / sizeof(float), 1.0f);
  auto start = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 50; ++i) {
      rt.comm().allreduce(data.data(), data.size(), comm::DataType::float32, comm::ReduceOp::sum);
      if (rt.rank() == victim) raise(SIGKILL);
      start = std::chrono::steady_clock::now();
    }
  } catch (const comm::Error& e) {
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string what = e.what();
    std::cout << "rank " << rt.rank() << " got after " << waited << " s: " << what << std::endl;
    bool named = what.find("rank " + std::to_string(victim)) != std::string::npos;
    if (named && waited < 20) return 0;
    std::cerr << "rank " << rt.rank() << ": error does not name rank " << victim
              << " or came too late\n";
    return 2;
  }
  std::cerr << "rank " << rt.rank() << ": every allreduce succeeded although rank " << victim
            << " was killed\n";
  return 3;
}

// Three ranks train with a DistributedModule; the last one kills itself before its third step.
// Every survivor's step must end with an error naming it, well before the stall timeout.
int ddp_kill_one() {
  torch::set_num_threads(1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  Runtime rt(o);
  const int victim = rt.world_size() - 1;
  auto model = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                                     torch::nn::Linear(256, 10));
  torch::optim::SGD opt(model->parameters(), 0.01);
  DdpOptions d;
  d.stall_timeout = std::chrono::seconds(60);
  DistributedModule ddp(rt, model.ptr(), GradientAllReduce{}, d);
  auto start = std::chrono::steady_clock::now();
  try {
    for (int step = 0; step < 20; ++step) {
      if (step == 2 && rt.rank() == victim) raise(SIGKILL);
      start = std::chrono::steady_clock::now();
      opt.zero_grad();
      model->forward(torch::randn({32, 64})).pow(2).mean().backward();
      ddp.step(opt);
    }
  } catch (const comm::Error& e) {
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string what = e.what();
    std::cout << "rank " << rt.rank() << " got after " << waited << " s: " << what << std::endl;
    if (what.find("rank " + std::to_string(victim)) != std::string::npos && waited < 20) return 0;
    return 2;
  }
  std::cerr << "rank " << rt.rank() << ": every step succeeded although rank " << victim
            << " was killed\n";
  return 3;
}

// Three ranks train with a DistributedModule; the last one meets bad data at its third step and
// gives up with an exception: naming it with Runtime::fail (`named`), or letting it unwind the
// Runtime. Every survivor's step must end at once with an error naming that rank and, when named,
// the error; the victim exits 1 through main's catch.
int ddp_fail_one(bool named) {
  torch::set_num_threads(1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  o.collective_timeout = std::chrono::seconds(30);
  Runtime rt(o);
  const int victim = rt.world_size() - 1;
  const std::string bad = "bad data in batch 2: label 11 is outside [0, 10)";
  auto model = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                                     torch::nn::Linear(256, 10));
  torch::optim::SGD opt(model->parameters(), 0.01);
  DdpOptions d;
  d.stall_timeout = std::chrono::seconds(30);
  DistributedModule ddp(rt, model.ptr(), GradientAllReduce{}, d);
  auto start = std::chrono::steady_clock::now();
  try {
    for (int step = 0; step < 20; ++step) {
      if (step == 2 && rt.rank() == victim) {
        try {
          throw std::runtime_error(bad);
        } catch (const std::exception& e) {
          if (named) rt.fail(e.what());
          throw;
        }
      }
      start = std::chrono::steady_clock::now();
      opt.zero_grad();
      model->forward(torch::randn({32, 64})).pow(2).mean().backward();
      ddp.step(opt);
    }
  } catch (const comm::Error& e) {
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string what = e.what();
    std::cout << "rank " << rt.rank() << " got after " << waited << " s: " << what << std::endl;
    const std::string expected = named ? "failed: " + bad : "failed: an exception unwound";
    if (what.find("rank " + std::to_string(victim)) != std::string::npos &&
        what.find(expected) != std::string::npos && waited < 5)
      return 0;
    return 2;
  }
  std::cerr << "rank " << rt.rank() << ": every step succeeded although rank " << victim
            << " failed\n";
  return 3;
}

// Two ranks of one host train a step together. Then rank 1 does not enter the second step's
// reduction: it waits in a broadcast from rank 0 (with its own deadline of 30 s), which rank 0
// enters only once its second step has failed. Rank 0 sets no DdpOptions::stall_timeout, so its
// step must fail at the Runtime's collective timeout (2 s; before, it waited for the default
// stall timeout of 60 s), naming the timeout and the bucket, on the shared-memory path
// (`shared_memory`) or the transport's. Exit 0 then.
int ddp_late_rank(bool shared_memory) {
  using namespace std::chrono_literals;
  torch::set_num_threads(1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  o.collective_timeout = 2000ms;
  Runtime rt(o);
  if (rt.world_size() != 2) throw std::runtime_error("ddp_late_rank runs on 2 ranks");
  auto model = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                                     torch::nn::Linear(256, 10));
  torch::optim::SGD opt(model->parameters(), 0.01);
  DdpOptions d;
  d.shared_memory = shared_memory;
  DistributedModule ddp(rt, model.ptr(), GradientAllReduce{}, d);
  const std::string path = shared_memory ? "cpu via shared memory" : "cpu";
  if (ddp.gradient_path() != path) {
    std::cerr << "rank " << rt.rank() << ": gradient path '" << ddp.gradient_path()
              << "', expected '" << path << "'\n";
    return 2;
  }
  auto train_step = [&] {
    opt.zero_grad();
    model->forward(torch::randn({32, 64})).pow(2).mean().backward();
    ddp.step(opt);
  };
  train_step();
  int64_t word = 0;
  if (rt.rank() == 1) {
    rt.comm().set_timeout(30s);
    rt.comm().broadcast(&word, 1, comm::DataType::int64, 0);
    std::cout << "rank 1: rank 0 is done with its step" << std::endl;
    return word == 7 ? 0 : 3;
  }
  const auto start = std::chrono::steady_clock::now();
  std::string what;
  try {
    train_step();
  } catch (const comm::Error& e) {
    what = e.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  word = 7;
  rt.comm().broadcast(&word, 1, comm::DataType::int64, 0);  // rank 1 may go
  std::cout << "rank 0 (" << path << ") got after " << waited << " s: " << what << std::endl;
  if (what.empty()) return 4;
  // The timeout, the bucket, and rank 1 as the one it waits for (the shared-memory reduction
  // says "ranks 1 did not contribute", the stall report "waits for rank(s) 1").
  const bool named = what.find("2000 ms") != std::string::npos &&
                     what.find("bucket 0") != std::string::npos &&
                     (what.find("ranks 1 did not contribute") != std::string::npos ||
                      what.find("waits for rank(s) 1") != std::string::npos);
  if (named && waited >= 1.95 && waited < 8) return 0;
  std::cerr << "rank 0: the step's error does not name the timeout, the bucket and rank 1, or "
               "came outside [1.95, 8) s\n";
  return 5;
}

// A ring of gossiping ranks (D-PSGD when `asynchronous` is false, AD-PSGD when true) in which the
// last rank dies at step 3: its two neighbours must drop it, log it, and every survivor must end
// all its steps. Exit 0 when that happened.
int gossip_kill_one(bool asynchronous) {
  torch::set_num_threads(1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  Runtime rt(o);
  const int victim = rt.world_size() - 1, steps = 30;
  auto model =
      torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::SGD opt(model->parameters(), 0.01);
  comm::TopologySpec ring;
  ring.kind = comm::TopologyKind::ring;
  GossipOptions g;
  g.timeout = std::chrono::seconds(30);
  std::unique_ptr<DataParallel> dp;
  if (asynchronous) {
    AsyncGossip a;
    a.topology = ring;
    a.min_interval_ms = 2;
    dp = std::make_unique<AsynchronousModule>(rt, model.ptr(), a, g);
  } else {
    Decentralized d;
    d.topology = ring;
    dp = std::make_unique<DecentralizedModule>(rt, model.ptr(), d, g);
  }
  int done = 0;
  for (int step = 0; step < steps; ++step, ++done) {
    if (step == 3 && rt.rank() == victim) raise(SIGKILL);
    opt.zero_grad();
    model->forward(torch::randn({8, 16})).pow(2).mean().backward();
    dp->step(opt);
  }
  dp->finish();
  auto dropped = dp->stats().dropped_peers;
  const bool neighbour = rt.rank() == 0 || rt.rank() == victim - 1;
  std::cout << "rank " << rt.rank() << " finished " << done << " steps; dropped:";
  for (int p : dropped) std::cout << " " << p;
  std::cout << std::endl;
  if (done != steps) return 2;
  if (neighbour && dropped != std::vector<int>{victim}) return 3;
  if (!neighbour && !dropped.empty()) return 4;
  return 0;
}

// Ranks 0, 1 pretend to be on one host and the others on another (TROUPE_HOST_NAME): the
// rendezvous must group them so, and a hierarchical allreduce must give the full sum. Exit 0 then.
int hierarchical() {
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text ? std::atoi(rank_text) : 0;
  setenv("TROUPE_HOST_NAME", rank < 2 ? "pretend-host-a" : "pretend-host-b", 1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  Runtime rt(o);
  auto hosts = host_indices(rt.hosts());
  std::vector<int> expected;
  for (int r = 0; r < rt.world_size(); ++r) expected.push_back(r < 2 ? 0 : 1);
  if (hosts != expected) {
    std::cerr << "rank " << rank << ": hosts not grouped as pretended\n";
    return 2;
  }
  const int world = rt.world_size();
  for (size_t count : {size_t{5}, size_t{300000}}) {
    std::vector<float> v(count, static_cast<float>(rank + 1));
    rt.comm().hierarchical_allreduce(v.data(), count, comm::DataType::float32, comm::ReduceOp::sum,
                                     hosts);
    const float want = static_cast<float>(world * (world + 1) / 2);
    for (float x : v)
      if (x != want) {
        std::cerr << "rank " << rank << ": got " << x << ", expected " << want << "\n";
        return 3;
      }
  }
  std::cout << "rank " << rank << " on " << rt.hosts()[static_cast<size_t>(rank)]
            << ": hierarchical allreduce correct" << std::endl;
  return 0;
}

// Every process on the one GPU of the machine, over UCX with host staging (NCCL cannot put two
// ranks on one GPU): each trains on its shard of the batch, and must end with the parameters of
// one process trained on the whole batch, which each rank computes on the CPU. Exit 0 then; a
// machine without a CUDA device exits 0 at once with "skipped" (processes_test skips before).
int cuda_staging() {
  if (!torch::cuda::is_available()) {
    std::cout << "no CUDA device: skipped" << std::endl;
    return 0;
  }
  torch::set_num_threads(1);
  RuntimeOptions o;
  o.scheduler_threads = 1;
  o.nccl = false;
  Runtime rt(o);
  DdpOptions d;
  d.bucket_bytes = 4096;  // several buckets
  d.first_bucket_bytes = 1024;
  d.stage_through_host = true;
  const auto run =
      test::train_against_whole_batch(rt, d, 16, 64, 4, 5, 11, torch::Device(torch::kCUDA, 0));
  std::cout << "rank " << rt.rank() << " (" << run.gradient_path << "): largest difference "
            << "from one process " << run.largest_difference << std::endl;
  if (run.gradient_path != "cuda via host staging") return 2;
  return run.largest_difference < 1e-4 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: troupe_test_rank collectives|kill_one|ddp_kill_one|ddp_fail_one|"
                 "ddp_throw_one|gossip_kill_one|async_gossip_kill_one|hierarchical|cuda_staging|"
                 "ddp_late_rank_shm|ddp_late_rank_transport\n";
    return 64;
  }
  try {
    if (!std::strcmp(argv[1], "collectives")) return collectives();
    if (!std::strcmp(argv[1], "kill_one")) return kill_one(true);
    if (!std::strcmp(argv[1], "kill_one_transport")) return kill_one(false);
    if (!std::strcmp(argv[1], "ddp_kill_one")) return ddp_kill_one();
    if (!std::strcmp(argv[1], "ddp_fail_one")) return ddp_fail_one(true);
    if (!std::strcmp(argv[1], "ddp_throw_one")) return ddp_fail_one(false);
    if (!std::strcmp(argv[1], "gossip_kill_one")) return gossip_kill_one(false);
    if (!std::strcmp(argv[1], "hierarchical")) return hierarchical();
    if (!std::strcmp(argv[1], "async_gossip_kill_one")) return gossip_kill_one(true);
    if (!std::strcmp(argv[1], "cuda_staging")) return cuda_staging();
    if (!std::strcmp(argv[1], "ddp_late_rank_shm")) return ddp_late_rank(true);
    if (!std::strcmp(argv[1], "ddp_late_rank_transport")) return ddp_late_rank(false);
  } catch (const std::exception& e) {
    std::cerr << "troupe_test_rank " << argv[1] << ": " << e.what() << "\n";
    return 1;
  }
  std::cerr << "troupe_test_rank: unknown scenario '" << argv[1] << "'\n";
  return 64;
}
