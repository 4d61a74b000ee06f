// A long data-parallel job keeps its memory flat: nothing a DistributedModule, its actors or CAF
// keep per step may grow with the number of steps (issue 21, item 7: 1 MB per step).
#include "tests/support/torch_doctest.h"

#include <malloc.h>

#include <array>
#include <string>
#include <vector>

#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

// Bytes the process holds from malloc, in every arena (the ranks' threads and the actors' use
// their own). RSS would follow it only loosely: glibc keeps freed memory, and fragments it.
size_t heap_in_use() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Trains a small model for `steps` data-parallel steps on this rank.
struct SoakRank {
  explicit SoakRank(Runtime& rt)
      : model(torch::nn::Linear(8, 4)),
        ddp(rt, model.ptr(), GradientAllReduce{}, DdpOptions{}),
        opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
        x(torch::randn({4, 8})),
        y(torch::randn({4, 4})) {}
  void train(int steps) {
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      ddp.step(opt);
    }
  }
  torch::nn::Linear model;
  DistributedModule ddp;
  torch::optim::SGD opt;
  torch::Tensor x, y;
};

}  // namespace

TEST_CASE("the heap in use stays flat over a thousand data-parallel steps") {
  constexpr int kWarmup = 100;
  constexpr int kSteps = 1000;
  std::array<size_t, 2> heap{};  // after the warm-up, after kSteps more
  auto errors = test::run_threads(2, [&](int r, Runtime& rt) {
    SoakRank rank(rt);
    for (size_t phase = 0; phase < heap.size(); ++phase) {
      rank.train(phase == 0 ? kWarmup : kSteps);
      // Both ranks are between steps while rank 0 measures.
      rt.comm().barrier();
      if (r == 0) heap[phase] = heap_in_use();
      rt.comm().barrier();
    }
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  const double per_step = (static_cast<double>(heap[1]) - static_cast<double>(heap[0])) / kSteps;
  INFO("heap in use: " << heap[0] << " bytes after " << kWarmup << " steps, " << heap[1]
                       << " bytes after " << kSteps << " more (" << per_step << " per step)");
  // Per step and rank, the old per-step trace kept over 200 bytes, and CAF's clock a request
  // timeout (with the waiting actor) and a stall message for a minute.
  CHECK(per_step < 64);
}
