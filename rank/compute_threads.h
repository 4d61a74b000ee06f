#pragma once
/// Compute threads: how many BLAS and OpenMP threads each rank that a launcher starts on this host
/// computes with. torchrun's convention: with more than one rank per host, every rank gets
/// OMP_NUM_THREADS=1 unless the user set it; troupe sets OPENBLAS_NUM_THREADS=1 too, because
/// OpenBLAS's pthread build (what scripts/setup installs) otherwise starts a thread per core in
/// every rank, and torch::set_num_threads does not reach it.
#include <string>
#include <utility>
#include <vector>

#include "rank/env.h"

namespace troupe {

/// What a launcher does about compute threads, from compute_threads().
struct ComputeThreads {
  /// Variables to give every rank: OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1, each unless the
  /// user set it (OPENBLAS_NUM_THREADS also not when the user set OMP_NUM_THREADS, which OpenBLAS
  /// then follows); none with one rank.
  std::vector<std::pair<std::string, std::string>> env;
  /// The threads one rank computes with (the larger of its OpenMP and BLAS counts; each library's
  /// default is a thread per core).
  int per_rank = 1;
  /// One line saying what `env` sets, as torchrun prints; "" when it sets nothing.
  std::string notice;
  /// One line when ranks x per_rank exceed `cores`; else "".
  std::string warning;
};

/// The compute threads of `local_ranks` ranks on a host of `cores` cores, where `getenv` is the
/// environment the ranks would inherit (the launcher's with its extra variables). A thread count
/// that is not a positive integer (OMP_NUM_THREADS may be a list such as "4,2": its first entry
/// counts) is left to the libraries and counted as a thread per core.
ComputeThreads compute_threads(int local_ranks, int cores, const GetEnv& getenv);

/// The cores this process may run on (its CPU affinity), at least 1.
int available_cores();

/// Makes this process compute with `threads` threads (at least 1): torch's intra-op threads
/// (at::set_num_threads) and, where the process's BLAS is OpenBLAS, OpenBLAS's own thread pool,
/// which at::set_num_threads does not reach. Without the second, a trainer asked for one thread
/// still runs OpenBLAS's pool of a thread per core, whose workers spin between calls: on a host
/// whose cores several ranks share, that spinning takes CPU from the ranks' compute. Returns
/// OpenBLAS's thread count afterwards, or 0 where OpenBLAS is not loaded. Throws
/// std::invalid_argument for a count below 1.
int set_compute_threads(int threads);

/// OpenBLAS's thread count (openblas_get_num_threads), or 0 where OpenBLAS is not loaded.
int openblas_threads();

}  // namespace troupe
