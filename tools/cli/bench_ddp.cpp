#include "tools/cli/bench_ddp.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <vector>

#include <time.h>
#include <unistd.h>

#include "ddp/distributed_module.h"
#include "elastic/launch.h"
#include "rank/compute_threads.h"
#include "rank/device.h"
#include "tools/cli/option_checks.h"

namespace troupe::cli {

namespace {

// The benchmark model of the data-parallel issue: 784-2048-2048-1024-10, ReLU (7.9M parameters).
torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(),
                               torch::nn::Linear(2048, 2048), torch::nn::ReLU(),
                               torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

// The Fashion-MNIST CNN of examples/fashion_mnist (206,922 parameters): conv16, conv32, fc128,
// fc10 on 1x28x28 inputs.
torch::nn::Sequential make_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)), nn::ReLU(),
                        nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(32 * 7 * 7, 128),
                        nn::ReLU(), nn::Linear(128, 10));
}

struct Timing {
  double step_sec = 0;        // median step
  double wait_sec = 0;        // median time in step() waiting for reductions after backward
  double bytes_sent = 0;      // per step, this rank
  double forward_sec = 0;     // median zero_grad + forward + loss
  double backward_sec = 0;    // median loss.backward() (the buckets' hooks run inside it)
  double update_sec = 0;      // median step() or optimizer.step(), the wait included
  double helper_cpu_sec = 0;  // mean CPU time per step of the threads other than the trainer's
                              // (UCX progress, CAF): communication's share of the cores
  double rss_growth = 0;      // bytes of resident memory gained per step after the warm-up
  double peak_rss = 0;        // bytes, the process's high-water mark
};

// Resident bytes of this process now (/proc/self/statm), and its high-water mark (VmHWM).
double resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}
double peak_resident_bytes() {
  double kb = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "VmHWM: %lf kB", &kb) == 1) break;
    std::fclose(f);
  }
  return kb * 1024;
}

