// PowerSGD's passes over the gradient against the machine's copy of the same bytes: what bounds a
// PowerSGD step on a CPU. For the benchmark MLP's weight matrices (784-2048-2048-1024-10, as
// `troupe bench ddp --model mlp` builds them: rows = out features), rank 2 by default, with error
// feedback, each pass over all matrices in order as comm/compression/power_sgd.cpp runs them on a
// gradient set to none (g, where autograd put it; x its bucket, e the error memory):
//   add_project (M = g + e, P = M Q), back_project (Q = M^T P), expand_error (x = P Q^T, e = M - x)
// with M written into the bucket (as before 2026-11-28), into the memory (2026-11-28), and into the
// memory with its update deferred to the next step's sum (since: expand writes x only, and
// add_project is settle_add_project, e = g + e - P' Q'^T / world with the last step's P' and Q'),
// the three alternating step by step. The median of 21 timings of each pass, and memcpy of the
// gradient's bytes (a read and a write of each byte) in the same run. The buffers are larger than
// the caches, as in training.
//   build/bin/bench_power_sgd_passes [rank]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/codecs/low_rank.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  size_t rows, cols;
};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Appends the milliseconds f() takes.
template <class F>
void time_ms(std::vector<double>& into, F f) {
  const auto start = Clock::now();
  f();
  asm volatile("" ::: "memory");
  into.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace troupe::comm;
  const long rank_arg = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 2;
  if (rank_arg < 1 || rank_arg > 64) {
    std::fprintf(stderr, "bench_power_sgd_passes: rank '%s' (expected 1..64)\n", argv[1]);
    return 2;
  }
  const size_t r = static_cast<size_t>(rank_arg);
  const Shape shapes[] = {{2048, 784}, {2048, 2048}, {1024, 2048}, {10, 1024}};
  size_t total = 0, widest = 0, tallest = 0;
  for (const Shape& s : shapes) {
    total += s.rows * s.cols;
    widest = std::max(widest, s.cols);
    tallest = std::max(tallest, s.rows);
  }
  // g: the gradient autograd allocated (set to none before backward), x: its bucket, e: the error
  // memory.
  std::vector<float> g(total), x(total), e(total), copy(total);
  for (size_t i = 0; i < total; ++i) {
    g[i] = static_cast<float>(i % 97) * 0.01f - 0.4f;
    e[i] = static_cast<float>(i % 89) * 0.001f;
  }
  std::vector<float> p(tallest * r), qt(widest * r), held_p(tallest * r), held_qt(widest * r);
  random_normal(1, qt.data(), qt.size());
  random_normal(2, p.data(), p.size());
  random_normal(3, held_qt.data(), held_qt.size());
  random_normal(4, held_p.data(), held_p.size());
  auto each = [&](auto pass) {
    size_t at = 0;
    for (const Shape& s : shapes) {
      pass(s, at);
      at += s.rows * s.cols;
    }
  };
  // The three passes of one step with M kept in the bucket, in the memory, or in the memory with
  // its update deferred; the layouts alternate, step by step, so that the machine's drift falls
  // on all of them.
  enum Layout { kBucket, kMemory, kDeferred };
  std::vector<double> ms[3][3];
  for (int t = 0; t < 21; ++t)
    for (Layout layout : {kBucket, kMemory, kDeferred}) {
      float* m = layout == kBucket ? x.data() : e.data();
      auto& out = ms[layout];
      time_ms(out[0], [&] {
        each([&](const Shape& s, size_t at) {
          if (layout == kDeferred)
            low_rank_settle_add_project(g.data() + at, e.data() + at, held_p.data(), held_qt.data(),
                                        r, 0.5f, 1.0f, s.rows, s.cols, qt.data(), r, p.data());
          else
            low_rank_add_project_from(g.data() + at, m + at, e.data() + at, s.rows, s.cols,
                                      qt.data(), r, p.data());
        });
      });
      time_ms(out[1], [&] {
        each([&](const Shape& s, size_t at) {
          low_rank_back_project(m + at, s.rows, s.cols, p.data(), r, qt.data());
        });
      });
      time_ms(out[2], [&] {
        each([&](const Shape& s, size_t at) {
          if (layout == kBucket)
            low_rank_expand_error(p.data(), qt.data(), s.rows, s.cols, r, 0.5f, 1.0f, x.data() + at,
                                  e.data() + at);
          else if (layout == kDeferred)
            low_rank_expand(p.data(), qt.data(), s.rows, s.cols, r, 0.5f, x.data() + at);
          else
            low_rank_expand_from_error(p.data(), qt.data(), s.rows, s.cols, r, 0.5f, 1.0f,
                                       e.data() + at, x.data() + at);
        });
      });
    }
  std::vector<double> copies;
  for (int t = 0; t < 21; ++t)
    time_ms(copies, [&] { std::memcpy(copy.data(), g.data(), total * sizeof(float)); });
  const double memcpy_ms = median(copies);
  const double mb = static_cast<double>(total * sizeof(float)) / 1e6;
  std::printf("PowerSGD rank %zu over the MLP's %zu weights (%.1f MB), median of 21, ms:\n", r,
              total, mb);
  std::printf("  memcpy of the gradient  %7.2f  (%.1f GB/s read + written)\n", memcpy_ms,
              2 * mb / memcpy_ms);
  const char* passes[] = {"add_project", "back_project", "expand_error"};
  std::printf("  %-22s %9s %9s %9s  (M in the bucket / in the memory / deferred update)\n", "",
              "bucket", "memory", "deferred");
  double sum[3] = {0, 0, 0};
  for (int k = 0; k < 3; ++k) {
    double med[3];
    for (int l = 0; l < 3; ++l) sum[l] += med[l] = median(ms[l][k]);
    std::printf("  %-22s %9.2f %9.2f %9.2f  (%.2fx, %.2fx, %.2fx memcpy)\n", passes[k], med[0],
                med[1], med[2], med[0] / memcpy_ms, med[1] / memcpy_ms, med[2] / memcpy_ms);
  }
  std::printf("  %-22s %9.2f %9.2f %9.2f  (%.2fx, %.2fx, %.2fx memcpy)\n", "all three", sum[0],
              sum[1], sum[2], sum[0] / memcpy_ms, sum[1] / memcpy_ms, sum[2] / memcpy_ms);
  return 0;
}
