// CPU features: measured once, and what the compiler's own check says.
#include <doctest/doctest.h>

#include "comm/cpu_features.h"

using namespace troupe::comm;

TEST_CASE("the cpu features are those the compiler's cpu check reports") {
  const CpuFeatures& f = cpu_features();
  CHECK(&f == &cpu_features());
#if defined(__x86_64__)
  CHECK(f.avx2 == static_cast<bool>(__builtin_cpu_supports("avx2")));
  CHECK(f.f16c == static_cast<bool>(__builtin_cpu_supports("f16c")));
  CHECK(f.fma == static_cast<bool>(__builtin_cpu_supports("fma")));
#endif
  CHECK(have_avx2() == f.avx2);
}
