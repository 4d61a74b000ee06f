// comm::copy against glibc's memcpy over the distance between destination and source modulo
// 4 KiB, the case comm::copy exists for (comm/reduce.h): one buffer copied into another again and
// again (it stays in the caches), for each size and distance the median of 9 timings, GB/s of
// bytes copied, and the ratio. What the one-host allreduce (LocalAllreduce::allreduce_private)
// copies: shares of 256 KiB chunks between a page-aligned slot and the caller's buffer.
//   build/bin/bench_copy_distance
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/reduce.h"

namespace {

using Clock = std::chrono::steady_clock;

template <class Copy>
double gbps(char* dst, const char* src, size_t bytes, Copy copy) {
  const size_t reps = std::max<size_t>(8, (size_t{128} << 20) / bytes);
  std::vector<double> rates;
  for (int t = 0; t < 9; ++t) {
    const auto start = Clock::now();
    for (size_t r = 0; r < reps; ++r) {
      copy(dst, src, bytes);
      asm volatile("" ::: "memory");
    }
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    rates.push_back(static_cast<double>(bytes * reps) / s / 1e9);
  }
  std::nth_element(rates.begin(), rates.begin() + 4, rates.end());
  return rates[4];
}

}  // namespace

int main() {
  const size_t largest = size_t{1} << 20;
  char* src = static_cast<char*>(std::aligned_alloc(4096, largest + 8192));
  char* dst = static_cast<char*>(std::aligned_alloc(4096, largest + 8192));
  if (!src || !dst) return 1;
  std::memset(src, 1, largest + 8192);
  std::memset(dst, 2, largest + 8192);
  std::printf("| bytes | (dst - src) mod 4096 | memcpy GB/s | comm::copy GB/s | copy / memcpy |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (size_t bytes : {size_t{4} << 10, size_t{64} << 10, size_t{256} << 10, largest}) {
    for (size_t distance : {size_t{0}, size_t{16}, size_t{64}, size_t{4080}}) {
      char* to = dst + distance;
      const double m =
          gbps(to, src, bytes, [](char* d, const char* s, size_t n) { std::memcpy(d, s, n); });
      const double c = gbps(to, src, bytes,
                            [](char* d, const char* s, size_t n) { troupe::comm::copy(d, s, n); });
      std::printf("| %zu KiB | %zu | %.2f | %.2f | %.2f |\n", bytes >> 10, distance, m, c, c / m);
    }
  }
  std::free(src);
  std::free(dst);
  return 0;
}
