// The machine's own run-to-run and moment-to-moment spread, against which the one-host allreduce's
// spread (issue 37: 10 runs within 10%) is read. Two threads, pinned to the first two CPUs this
// process may use, take turns updating one buffer (each reads what the other wrote, adds 1 to every
// float and hands it back: the traffic of a shared-memory reduction between two ranks), in windows
// of 0.5 s; between them, one thread alone does the same to the same buffer. Prints GB/s (bytes
// read and written) per window, then min, median and max of each.
//   build/bin/bench_cross_core [MiB per turn, default 4] [windows, default 20]
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWindow = std::chrono::milliseconds(500);

void add_one(std::vector<float>& buffer) {
  for (float& x : buffer) x += 1.0f;
}

// GB/s of `passes` updates of the buffer (each reads and writes every byte) in `seconds`.
double gbps(uint64_t passes, const std::vector<float>& buffer, double seconds) {
  return static_cast<double>(passes) * 2.0 * static_cast<double>(buffer.size() * sizeof(float)) /
         seconds / 1e9;
}

// The first `count` CPUs of this process's affinity mask.
std::vector<int> allowed_cpus(size_t count) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < count; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

// GB/s of two threads on `cpus` taking turns for one window.
double turns(std::vector<float>& buffer, const std::vector<int>& cpus) {
  std::atomic<uint64_t> turn{0};
  std::atomic<bool> stop{false};
  auto body = [&](int me) {
    pin(cpus[static_cast<size_t>(me)]);
    for (;;) {
      const uint64_t t = turn.load(std::memory_order_acquire);
      if (stop.load(std::memory_order_relaxed)) return;
      if (static_cast<int>(t % 2) != me) continue;  // the other thread's turn: it is a copy away
      add_one(buffer);
      turn.store(t + 1, std::memory_order_release);
    }
  };
  const auto start = Clock::now();
  std::thread a(body, 0), b(body, 1);
  std::this_thread::sleep_for(kWindow);
  stop.store(true);
  a.join();
  b.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return gbps(turn.load(), buffer, seconds);
}

// GB/s of one thread on cpus[0] for one window.
double alone(std::vector<float>& buffer, const std::vector<int>& cpus) {
  double rate = 0.0;
  std::thread t([&] {
    pin(cpus[0]);
    const auto start = Clock::now();
    uint64_t passes = 0;
    while (Clock::now() - start < kWindow) {
      add_one(buffer);
      ++passes;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    rate = gbps(passes, buffer, seconds);
  });
  t.join();
  return rate;
}

void summary(const char* what, std::vector<double> rates) {
  std::sort(rates.begin(), rates.end());
  std::printf("%-28s min %6.2f  median %6.2f  max %6.2f  max/min %.2f\n", what, rates.front(),
              rates[rates.size() / 2], rates.back(), rates.back() / rates.front());
}

}  // namespace

int main(int argc, char** argv) {
  const long mib = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 4;
  const long windows = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 20;
  if (mib < 1 || mib > 4096 || windows < 1 || windows > 10000) {
    std::fprintf(stderr,
                 "bench_cross_core: MiB '%ld' and windows '%ld' (expected 1..4096 and 1..10000)\n",
                 mib, windows);
    return 2;
  }
  const auto cpus = allowed_cpus(2);
  if (cpus.size() < 2) {
    std::fprintf(stderr, "bench_cross_core: %zu CPU(s) allowed (expected at least 2)\n",
                 cpus.size());
    return 2;
  }
  std::vector<float> buffer(static_cast<size_t>(mib) << 18, 0.0f);
  std::printf("%ld MiB, CPUs %d and %d, GB/s (read + written) per %lld ms window\n", mib, cpus[0],
              cpus[1], static_cast<long long>(kWindow.count()));
  std::vector<double> two, one;
  for (long w = 0; w < windows; ++w) {
    two.push_back(turns(buffer, cpus));
    one.push_back(alone(buffer, cpus));
    std::printf("window %3ld: two cores taking turns %6.2f, one core %6.2f\n", w + 1, two.back(),
                one.back());
  }
  summary("two cores taking turns:", two);
  summary("one core:", one);
  return 0;
}
