// The collective deadline: PyTorch's default (30 minutes) unless set, and a collective that runs
// out of it says which setting gave it and how to change it, not only the internal operation.
#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "rank/runtime.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;
using namespace std::chrono_literals;

TEST_CASE("the collective timeout defaults to PyTorch's 30 minutes") {
  CHECK(RuntimeOptions{}.collective_timeout == std::chrono::minutes(30));
}

TEST_CASE(
    "a collective that times out names RuntimeOptions::collective_timeout and when to raise it") {
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < 2; ++r) {
    options.push_back(test::thread_rank(r, 2, port, fabric));
    options.back().collective_timeout = 300ms;
  }
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future();
  std::string error;
  auto errors = test::run_ranks(options, [&](int r, Runtime& rt) {
    if (r == 1) {
      // Rank 1 stays in the job but joins no collective until rank 0 has given up.
      CHECK(done.wait_for(30s) == std::future_status::ready);
      return;
    }
    float x = 1;
    try {
      rt.comm().allreduce(&x, 1, comm::DataType::float32, comm::ReduceOp::sum);
    } catch (const std::exception& e) {
      error = e.what();
    }
    rank0_done.set_value();
  });
  for (auto& e : errors) CHECK(e == "");
  INFO(error);
  CHECK(error.find("timed out after 300 ms waiting for rank(s) 1") != std::string::npos);
  CHECK(error.find("RuntimeOptions::collective_timeout, 30 minutes by default") !=
        std::string::npos);
  CHECK(error.find("raise it where a rank may take longer") != std::string::npos);
}
