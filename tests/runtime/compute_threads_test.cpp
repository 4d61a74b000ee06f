// One compute thread per rank unless the user chose (torchrun's OMP_NUM_THREADS convention, and
// OPENBLAS_NUM_THREADS for OpenBLAS's pthread build), and a warning when the ranks' threads
// exceed the host's cores.
#include "rank/compute_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Env = std::vector<std::pair<std::string, std::string>>;

troupe::ComputeThreads threads_of(int ranks, int cores, std::map<std::string, std::string> vars) {
  return troupe::compute_threads(ranks, cores, [&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("several ranks get one OpenMP and one BLAS thread each, and a notice says so") {
  auto t = threads_of(4, 8, {});
  CHECK(t.env == Env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}});
  CHECK(t.per_rank == 1);
  CHECK(t.notice ==
        "setting OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1 for each of the 4 ranks on this host "
        "(one compute thread per rank, torchrun's default, so that the ranks do not overload it); "
        "set them to choose another number");
  CHECK(t.warning.empty());
}

TEST_CASE("one rank keeps the libraries' defaults, a thread per core, without a notice") {
  auto t = threads_of(1, 8, {});
  CHECK(t.env.empty());
  CHECK(t.notice.empty());
  CHECK(t.per_rank == 8);
  CHECK(t.warning.empty());
}

TEST_CASE("a thread count the user set is kept, and OpenBLAS follows the user's OMP_NUM_THREADS") {
  auto omp = threads_of(2, 8, {{"OMP_NUM_THREADS", "3"}});
  CHECK(omp.env.empty());  // OpenBLAS reads OMP_NUM_THREADS when its own is unset
  CHECK(omp.notice.empty());
  CHECK(omp.per_rank == 3);
  auto blas = threads_of(2, 8, {{"OPENBLAS_NUM_THREADS", "2"}});
  CHECK(blas.env == Env{{"OMP_NUM_THREADS", "1"}});
  CHECK(contains(blas.notice, "setting OMP_NUM_THREADS=1 for each of the 2 ranks"));
  CHECK(blas.per_rank == 2);
  auto both = threads_of(2, 8, {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "4"}});
  CHECK(both.env.empty());
  CHECK(both.per_rank == 4);
  // OpenMP's list form counts by its first entry.
  CHECK(threads_of(2, 8, {{"OMP_NUM_THREADS", "2,1"}}).per_rank == 2);
}

TEST_CASE("ranks times threads above the cores warn once, naming the numbers") {
  auto t = threads_of(4, 2, {});
  CHECK(t.warning ==
        "4 ranks x 1 compute thread = 4 threads exceed the 2 cores of this host: ranks will wait "
        "for cores and steps slow down (start fewer ranks per host)");
  auto user = threads_of(2, 4, {{"OMP_NUM_THREADS", "4"}});
  CHECK(user.warning ==
        "2 ranks x 4 compute threads = 8 threads exceed the 4 cores of this host: ranks will wait "
        "for cores and steps slow down (start fewer ranks per host, or lower "
        "OMP_NUM_THREADS/OPENBLAS_NUM_THREADS)");
  CHECK(threads_of(1, 2, {{"OPENBLAS_NUM_THREADS", "3"}}).warning ==
        "1 rank x 3 compute threads = 3 threads exceed the 2 cores of this host: ranks will wait "
        "for cores and steps slow down (start fewer ranks per host, or lower "
        "OMP_NUM_THREADS/OPENBLAS_NUM_THREADS)");
  CHECK(threads_of(2, 2, {}).warning.empty());  // exactly the cores is fine
}

TEST_CASE("an unreadable thread count is left to the library and counted as a thread per core") {
  for (const char* value : {"", "many", "0", "-2", "3x"}) {
    CAPTURE(value);
    auto t = threads_of(2, 4, {{"OMP_NUM_THREADS", value}});
    CHECK(t.env.empty());  // the user set it: not replaced
    CHECK(t.per_rank == 4);
    CHECK(contains(t.warning, "2 ranks x 4 compute threads = 8 threads exceed the 4 cores"));
  }
}

TEST_CASE("available_cores counts the cores this process may run on, no more than the host has") {
  CHECK(troupe::available_cores() >= 1);
  CHECK(troupe::available_cores() <= static_cast<int>(std::thread::hardware_concurrency()));
}

TEST_CASE("set_compute_threads reaches OpenBLAS's pool, which torch's own thread count does not") {
  auto* set_blas = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const int torch_before = at::get_num_threads(), blas_before = troupe::openblas_threads();
  if (set_blas == nullptr) {
    MESSAGE("this process's BLAS is not OpenBLAS: only torch's thread count is checked");
    CHECK(troupe::openblas_threads() == 0);
  } else {
    set_blas(2);  // OpenBLAS's default on these 2-core machines: a thread per core
    at::set_num_threads(1);
    REQUIRE(troupe::openblas_threads() == 2);  // torch's thread count leaves OpenBLAS's pool alone
  }
  CHECK(troupe::set_compute_threads(1) == (set_blas != nullptr ? 1 : 0));
  CHECK(at::get_num_threads() == 1);
  if (set_blas != nullptr) CHECK(troupe::openblas_threads() == 1);
  CHECK(troupe::set_compute_threads(3) == (set_blas != nullptr ? 3 : 0));
  CHECK(at::get_num_threads() == 3);
  CHECK_THROWS_WITH_AS(troupe::set_compute_threads(0), "compute threads 0: expected at least 1",
                       std::invalid_argument);
  at::set_num_threads(torch_before);  // as the other tests of this program expect
  if (set_blas != nullptr) set_blas(blas_before);
}
