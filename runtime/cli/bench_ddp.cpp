#include "runtime/cli/bench_ddp.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

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
};

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
    ddp.emplace(*rt, model.ptr(), comm::parse_compression(bench.algorithm), o);
  }
  auto x = torch::randn({bench.batch, 784});
  auto y = torch::randint(0, 10, {bench.batch}, torch::kLong);
  const int warmup = 5;
  std::vector<double> times, waits;
  double bytes = 0;
  for (int s = 0; s < warmup + bench.steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto loss = torch::nll_loss(torch::log_softmax(model->forward(x), 1), y);
    loss.backward();
    if (ddp) ddp->step(opt);
    else opt.step();
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) {
      times.push_back(sec);
      waits.push_back(ddp ? ddp->last_step().comm_wait_sec : 0.0);
      bytes = ddp ? static_cast<double>(ddp->last_step().bytes_sent) : 0.0;
    }
  }
  return Timing{median(times), median(waits), bytes};
}

void print(const DdpBench& bench, const Timing& t) {
  if (bench.json)
    std::printf("{\"impl\": \"troupe\", \"algorithm\": \"%s\", \"world\": %d, \"model\": "
                "\"%s\", \"batch\": %d, \"steps\": %d, \"step_sec\": %.6g, \"comm_wait_sec\": "
                "%.6g, \"bytes_sent_per_step\": %.0f}\n",
                bench.algorithm.c_str(), bench.world, bench.model.c_str(), bench.batch,
                bench.steps, t.step_sec, t.wait_sec, t.bytes_sent);
  else
    std::printf("troupe ddp (%s): world %d, %s, batch %d per rank, %d steps: median step %.2f ms, "
                "median wait for reductions after backward %.2f ms, %.2f MB sent per step%s\n",
                bench.algorithm.c_str(), bench.world, bench.model.c_str(), bench.batch,
                bench.steps, t.step_sec * 1e3, t.wait_sec * 1e3, t.bytes_sent / 1e6,
                bench.world == 1 ? " (compute alone)" : "");
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
  Timing t = train(bench, &rt, rt.rank());
  // The job's step time is the slowest rank's.
  double both[2] = {t.step_sec, t.wait_sec};
  rt.comm().allreduce(both, 2, comm::DataType::float64, comm::ReduceOp::max);
  if (rt.rank() == 0) print(bench, Timing{both[0], both[1], t.bytes_sent});
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
  launch_options.command.push_back("--algorithm");
  launch_options.command.push_back(bench.algorithm);
  auto result = launch(launch_options);
  if (result.exit_code != 0) std::cerr << "troupe bench: " << result.message << "\n";
  return result.exit_code;
}

}  // namespace troupe::cli
