// SparseLoCo's traffic counters, beside the other local-update modules': the peak bytes of one
// synchronisation (CommStats::peak_sync_bytes_sent), which bench/diloco_cnn.sh reports.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include "runtime/data_parallel.h"
#include "runtime/local_update/sparseloco.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

TEST_CASE("SparseLoCo's peak bytes per sync are the bytes of one synchronisation") {
  const int world = 2, syncs = 3;
  SparseLoCo c;
  c.inner_steps = 2;
  c.chunk = 16;
  c.ratio = 0.25;
  auto errors = test::run_threads(world, [&](int rank, Runtime& rt) {
    torch::manual_seed(3);
    torch::nn::Linear net(6, 3);
    auto dp = make_data_parallel(rt, net.ptr(), c);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < syncs * c.inner_steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(net->forward(torch::ones({2, 6}) * (rank + 1)), torch::zeros({2, 3})).backward();
      dp->step(opt);
    }
    const size_t parameters = 6 * 3 + 3;
    const auto st = dp->stats();
    // A ring allgather of two ranks: one message out per synchronisation, every one the same size.
    CHECK(st.bytes_sent == syncs * sparseloco_message_bytes(c, parameters));
    CHECK(st.peak_sync_bytes_sent == sparseloco_message_bytes(c, parameters));
  });
  for (auto& e : errors) CHECK(e.empty());
}