double cpu_sec(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// CPU seconds of the process's threads other than the calling (trainer) thread, so far.
double other_threads_cpu() {
  return cpu_sec(CLOCK_PROCESS_CPUTIME_ID) - cpu_sec(CLOCK_THREAD_CPUTIME_ID);
}

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr int kWarmup = 5;  // steps (iterations with --interleave) not measured

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

DdpOptions ddp_options(const DdpBench& bench) {
  DdpOptions o;
  o.delay_reduce = bench.delay_reduce;
  o.shared_memory = !bench.no_shared_memory;
  o.gradients_in_shared_memory = !bench.no_gradient_arena;
  o.trace_path = bench.trace_path;
  return o;
}

torch::nn::Sequential seeded_model(const std::string& name, int rank) {
  set_compute_threads(1);
  torch::manual_seed(1234 + rank);
  return name == "cnn" ? make_cnn() : make_mlp();
}

// The model on `device`, before its optimizer takes its parameters.
torch::nn::Sequential model_on(torch::nn::Sequential model, const torch::Device& device) {
  model->to(device);
  return model;
}

// One rank's training: the MLP or the CNN (one intra-op thread), SGD with momentum, one fixed
// random batch, on the bench's device.
struct Workload {
  Workload(const DdpBench& bench, int rank, int local_rank)
      : device(training_device(bench.device, local_rank)),
        model(model_on(seeded_model(bench.model, rank), device)),
        opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
        x((bench.model == "cnn" ? torch::randn({bench.batch, 1, 28, 28})
                                : torch::randn({bench.batch, 784}))
              .to(device)),
        y(torch::randint(0, 10, {bench.batch}, torch::kLong).to(device)) {}
  torch::Tensor loss() { return torch::nll_loss(torch::log_softmax(model->forward(x), 1), y); }
  // The device's queued work has completed (a GPU's kernels run after the call that queued them).
  void finish_device_work() const {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  }

  torch::Device device;
  torch::nn::Sequential model;
  torch::optim::SGD opt;
  torch::Tensor x, y;
};

// Median seconds per step on this rank; with a runtime, through a DistributedModule.
Timing train(const DdpBench& bench, Runtime* rt, int rank) {
  Workload w(bench, rank, rt ? rt->local_rank() : 0);
  std::optional<DistributedModule> ddp;
  if (rt)
    ddp.emplace(*rt, w.model.ptr(), comm::parse_compression(bench.algorithm), ddp_options(bench));
  std::vector<double> times, waits, forwards, backwards, updates;
  double bytes = 0;
  double helpers0 = 0, rss0 = 0;
  for (int s = 0; s < kWarmup + bench.steps; ++s) {
    if (s == kWarmup) {
      helpers0 = other_threads_cpu();
      rss0 = resident_bytes();
    }
    auto t0 = Clock::now();
    w.opt.zero_grad();
    auto loss = w.loss();
    auto t1 = Clock::now();
    loss.backward();
    auto t2 = Clock::now();
    if (ddp)
      ddp->step(w.opt);
    else
      w.opt.step();
    w.finish_device_work();
    auto t3 = Clock::now();
    if (s >= kWarmup) {
      times.push_back(seconds(t0, t3));
      forwards.push_back(seconds(t0, t1));
      backwards.push_back(seconds(t1, t2));
      updates.push_back(seconds(t2, t3));
      waits.push_back(ddp ? ddp->last_step().comm_wait_sec : 0.0);
      bytes = ddp ? static_cast<double>(ddp->last_step().bytes_sent) : 0.0;
    }
  }
  return Timing{median(times),
                median(waits),
                bytes,
                median(forwards),
                median(backwards),
                median(updates),
                (other_threads_cpu() - helpers0) / bench.steps,
                (resident_bytes() - rss0) / bench.steps,
                peak_resident_bytes()};
}

// --interleave: what each kind of step took in each iteration, the slowest rank's.
struct Interleaved {
  std::vector<double> dp;       // data-parallel step
  std::vector<double> compute;  // every rank training alone at once
  std::vector<double> alone;    // rank 0 training while the others wait
  std::vector<double> wait;     // the data-parallel step's wait after backward
  std::vector<double> dp_backward, compute_backward;  // loss.backward() alone
  double dp_helper_cpu = 0;                           // other threads' CPU per data-parallel step
  double compute_helper_cpu = 0;
  double bytes_sent = 0;
  double gradient_bytes_copied = 0;  // per data-parallel step, this rank
  std::string gradient_path;         // DistributedModule::gradient_path()
};

Interleaved train_interleaved(const DdpBench& bench, Runtime& rt) {
  Workload w(bench, rt.rank(), rt.local_rank());
  DistributedModule ddp(rt, w.model.ptr(), comm::parse_compression(bench.algorithm),
                        ddp_options(bench));
  Interleaved r;
  r.gradient_path = ddp.gradient_path();

  enum Kind { kDp, kCompute, kAlone };
  struct Measured {
    double sec = 0, backward = 0, helper_cpu = 0;
  };
  auto run = [&](Kind kind) {
    rt.comm().barrier();
    // In an alone step the other ranks go on to the next barrier and wait there.
    if (kind == kAlone && rt.rank() != 0) return Measured{};
    const double helpers0 = other_threads_cpu();
    const auto t0 = Clock::now();
    w.opt.zero_grad();
    Clock::time_point t1, t2;
    {
      std::optional<DistributedModule::NoSync> local;
      if (kind != kDp) local.emplace(ddp.no_sync());
      auto loss = w.loss();
      t1 = Clock::now();
      loss.backward();
      t2 = Clock::now();
    }
    if (kind == kDp)
      ddp.step(w.opt);
    else
      w.opt.step();
    w.finish_device_work();
    const auto t3 = Clock::now();
    return Measured{seconds(t0, t3), seconds(t1, t2), other_threads_cpu() - helpers0};
  };

  // The first data-parallel step (warm-up) rebuilds the buckets.
  for (int i = 0; i < kWarmup + bench.steps; ++i) {
    for (int k = 0; k < 3; ++k) {
      const auto kind = static_cast<Kind>((i + k) % 3);
      const Measured m = run(kind);
      if (i < kWarmup) continue;
      if (kind == kDp) {
        r.dp.push_back(m.sec);
        r.wait.push_back(ddp.last_step().comm_wait_sec);
        r.dp_backward.push_back(m.backward);
        r.dp_helper_cpu += m.helper_cpu / bench.steps;
        r.bytes_sent = static_cast<double>(ddp.last_step().bytes_sent);
        r.gradient_bytes_copied = static_cast<double>(ddp.last_step().gradient_bytes_copied);
      } else if (kind == kCompute) {
        r.compute.push_back(m.sec);
        r.compute_backward.push_back(m.backward);
        r.compute_helper_cpu += m.helper_cpu / bench.steps;
      } else {
        r.alone.push_back(m.sec);
      }
    }
  }
  // Each iteration's figures become the slowest rank's (the alone step's are rank 0's: the
  // others report 0).
  const auto series = {&r.dp, &r.compute, &r.alone, &r.wait, &r.dp_backward, &r.compute_backward};
  std::vector<double> all;
  for (auto* v : series) all.insert(all.end(), v->begin(), v->end());
  all.push_back(r.dp_helper_cpu);
  all.push_back(r.compute_helper_cpu);
  rt.comm().allreduce(all.data(), all.size(), comm::DataType::float64, comm::ReduceOp::max);
  size_t at = 0;
  for (auto* v : series)
    for (auto& value : *v) value = all[at++];
  r.dp_helper_cpu = all[at++];
  r.compute_helper_cpu = all[at];
  return r;
}

// The median over iterations of a / b - 1.
double paired_overhead(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < a.size(); ++i) ratios.push_back(a[i] / b[i] - 1);
  return median(ratios);
}

