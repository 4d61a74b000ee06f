#pragma once
/// `troupe bench ddp`: median step time of data-parallel training of an MLP on random data.
#include <string>

namespace troupe::cli {

struct DdpBench {
  int world = 2;
  std::string model = "mlp";
  int batch = 64;
  int steps = 50;
  bool json = false;
  bool delay_reduce = false;
  /// Every rank trains alone (no DistributedModule, no reduction) while the others do the same:
  /// the baseline that leaves only the cost of data parallelism in a world > 1 figure, since
  /// `world` processes computing at once on shared cores and caches are slower than one.
  bool compute_only = false;
  /// Reduce over the transport even where all ranks share this host (DdpOptions::shared_memory
  /// off), to compare the two paths.
  bool no_shared_memory = false;
  /// Copy gradients set to none into their shared-memory buckets instead of allocating them in
  /// shared memory (DdpOptions::gradients_in_shared_memory off), to compare the two.
  bool no_gradient_arena = false;
  /// Each rank process bound to its own cores (LaunchOptions::bind_cores).
  bool bind_cores = false;
  /// In one job (world > 1), every iteration runs three kinds of step, each after a barrier and
  /// in an order that rotates with the iteration: a data-parallel step; a compute step, every rank
  /// training alone at once (no_sync, then the optimizer); and an alone step, rank 0 training
  /// while the others wait at the next barrier. The overheads are paired per iteration, so the
  /// machine's speed drifting over minutes cancels out of them.
  bool interleave = false;
  /// When set, every rank writes its Chrome trace here (DdpOptions::trace_path; "{rank}" is
  /// replaced by the rank).
  std::string trace_path;
  /// The bucket algorithm, as comm::parse_compression reads it ("allreduce", "powersgd:rank=2").
  std::string algorithm = "allreduce";
  /// Where each rank trains (rank/device.h): cpu, cuda (GPU local-rank mod the GPUs) or cuda:N.
  /// On a GPU every timed step ends with a device synchronisation.
  std::string device = "cpu";
};

/// world 1: compute alone (no DistributedModule); world > 1: launches `world` copies of
/// `self_exe` over UCX (with compute_only, they only meet to report the slowest rank). Returns the
/// exit code.
int run_ddp_bench(const DdpBench& bench, const std::string& self_exe);
/// One rank of the job (the environment says which); rank 0 prints the result.
int run_ddp_bench_rank(const DdpBench& bench);

}  // namespace troupe::cli
