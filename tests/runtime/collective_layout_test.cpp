// The collectives' defaults that depend on where the ranks are (comm/collectives/collectives.h,
// for_layout): the ring's chunk is large when the ranks span real hosts, and what the user set
// wins. Thread ranks pretend to be on different machines (RuntimeOptions::machine).
#include <doctest/doctest.h>

#include <mutex>
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"
#include "tests/support/one_name_ranks.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

TEST_CASE("the ring's chunk defaults to 512 KiB on one host and 8 MiB across hosts") {
  const comm::CollectiveOptions unset;
  CHECK(unset.chunk_bytes == 0);
  CHECK(comm::for_layout(unset, {}).chunk_bytes == 512 * 1024);
  CHECK(comm::for_layout(unset, {0}).chunk_bytes == 512 * 1024);
  CHECK(comm::for_layout(unset, {3, 3, 3, 3}).chunk_bytes == 512 * 1024);
  CHECK(comm::for_layout(unset, {0, 1}).chunk_bytes == 8 * 1024 * 1024);
  CHECK(comm::for_layout(unset, {0, 0, 1, 1}).chunk_bytes == 8 * 1024 * 1024);
  CHECK(comm::for_layout(unset, {0, 0, 0, 2}).chunk_bytes == 8 * 1024 * 1024);
}

TEST_CASE("a chunk size the user set wins over the layout's default, and the rest is kept") {
  comm::CollectiveOptions set;
  set.chunk_bytes = 512 * 1024;  // the one-host value, asked for across hosts
  set.max_lanes = 5;
  set.small_bytes = 1000;
  set.hosts = {0, 1};
  for (const std::vector<int>& layout : {std::vector<int>{0, 0}, std::vector<int>{0, 1}}) {
    const auto got = comm::for_layout(set, layout);
    CHECK(got.chunk_bytes == 512 * 1024);
    CHECK(got.max_lanes == 5);
    CHECK(got.small_bytes == 1000);
    CHECK(got.hosts == std::vector<int>{0, 1});
  }
  set.chunk_bytes = 1;
  CHECK(comm::for_layout(set, {0, 1, 2}).chunk_bytes == 1);
}

TEST_CASE("a Runtime's collectives take the chunk of its real hosts, not of its host names") {
  // One host name everywhere; the machines decide. An explicit chunk stays on both layouts.
  struct Case {
    bool one_machine;
    size_t asked;
    size_t want;
  };
  for (const Case& c : {Case{true, 0, 512 * 1024}, Case{false, 0, 8 * 1024 * 1024},
                        Case{true, 4096, 4096}, Case{false, 4096, 4096}}) {
    CAPTURE(c.one_machine);
    CAPTURE(c.asked);
    const int world = 4;
    auto options = test::one_name_ranks(world, !c.one_machine);
    for (auto& o : options) o.collectives.chunk_bytes = c.asked;
    std::mutex mutex;
    std::vector<size_t> chunks(world);
    std::vector<std::vector<float>> sums(world);
    auto errors = test::run_ranks(options, [&](int r, Runtime& rt) {
      // 3 MiB: the ring path (above small_bytes), one chunk of 8 MiB or several of the others.
      std::vector<float> data(768 * 1024);
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(r + 1) * (i % 7);
      rt.comm().allreduce(data.data(), data.size(), comm::DataType::float32, comm::ReduceOp::sum);
      std::lock_guard<std::mutex> lock(mutex);
      chunks[r] = rt.comm().options().chunk_bytes;
      sums[r] = std::move(data);
    });
    for (auto& e : errors) CHECK(e == "");
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(chunks[r] == c.want);
      REQUIRE(sums[r].size() == 768 * 1024);
      bool exact = true;  // sum over ranks of (r + 1) * (i % 7) = 10 * (i % 7), exact in float
      for (size_t i = 0; i < sums[r].size(); ++i)
        exact = exact && sums[r][i] == 10.0f * static_cast<float>(i % 7);
      CHECK(exact);
    }
  }
}