void print_interleaved(const DdpBench& bench, const Interleaved& r) {
  const double dp = median(r.dp), compute = median(r.compute), alone = median(r.alone);
  const double vs_alone = paired_overhead(r.dp, r.alone);
  const double vs_compute = paired_overhead(r.dp, r.compute);
  if (bench.json)
    std::printf(
        "{\"impl\": \"troupe\", \"algorithm\": \"%s\", \"world\": %d, "
        "\"interleave\": true, \"shared_memory\": %s, \"model\": \"%s\", \"batch\": %d, "
        "\"steps\": %d, \"step_sec\": %.6g, \"compute_step_sec\": %.6g, "
        "\"alone_step_sec\": %.6g, \"overhead_vs_alone\": %.6g, "
        "\"overhead_vs_compute\": %.6g, \"comm_wait_sec\": %.6g, "
        "\"bytes_sent_per_step\": %.0f, \"helper_cpu_sec\": %.6g, "
        "\"compute_helper_cpu_sec\": %.6g, \"backward_sec\": %.6g, "
        "\"compute_backward_sec\": %.6g, \"gradient_arena\": %s, "
        "\"gradient_bytes_copied_per_step\": %.0f, \"device\": \"%s\", "
        "\"gradient_path\": \"%s\"}\n",
        bench.algorithm.c_str(), bench.world, bench.no_shared_memory ? "false" : "true",
        bench.model.c_str(), bench.batch, bench.steps, dp, compute, alone, vs_alone, vs_compute,
        median(r.wait), r.bytes_sent, r.dp_helper_cpu, r.compute_helper_cpu, median(r.dp_backward),
        median(r.compute_backward), bench.no_gradient_arena ? "false" : "true",
        r.gradient_bytes_copied, bench.device.c_str(), r.gradient_path.c_str());
  else
    std::printf(
        "troupe ddp (%s), interleaved: world %d, %s, batch %d per rank, %d iterations: "
        "median step %.2f ms data-parallel, %.2f ms every rank computing alone, %.2f ms "
        "rank 0 alone; paired per iteration, data parallelism costs %+.1f%% over rank 0 "
        "alone and %+.1f%% over every rank computing alone; median wait after backward "
        "%.2f ms, %.2f MB sent per step, %.2f MB of gradients copied into the buckets per "
        "step, other threads' CPU %.2f ms per data-parallel step (%.2f ms per compute step)\n",
        bench.algorithm.c_str(), bench.world, bench.model.c_str(), bench.batch, bench.steps,
        dp * 1e3, compute * 1e3, alone * 1e3, vs_alone * 100, vs_compute * 100,
        median(r.wait) * 1e3, r.bytes_sent / 1e6, r.gradient_bytes_copied / 1e6,
        r.dp_helper_cpu * 1e3, r.compute_helper_cpu * 1e3);
  std::fflush(stdout);
}

void print(const DdpBench& bench, const Timing& t) {
  const bool alone = bench.world == 1 || bench.compute_only;
  if (bench.json)
    std::printf(
        "{\"impl\": \"troupe\", \"algorithm\": \"%s\", \"world\": %d, \"compute_only\": "
        "%s, \"shared_memory\": %s, \"model\": \"%s\", \"batch\": %d, \"steps\": %d, "
        "\"step_sec\": %.6g, \"comm_wait_sec\": "
        "%.6g, \"bytes_sent_per_step\": %.0f, \"forward_sec\": %.6g, \"backward_sec\": "
        "%.6g, \"update_sec\": %.6g, \"helper_cpu_sec\": %.6g, "
        "\"rss_growth_per_step\": %.0f, \"peak_rss_bytes\": %.0f, \"device\": \"%s\"}\n",
        bench.algorithm.c_str(), bench.world, alone ? "true" : "false",
        bench.no_shared_memory ? "false" : "true", bench.model.c_str(), bench.batch, bench.steps,
        t.step_sec, t.wait_sec, t.bytes_sent, t.forward_sec, t.backward_sec, t.update_sec,
        t.helper_cpu_sec, t.rss_growth, t.peak_rss, bench.device.c_str());
  else
    std::printf(
        "troupe ddp (%s): world %d, %s, batch %d per rank, %d steps: median step %.2f ms, "
        "median wait for reductions after backward %.2f ms, %.2f MB sent per step%s; "
        "medians of forward %.2f ms, backward %.2f ms, update %.2f ms; other threads' "
        "CPU %.2f ms per step\n",
        bench.algorithm.c_str(), bench.world, bench.model.c_str(), bench.batch, bench.steps,
        t.step_sec * 1e3, t.wait_sec * 1e3, t.bytes_sent / 1e6, alone ? " (compute alone)" : "",
        t.forward_sec * 1e3, t.backward_sec * 1e3, t.update_sec * 1e3, t.helper_cpu_sec * 1e3);
  std::fflush(stdout);
}

