#pragma once
/// What this CPU runs beyond the x86-64 baseline, measured once. The codecs and reductions are
/// built for the baseline and pick their AVX2 loops (compiled with target("avx2")) by it.
namespace troupe::comm {

struct CpuFeatures {
  bool avx2 = false;
  bool f16c = false;  // float16 <-> float32 conversions
  bool fma = false;
  bool avx512f =
      false;  // with the OS saving the AVX-512 state (what __builtin_cpu_supports checks)
};

/// Measured at the first call, then cached.
const CpuFeatures& cpu_features();

/// Whether the AVX2 loops may run.
inline bool have_avx2() { return cpu_features().avx2; }

}  // namespace troupe::comm
