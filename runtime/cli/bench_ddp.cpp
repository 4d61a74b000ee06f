#include "runtime/cli/bench_ddp.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

#include <time.h>

#include "runtime/distributed_module.h"
#include "runtime/launch.h"

namespace troupe::cli {

namespace {

// The benchmark model of the data-parallel issue: 784-2048-2048-1024-10, ReLU (7.9M parameters).
torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(),
                               torch::nn::Linear(2048, 2048), torch::nn::ReLU(),
                               torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

struct Timing {
  double step_sec = 0;       // median step
  double wait_sec = 0;       // median time in step() waiting for reductions after backward
  double bytes_sent = 0;     // per step, this rank
  double forward_sec = 0;    // median zero_grad + forward + loss
  double backward_sec = 0;   // median loss.backward() (the buckets' hooks run inside it)
  double update_sec = 0;     // median step() or optimizer.step(), the wait included
  double helper_cpu_sec = 0; // mean CPU time per step of the threads other than the trainer's
                             // (UCX progress, CAF): communication's share of the cores
};

double cpu_sec(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Median seconds per step on this rank; with a runtime, through a DistributedModule.
Timing train(const DdpBench& bench, Runtime* rt, int rank) {
  torch::set_num_threads(1);
  torch::manual_seed(1234 + rank);
  auto model = make_mlp();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::optional<DistributedModule> ddp;
  if (rt) {
    DdpOptions o;
    o.delay_reduce = bench.delay_reduce;
    o.shared_memory = !bench.no_shared_memory;
    ddp.emplace(*rt, model.ptr(), comm::parse_compression(bench.algorithm), o);
  }
  auto x = torch::randn({bench.batch, 784});
  auto y = torch::randint(0, 10, {bench.batch}, torch::kLong);
  const int warmup = 5;
  std::vector<double> times, waits, forwards, backwards, updates;
  double bytes = 0;
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  double process_cpu0 = 0, thread_cpu0 = 0;
  for (int s = 0; s < warmup + bench.steps; ++s) {
    if (s == warmup) {
      process_cpu0 = cpu_sec(CLOCK_PROCESS_CPUTIME_ID);
      thread_cpu0 = cpu_sec(CLOCK_THREAD_CPUTIME_ID);
    }
    auto t0 = Clock::now();
    opt.zero_grad();
    auto loss = torch::nll_loss(torch::log_softmax(model->forward(x), 1), y);
    auto t1 = Clock::now();
    loss.backward();
    auto t2 = Clock::now();
    if (ddp) ddp->step(opt);
    else opt.step();
    auto t3 = Clock::now();
    if (s >= warmup) {
      times.push_back(seconds(t0, t3));
      forwards.push_back(seconds(t0, t1));
      backwards.push_back(seconds(t1, t2));
      updates.push_back(seconds(t2, t3));
      waits.push_back(ddp ? ddp->last_step().comm_wait_sec : 0.0);
      bytes = ddp ? static_cast<double>(ddp->last_step().bytes_sent) : 0.0;
    }
  }
  const double helpers = (cpu_sec(CLOCK_PROCESS_CPUTIME_ID) - process_cpu0) -
                         (cpu_sec(CLOCK_THREAD_CPUTIME_ID) - thread_cpu0);
  return Timing{median(times),     median(waits),     bytes,
                median(forwards),  median(backwards), median(updates),
                helpers / bench.steps};
}

void print(const DdpBench& bench, const Timing& t) {
  const bool alone = bench.world == 1 || bench.compute_only;
  if (bench.json)
    std::printf("{\"impl\": \"troupe\", \"algorithm\": \"%s\", \"world\": %d, \"compute_only\": "
                "%s, \"shared_memory\": %s, \"model\": \"%s\", \"batch\": %d, \"steps\": %d, \"step_sec\": %.6g, \"comm_wait_sec\": "
                "%.6g, \"bytes_sent_per_step\": %.0f, \"forward_sec\": %.6g, \"backward_sec\": "
                "%.6g, \"update_sec\": %.6g, \"helper_cpu_sec\": %.6g}\n",
                bench.algorithm.c_str(), bench.world, alone ? "true" : "false",
                bench.no_shared_memory ? "false" : "true", bench.model.c_str(), bench.batch, bench.steps, t.step_sec, t.wait_sec, t.bytes_sent, t.forward_sec, t.backward_sec,
                t.update_sec, t.helper_cpu_sec);
  else
    std::printf("troupe ddp (%s): world %d, %s, batch %d per rank, %d steps: median step %.2f ms, "
                "median wait for reductions after backward %.2f ms, %.2f MB sent per step%s; "
                "medians of forward %.2f ms, backward %.2f ms, update %.2f ms; other threads' "
                "CPU %.2f ms per step\n",
                bench.algorithm.c_str(), bench.world, bench.model.c_str(), bench.batch,
                bench.steps, t.step_sec * 1e3, t.wait_sec * 1e3, t.bytes_sent / 1e6,
                alone ? " (compute alone)" : "", t.forward_sec * 1e3,
                t.backward_sec * 1e3, t.update_sec * 1e3, t.helper_cpu_sec * 1e3);
  std::fflush(stdout);
}

void check(const DdpBench& bench) {
  if (bench.model != "mlp")
    throw comm::Error("--model '" + bench.model + "' (expected mlp)");
  if (bench.world < 1 || bench.batch < 1 || bench.steps < 1)
    throw comm::Error("--world, --batch and --steps must be >= 1 (got " +
                      std::to_string(bench.world) + ", " + std::to_string(bench.batch) + ", " +
                      std::to_string(bench.steps) + ")");
}

}  // namespace

int run_ddp_bench_rank(const DdpBench& bench) {
  check(bench);
  RuntimeOptions options;
  options.scheduler_threads = 1;
  Runtime rt(options);
  Timing t = train(bench, bench.compute_only ? nullptr : &rt, rt.rank());
  // The job's step time is the slowest rank's; so is each phase's.
  double slowest[6] = {t.step_sec,     t.wait_sec,   t.forward_sec,
                       t.backward_sec, t.update_sec, t.helper_cpu_sec};
  rt.comm().allreduce(slowest, 6, comm::DataType::float64, comm::ReduceOp::max);
  if (rt.rank() == 0)
    print(bench, Timing{slowest[0], slowest[1], t.bytes_sent, slowest[2], slowest[3], slowest[4],
                        slowest[5]});
  return 0;
}

int run_ddp_bench(const DdpBench& bench, const std::string& self_exe) {
  check(bench);
  comm::parse_compression(bench.algorithm);  // a bad --algorithm fails here, not in every rank
  if (bench.world == 1) {
    print(bench, train(bench, nullptr, 0));
    return 0;
  }
  LaunchOptions launch_options;
  launch_options.nprocs = bench.world;
  launch_options.prefix_output = false;
  launch_options.command = {self_exe, "bench", "ddp", "--as-rank", "--world",
                            std::to_string(bench.world), "--model", bench.model, "--batch",
                            std::to_string(bench.batch), "--steps", std::to_string(bench.steps)};
  if (bench.json) launch_options.command.push_back("--json");
  if (bench.delay_reduce) launch_options.command.push_back("--delay-reduce");
  if (bench.compute_only) launch_options.command.push_back("--compute-only");
  if (bench.no_shared_memory) launch_options.command.push_back("--no-shared-memory");
  launch_options.command.push_back("--algorithm");
  launch_options.command.push_back(bench.algorithm);
  auto result = launch(launch_options);
  if (result.exit_code != 0) std::cerr << "troupe bench: " << result.message << "\n";
  return result.exit_code;
}

}  // namespace troupe::cli