void check(const DdpBench& bench) {
  if (bench.model != "mlp" && bench.model != "cnn")
    throw comm::Error("--model '" + bench.model + "' (expected mlp or cnn)");
  if (const std::string why = check_device_name(bench.device); !why.empty())
    throw comm::Error("--device " + why);
  if (bench.world < 1 || bench.batch < 1 || bench.steps < 1)
    throw comm::Error("--world, --batch and --steps must be >= 1 (got " +
                      std::to_string(bench.world) + ", " + std::to_string(bench.batch) + ", " +
                      std::to_string(bench.steps) + ")");
  // Each rank holds its batch of inputs and the activations of every layer (784, 2048, 2048, 1024
  // and 10 floats per image), and all ranks run on this host: refuse a batch that cannot fit
  // before a rank starts (a lower bound: gradients and buffers come on top).
  const uint64_t per_image = (784 + 2048 + 2048 + 1024 + 10) * sizeof(float);
  check_memory(
      static_cast<uint64_t>(bench.batch) * per_image * static_cast<uint64_t>(bench.world),
      available_memory(),
      "--batch " + std::to_string(bench.batch) + " on " + std::to_string(bench.world) + " rank(s)");
  if (bench.interleave && (bench.world < 2 || bench.compute_only))
    throw comm::Error("--interleave needs --world >= 2 and no --compute-only (got --world " +
                      std::to_string(bench.world) +
                      (bench.compute_only ? " with --compute-only)" : ")"));
}

}  // namespace

int run_ddp_bench_rank(const DdpBench& bench) {
  check(bench);
  RuntimeOptions options;
  options.scheduler_threads = 1;
  Runtime rt(options);
  if (bench.interleave) {
    const Interleaved r = train_interleaved(bench, rt);
    if (rt.rank() == 0) print_interleaved(bench, r);
    return 0;
  }
  Timing t = train(bench, bench.compute_only ? nullptr : &rt, rt.rank());
  // The job's step time is the slowest rank's; so is each phase's, and the memory is the
  // largest rank's.
  double slowest[8] = {t.step_sec,   t.wait_sec,       t.forward_sec, t.backward_sec,
                       t.update_sec, t.helper_cpu_sec, t.rss_growth,  t.peak_rss};
  rt.comm().allreduce(slowest, 8, comm::DataType::float64, comm::ReduceOp::max);
  if (rt.rank() == 0)
    print(bench, Timing{slowest[0], slowest[1], t.bytes_sent, slowest[2], slowest[3], slowest[4],
                        slowest[5], slowest[6], slowest[7]});
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
  launch_options.bind_cores = bench.bind_cores;
  launch_options.command = {self_exe,  "bench",
                            "ddp",     "--as-rank",
                            "--world", std::to_string(bench.world),
                            "--model", bench.model,
                            "--batch", std::to_string(bench.batch),
                            "--steps", std::to_string(bench.steps)};
  if (bench.json) launch_options.command.push_back("--json");
  if (bench.delay_reduce) launch_options.command.push_back("--delay-reduce");
  if (bench.compute_only) launch_options.command.push_back("--compute-only");
  if (bench.no_shared_memory) launch_options.command.push_back("--no-shared-memory");
  if (bench.no_gradient_arena) launch_options.command.push_back("--no-gradient-arena");
  if (bench.interleave) launch_options.command.push_back("--interleave");
  if (!bench.trace_path.empty()) {
    launch_options.command.push_back("--trace");
    launch_options.command.push_back(bench.trace_path);
  }
  launch_options.command.push_back("--algorithm");
  launch_options.command.push_back(bench.algorithm);
  launch_options.command.push_back("--device");
  launch_options.command.push_back(bench.device);
  auto result = launch(launch_options);
  if (result.exit_code != 0) std::cerr << "troupe bench: " << result.message << "\n";
  return result.exit_code;
}

}  // namespace troupe::cli
