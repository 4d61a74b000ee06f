#include "rank/compute_threads.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace troupe {
namespace {

constexpr const char* kOmp = "OMP_NUM_THREADS";
constexpr const char* kOpenBlas = "OPENBLAS_NUM_THREADS";

/// The count a library reads from `value` (for OpenMP, the first entry of a list), or 0 when it
/// is not a positive integer.
int thread_count(const char* value) {
  if (value == nullptr) return 0;
  char* end = nullptr;
  long count = std::strtol(value, &end, 10);
  if (end == value || (*end != '\0' && *end != ',') || count < 1 || count > 1 << 20) return 0;
  return static_cast<int>(count);
}

/// OpenBLAS's entry points, looked up in the process rather than linked: the BLAS is whatever
/// libblas.so.3 the system's alternatives chose (reference BLAS, OpenBLAS, BLIS...). First in the
/// global scope (a program linked with LibTorch), then in a libblas.so.3 already loaded without
/// it (LibTorch opened with RTLD_LOCAL, as a plugin may); never loads a library itself.
template <typename Function>
Function* openblas_function(const char* name) {
  if (void* found = dlsym(RTLD_DEFAULT, name)) return reinterpret_cast<Function*>(found);
  void* blas = dlopen("libblas.so.3", RTLD_LAZY | RTLD_NOLOAD);
  if (blas == nullptr) return nullptr;
  void* found = dlsym(blas, name);
  dlclose(blas);  // drops the reference NOLOAD took; the library stays loaded
  return reinterpret_cast<Function*>(found);
}

}  // namespace

int openblas_threads() {
  auto* get = openblas_function<int()>("openblas_get_num_threads");
  return get != nullptr ? get() : 0;
}

int set_compute_threads(int threads) {
  if (threads < 1)
    throw std::invalid_argument("compute threads " + std::to_string(threads) +
                                ": expected at least 1");
  at::set_num_threads(threads);
  if (auto* set = openblas_function<void(int)>("openblas_set_num_threads")) set(threads);
  return openblas_threads();
}

ComputeThreads compute_threads(int local_ranks, int cores, const GetEnv& getenv) {
  ComputeThreads threads;
  const char* omp = getenv(kOmp);
  const char* openblas = getenv(kOpenBlas);
  std::string names;
  if (local_ranks > 1) {
    if (omp == nullptr) threads.env.emplace_back(kOmp, "1");
    if (omp == nullptr && openblas == nullptr) threads.env.emplace_back(kOpenBlas, "1");
    for (const auto& [name, value] : threads.env)
      names += (names.empty() ? "" : " and ") + name + "=" + value;
  }
  if (!names.empty()) {
    threads.notice = "setting " + names + " for each of the " + std::to_string(local_ranks) +
                     " ranks on this host (one compute thread per rank, torchrun's default, so "
                     "that the ranks do not overload it); set them to choose another number";
  }
  // What each library will use: its variable, else OpenBLAS follows OpenMP's, else a thread per
  // core.
  const int omp_threads = omp != nullptr ? thread_count(omp) : (local_ranks > 1 ? 1 : 0);
  int blas_threads = openblas != nullptr ? thread_count(openblas) : omp_threads;
  threads.per_rank =
      std::max(omp_threads > 0 ? omp_threads : cores, blas_threads > 0 ? blas_threads : cores);
  const long long total = static_cast<long long>(local_ranks) * threads.per_rank;
  if (total > cores) {
    threads.warning =
        std::to_string(local_ranks) + (local_ranks == 1 ? " rank" : " ranks") + " x " +
        std::to_string(threads.per_rank) + " compute thread" + (threads.per_rank == 1 ? "" : "s") +
        " = " + std::to_string(total) + " threads exceed the " + std::to_string(cores) + " core" +
        (cores == 1 ? "" : "s") +
        " of this host: ranks will wait for cores and steps slow down (start fewer "
        "ranks per host" +
        (threads.per_rank > 1 ? ", or lower OMP_NUM_THREADS/OPENBLAS_NUM_THREADS" : "") + ")";
  }
  return threads;
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

}  // namespace troupe
