#include "comm/cpu_features.h"

namespace troupe::comm {

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.f16c = __builtin_cpu_supports("f16c");
    f.fma = __builtin_cpu_supports("fma");
#endif
    return f;
  }();
  return features;
}

}  // namespace troupe::comm
