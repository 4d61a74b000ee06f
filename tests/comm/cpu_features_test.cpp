// CPU features: measured once, and what the compiler's own check and the kernel's flags say.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "comm/cpu_features.h"

using namespace troupe::comm;

namespace {

// Whether /proc/cpuinfo's first "flags" line lists `flag`.
bool kernel_lists(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      std::string word;
      while (words >> word)
        if (word == flag) return true;
      return false;
    }
  return false;
}

}  // namespace

TEST_CASE("the cpu features are those the compiler's cpu check and the kernel report") {
  const CpuFeatures& f = cpu_features();
  CHECK(&f == &cpu_features());
#if defined(__x86_64__)
  CHECK(f.avx2 == static_cast<bool>(__builtin_cpu_supports("avx2")));
  CHECK(f.f16c == (f.avx2 && kernel_lists("f16c")));  // clang 14's builtin knows no "f16c"
  CHECK(f.avx2 == kernel_lists("avx2"));
  CHECK(f.fma == static_cast<bool>(__builtin_cpu_supports("fma")));
#endif
  CHECK(have_avx2() == f.avx2);
}
