// build/bin/troupe: launch a job, print versions, run benchmarks.
#include <torch/version.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <climits>
#include <iostream>
#include <limits>

#include "actors/node.h"
#include "comm/transport/ucx/transport.h"
#include "elastic/launch.h"
#include "rank/env.h"
#include "rank/host_identity.h"
#include "tools/cli/bench_allreduce.h"
#include "tools/cli/bench_ddp.h"
#include "tools/cli/option_checks.h"
#include "tools/job_config.h"
#ifdef TROUPE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda/reduce.h"
#endif
#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/library.h"
#endif

namespace {

std::string self_exe(const char* argv0) {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return argv0;
  buf[n] = 0;
  return buf;
}

// `troupe run job.toml`: checks the whole job file, then starts its trainer with `--job FILE` —
// world_size processes through launch(), or one process whose ranks are threads. A rank process
// that dies stops the others unless the algorithm tolerates dead ranks (gossip).
int run_job(const std::string& path, const std::string& self) {
  auto job = troupe::load_job_config(path);
  std::string program = job.trainer.program;
  if (program.find('/') == std::string::npos) {
    // Beside the troupe binary first (build/bin/fashion_mnist), then in PATH.
    std::string beside = self.substr(0, self.rfind('/') + 1) + program;
    if (access(beside.c_str(), X_OK) == 0) program = beside;
  }
  const bool processes = job.mode == troupe::JobConfig::Mode::processes;
  std::cout << "troupe run: " << path << ": " << job.world_size << " rank(s) as "
            << (processes ? "processes" : "threads") << ", "
            << troupe::job_algorithm_name(job.algorithm) << ", " << program << std::endl;
  troupe::LaunchOptions launch;
  launch.nprocs = processes ? job.world_size : 1;
  launch.command = {program, "--job", path};
  launch.timeout_sec = job.timeout_sec;
  launch.prefix_output = processes;
  // Gossip survives a dead neighbour: stopping the other ranks would defeat that.
  launch.stop_on_failure = !troupe::tolerates_dead_ranks(job.algorithm);
  auto result = troupe::launch(launch);
  if (result.exit_code != 0) std::cerr << "troupe run: " << result.message << "\n";
  return result.exit_code;
}

void print_info() {
  std::cout << "troupe " << TROUPE_VERSION << "\n";
  std::cout << "CAF " << troupe::actors::caf_version() << "\n";
  std::cout << "UCX " << troupe::comm::UcxTransport::version()
            << " (transports: " << troupe::comm::UcxTransport::available_transports() << ")\n";
  std::cout << "LibTorch " << TORCH_VERSION << "\n";
  // What decides which ranks share memory (rank/host_identity.h); each rank of a job logs the
  // path it took to every peer at start.
  std::cout << "this host: " << troupe::machine_identity() << "\n";
#ifdef TROUPE_HAVE_CUDA
#ifdef TROUPE_HAVE_NCCL
  // troupe loads NCCL on first use; `info` loads it to say which one a job would get.
  auto loaded_nccl = []() -> std::string {
    try {
      const auto& nccl = troupe::comm::nccl_library();
      int version = 0;
      nccl.GetVersion(&version);
      return "loaded on first use: " + std::to_string(version / 10000) + "." +
             std::to_string(version / 100 % 100) + "." + std::to_string(version % 100) + " from " +
             nccl.file;
    } catch (const troupe::comm::Error& e) {
      return std::string("none loads: ") + e.what();
    }
  };
#endif
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  std::cout << "CUDA runtime " << runtime / 1000 << "." << (runtime % 1000) / 10
#ifdef TROUPE_HAVE_NCCL
            << ", NCCL " << NCCL_MAJOR << "." << NCCL_MINOR << "." << NCCL_PATCH << " (compiled; "
            << loaded_nccl() << ")"
#else
            << ", NCCL not built"
#endif
            << ", GPU " << (troupe::cuda::device_available() ? "available" : "not found") << "\n";
#else
  std::cout << "CUDA not built (-DTROUPE_WITH_CUDA=OFF or nvcc not found)\n";
#endif
}

/// `troupe launch`: its options set `launch`, and the links to emulate `link` and `link_ranks`.
CLI::App* add_launch_command(CLI::App& app, troupe::LaunchOptions& launch, std::string& link,
                             std::vector<std::string>& link_ranks) {
  auto* launch_cmd = app.add_subcommand(
      "launch", "Start N local processes as the ranks of a job (on each of --nnodes hosts)");
  launch_cmd->add_option("-n,--nprocs", launch.nprocs, "Number of processes on this host")
      ->required()
      ->check(troupe::cli::integer_in(1, troupe::kMaxLocalRanks));
  launch_cmd
      ->add_option("--nnodes", launch.nnodes,
                   "Number of hosts, each running troupe launch with the same -n, "
                   "--master-addr and --master-port")
      ->check(troupe::cli::integer_in(1, troupe::kMaxWorldSize));
  launch_cmd
      ->add_option("--node-rank", launch.node_rank,
                   "This host's place, 0..nnodes-1: it starts ranks node_rank*n .. "
                   "node_rank*n+n-1")
      ->check(troupe::cli::integer_in(0, troupe::kMaxWorldSize - 1));
  launch_cmd->add_option("--master-addr", launch.master_addr,
                         "Rendezvous address: node 0's (default 127.0.0.1 with one host)");
  launch_cmd
      ->add_option("--master-port", launch.master_port,
                   "Rendezvous port (0: a free one with one host, 29500 with several)")
      ->check(troupe::cli::integer_in(0, 65535));
  launch_cmd->add_option("--timeout", launch.timeout_sec, "Stop every rank after this many seconds")
      ->check(troupe::cli::number_at_least(0));
  launch_cmd->add_flag("!--no-prefix", launch.prefix_output,
                       "Do not prefix output lines with the rank");
  launch_cmd->add_flag("!--keep-going", launch.stop_on_failure,
                       "When a rank fails, let the others run on (for algorithms that tolerate a "
                       "dead rank); the exit status still says that one failed");
  launch_cmd->add_flag("--elastic", launch.elastic,
                       "Elastic job: a dead rank does not stop the others, which re-form and go "
                       "on; node 0's launcher hosts the membership service (with --nnodes > 1 at "
                       "--master-addr:--master-port, where the other nodes' launchers connect)");
  launch_cmd->add_option("--min-ranks", launch.min_ranks,
                         "Elastic: the fewest ranks the job trains with (default 1)");
  launch_cmd->add_option("--max-restarts", launch.max_restarts,
                         "Elastic: restart dead ranks in their slot, this many times in all (per "
                         "node: each node's launcher restarts its own ranks)");
  launch_cmd->add_option("--job-id", launch.job_id,
                         "The job's identity, the same on every node (default: TROUPE_JOB_ID; one "
                         "made per launch with one node): the rendezvous and the elastic "
                         "membership admit only processes of this job");
  launch_cmd->add_flag("--bind-cores", launch.bind_cores,
                       "Bind each process to its own share of this host's cores (slot s of S "
                       "gets cores s*C/S .. (s+1)*C/S-1 of the C the launcher may use)");
  launch_cmd->add_option("--membership-timeout", launch.membership_timeout_sec,
                         "Elastic: seconds a new generation waits for its members (default 30)");
  launch_cmd->add_option("--spares", launch.spares,
                         "Elastic: start this many spare processes that wait, past their "
                         "start-up, to take a dead rank's place at once (default 0; per node: "
                         "each node's launcher runs its own)");
  launch_cmd->add_option("--link", link,
                         "Emulate every link at a bandwidth and latency, e.g. 1gbit,5ms "
                         "(sets TROUPE_LINK)");
  launch_cmd
      ->add_option("--link-rank", link_ranks,
                   "Emulate the links to and from one rank, e.g. 3=100mbit,20ms; "
                   "repeatable (sets TROUPE_LINK_RANKS)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  launch_cmd->add_option("command", launch.command, "Program and its arguments (after --)")
      ->required();
  return launch_cmd;
}

/// `troupe bench allreduce`: `sizes` is --bytes as written, `as_rank` whether this process is one
/// rank of the benchmark job.
CLI::App* add_allreduce_bench(CLI::App& bench_cmd, troupe::cli::AllreduceBench& bench,
                              std::string& sizes, bool& as_rank) {
  auto* bench_ar = bench_cmd.add_subcommand("allreduce", "Time allreduce per message size");
  bench_ar->add_option("--world", bench.world, "Number of ranks")
      ->check(troupe::cli::integer_in(1, 1024));
  bench_ar->add_option("--bytes", sizes, "Comma-separated sizes, e.g. 4KiB,1MiB,64MiB");
  bench_ar->add_option("--transport", bench.transport, "ucx or inproc")
      ->check(CLI::IsMember({"ucx", "inproc"}));
  bench_ar->add_option("--seconds", bench.seconds_per_size, "Measuring time per size")
      ->check(troupe::cli::number_in(0.001, 3600));
  bench_ar->add_flag("--json", bench.json, "One JSON object per line");
  bench_ar
      ->add_option("--small-bytes", bench.tuning.small_bytes,
                   "Up to this size: latency-optimal algorithms")
      ->check(troupe::cli::integer_in(0, std::numeric_limits<long long>::max()));
  bench_ar
      ->add_option("--chunk-bytes", bench.tuning.chunk_bytes,
                   "Pipeline chunk of the ring (default: 512 KiB on one host, 8 MiB across "
                   "hosts)")
      ->check(troupe::cli::integer_in(1, std::numeric_limits<long long>::max()));
  bench_ar->add_option("--max-lanes", bench.tuning.max_lanes, "Chunks in flight per collective")
      ->check(troupe::cli::integer_in(1, 1024));
  bench_ar->add_flag("!--no-shared-memory", bench.tuning.shared_memory,
                     "On one host: allreduce over the transport (UCX shared memory through its "
                     "progress thread), not through troupe's own shared memory");
  bench_ar->add_flag("--bind-cores", bench.bind_cores,
                     "Bind each rank process to its own share of the cores (--transport ucx)");
  bench_ar->add_option("--link", bench.link,
                       "Emulate every link at a bandwidth and latency, e.g. 1gbit,5ms");
  bench_ar
      ->add_option("--link-rank", bench.link_ranks,
                   "Emulate the links to and from one rank, e.g. 1=100mbit,20ms; repeatable")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  bench_ar->add_flag("--as-rank", as_rank, "Internal: run as one rank of the benchmark job")
      ->group("");
  return bench_ar;
}

/// `troupe bench ddp`: `as_rank` whether this process is one rank of the benchmark job.
CLI::App* add_ddp_bench(CLI::App& bench_cmd, troupe::cli::DdpBench& ddp, bool& as_rank) {
  auto* bench_ddp = bench_cmd.add_subcommand("ddp", "Median step time of data-parallel training");
  bench_ddp->add_option("--world", ddp.world, "Number of ranks (1: compute alone)")
      ->check(troupe::cli::integer_in(1, 1024));
  bench_ddp->add_option("--model", ddp.model,
                        "mlp (784-2048-2048-1024-10) or cnn (Fashion-MNIST's: conv16, conv32, "
                        "fc128, fc10)");
  bench_ddp->add_option("--batch", ddp.batch, "Batch per rank")
      ->check(troupe::cli::integer_in(1, std::numeric_limits<int>::max()));
  bench_ddp->add_option("--steps", ddp.steps, "Measured steps")
      ->check(troupe::cli::integer_in(1, std::numeric_limits<int>::max()));
  bench_ddp->add_flag("--json", ddp.json, "One JSON object");
  bench_ddp->add_flag("--delay-reduce", ddp.delay_reduce, "Reduce after backward (no overlap)");
  bench_ddp->add_flag("--compute-only", ddp.compute_only,
                      "Every rank trains alone, no reduction (the baseline for --world > 1)");
  bench_ddp->add_flag("--no-shared-memory", ddp.no_shared_memory,
                      "Reduce over the transport even on one host (DdpOptions::shared_memory off)");
  bench_ddp->add_flag("--no-gradient-arena", ddp.no_gradient_arena,
                      "Copy gradients set to none into the shared-memory buckets instead of "
                      "allocating them there (DdpOptions::gradients_in_shared_memory off)");
  bench_ddp->add_flag("--bind-cores", ddp.bind_cores,
                      "Bind each rank process to its own share of the cores");
  bench_ddp->add_flag("--interleave", ddp.interleave,
                      "Alternate data-parallel, compute-only and rank-0-alone steps in one job "
                      "and pair them per iteration (--world > 1)");
  bench_ddp->add_option("--trace", ddp.trace_path,
                        "Write each rank's Chrome trace (Perfetto) here; {rank} is the rank");
  bench_ddp->add_option("--algorithm", ddp.algorithm,
                        "allreduce, fp16, bf16, bytegrad, sign, sign-vote, topk, randomk, blockk "
                        "or powersgd, with settings: powersgd:rank=2,start_iter=10");
  bench_ddp->add_option("--device", ddp.device,
                        "cpu, cuda (each rank on GPU local-rank mod the GPUs it sees) or cuda:N");
  bench_ddp->add_flag("--as-rank", as_rank, "Internal: run as one rank")->group("");
  return bench_ddp;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe: an actor runtime for communication-efficient data-parallel training"};
  app.require_subcommand(1);

  troupe::LaunchOptions launch;
  std::string link;
  std::vector<std::string> link_ranks;
  auto* launch_cmd = add_launch_command(app, launch, link, link_ranks);

  auto* run_cmd =
      app.add_subcommand("run", "Run the training job of a TOML file (examples/configs/ has some)");
  std::string job_path;
  run_cmd->add_option("job", job_path, "The job file")->required();

  app.add_subcommand("info", "Print the versions of troupe and its dependencies");

  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  troupe::cli::AllreduceBench bench;
  std::string sizes = "4KiB,1MiB,64MiB";
  bool as_rank = false;
  auto* bench_ar = add_allreduce_bench(*bench_cmd, bench, sizes, as_rank);
  troupe::cli::DdpBench ddp;
  bool ddp_as_rank = false;
  auto* bench_ddp = add_ddp_bench(*bench_cmd, ddp, ddp_as_rank);

  CLI11_PARSE(app, argc, argv);
  try {
    if (*launch_cmd) {
      for (auto& var : troupe::link_emulation_env(link, link_ranks, launch.nnodes * launch.nprocs))
        launch.extra_env.push_back(var);
      auto result = troupe::launch(launch);
      if (result.exit_code != 0) std::cerr << "troupe launch: " << result.message << "\n";
      return result.exit_code;
    }
    if (*run_cmd) return run_job(job_path, self_exe(argv[0]));
    if (app.got_subcommand("info")) {
      print_info();
      return 0;
    }
    if (*bench_ddp) {
      if (ddp_as_rank) return troupe::cli::run_ddp_bench_rank(ddp);
      return troupe::cli::run_ddp_bench(ddp, self_exe(argv[0]));
    }
    if (*bench_ar) {
      bench.bytes = troupe::cli::parse_byte_sizes(sizes, sizeof(float));
      if (as_rank) return troupe::cli::run_allreduce_bench_rank(bench);
      return troupe::cli::run_allreduce_bench(bench, self_exe(argv[0]));
    }
  } catch (const std::exception& e) {
    std::cerr << "troupe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
