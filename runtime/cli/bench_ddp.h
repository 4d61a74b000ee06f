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
  /// The bucket algorithm, as comm::parse_compression reads it ("allreduce", "powersgd:rank=2").
  std::string algorithm = "allreduce";
};

/// world 1: compute alone (no DistributedModule); world > 1: launches `world` copies of
/// `self_exe` over UCX. Returns the exit code.
int run_ddp_bench(const DdpBench& bench, const std::string& self_exe);
/// One rank of the job (the environment says which); rank 0 prints the result.
int run_ddp_bench_rank(const DdpBench& bench);

}  // namespace troupe::cli
