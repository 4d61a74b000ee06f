#pragma once
/// `troupe bench allreduce`: time allreduce over a job of this tool's own ranks.
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"

namespace troupe::cli {

struct AllreduceBench {
  int world = 2;
  std::vector<size_t> bytes;  // each a positive multiple of 4 (float32 elements)
  std::string transport = "ucx";
  bool json = false;
  double seconds_per_size = 0.3;        // measure each size for about this long
  comm::CollectiveOptions tuning;       // thresholds and pipelining of the collectives
  std::string link;                     // link emulation of every link, e.g. "1gbit,5ms"
  std::vector<std::string> link_ranks;  // of the links to and from some ranks, "1=100mbit,20ms"
  bool bind_cores = false;              // each rank process on its own cores (ucx only)
};

/// Runs the benchmark: over inproc as threads of this process, over ucx by launching `world`
/// copies of `self_exe` with `bench allreduce --as-rank` (link emulation through TROUPE_LINK and
/// TROUPE_LINK_RANKS). Returns the exit code. Throws comm::Error, before any rank starts, when
/// `world` buffers of the largest size exceed the memory available on this host.
int run_allreduce_bench(const AllreduceBench& bench, const std::string& self_exe);
/// The body of one rank (the environment says which): prints results on rank 0.
int run_allreduce_bench_rank(const AllreduceBench& bench);

}  // namespace troupe::cli
