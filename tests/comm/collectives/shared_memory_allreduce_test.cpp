// Allreduce through shared memory (Communicator::use_shared_memory), as threads of this process
// (each thread maps every rank's segment as a process would): every op and dtype against a
// single-process reference, buffers that wrap the staging slots many times, and the ways it ends
// in an error instead of a hang.
#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/collective_checks.h"
#include "tests/support/thread_communicators.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

// Two communicators over an in-process fabric, both with shared memory on, each operation's
// deadline `timeout`.
struct SharedMemoryPair {
  explicit SharedMemoryPair(std::chrono::milliseconds timeout)
      : c0(fabric.transport(0), {}, timeout), c1(fabric.transport(1), {}, timeout) {
    auto other = std::async(std::launch::async, [&] { return c1.use_shared_memory(true); });
    REQUIRE(c0.use_shared_memory(true));
    REQUIRE(other.get());
  }
  comm::InprocFabric fabric{2};
  comm::Communicator c0, c1;
};

}  // namespace

TEST_CASE(
    "allreduce through shared memory matches a single-process reference for every op and dtype") {
  for (int world : {2, 3, 5}) {
    CAPTURE(world);
    // 20011 float32 is above small_bytes; 65536 float32 is one chunk of 256 KiB exactly, 262147
    // four chunks and a bit (the 4 staging slots once round and a chunk); 600001 float64 spans
    // 19 chunks.
    std::vector<size_t> counts = {20011, 65536, 262147};
    if (world == 2) counts.push_back(600001);
    std::vector<std::vector<std::string>> failures(static_cast<size_t>(world));
    auto threw = test::run_communicators(world, {}, [&](comm::Communicator& c) {
      CHECK(c.use_shared_memory(true));
      failures[static_cast<size_t>(c.rank())] = test::check_allreduce(c, counts);
      CHECK(c.uses_shared_memory());
    });
    for (int r = 0; r < world; ++r) {
      CHECK(threw[static_cast<size_t>(r)] == "");
      for (auto& f : failures[static_cast<size_t>(r)]) FAIL_CHECK("rank " << r << ": " << f);
    }
  }
}

TEST_CASE(
    "allreduce through shared memory of a buffer 36 times the staging region gives every rank the "
    "same bits") {
  const int world = 3;
  const size_t count = 9 * (1u << 20) + 12345;  // float32: 145 chunks of 256 KiB through 4 slots
  std::vector<std::vector<float>> results(world);
  auto threw = test::run_communicators(world, {}, [&](comm::Communicator& c) {
    REQUIRE(c.use_shared_memory(true));
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i)
      v[i] = 1.0f / static_cast<float>(1 + i % 9973 + 7 * c.rank());
    c.allreduce(v.data(), count, comm::DataType::float32, comm::ReduceOp::avg);
    results[static_cast<size_t>(c.rank())] = std::move(v);
  });
  for (auto& t : threw) CHECK(t == "");
  for (int r = 1; r < world; ++r) CHECK(results[static_cast<size_t>(r)] == results[0]);
  for (size_t i : {size_t{0}, size_t{4242}, count / 2, count - 1}) {
    double want = 0;
    for (int r = 0; r < world; ++r) want += 1.0 / (1 + i % 9973 + 7 * r);
    CHECK(results[0][i] == doctest::Approx(want / world).epsilon(1e-6));
  }
}

TEST_CASE(
    "a rank that never joins an allreduce through shared memory fails it at the deadline, naming "
    "the rank") {
  SharedMemoryPair pair(300ms);
  auto& c0 = pair.c0;
  std::vector<float> a(1 << 20, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  try {
    c0.allreduce(a.data(), a.size(), comm::DataType::float32, comm::ReduceOp::sum);
    FAIL("allreduce without rank 1 returned normally");
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("shared memory") != std::string::npos);
    CHECK(what.find("ranks 1") != std::string::npos);
    CHECK(what.find("RuntimeOptions::collective_timeout") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE(
    "ranks that allreduce buffers of different sizes through shared memory fail at the deadline, "
    "naming the rank behind") {
  SharedMemoryPair pair(300ms);
  auto& c0 = pair.c0;
  auto& c1 = pair.c1;
  // Rank 0 reduces 1 Mi elements (16 chunks) and stops; rank 1 waits for chunk 17 of its 2 Mi.
  std::vector<float> a(1 << 20, 1.0f), b(2 << 20, 2.0f);
  auto shorter = std::async(std::launch::async, [&] {
    c0.allreduce(a.data(), a.size(), comm::DataType::float32, comm::ReduceOp::sum);
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    c1.allreduce(b.data(), b.size(), comm::DataType::float32, comm::ReduceOp::sum);
    FAIL("allreduce of a longer buffer than rank 0's returned normally");
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("rank 1: ranks 0 did not stage chunk 17 of 32") != std::string::npos);
    CHECK(what.find("different sizes") != std::string::npos);
    CHECK(e.peer() == 0);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  shorter.get();  // rank 0's 16 chunks met rank 1's first 16
  CHECK(a[0] == 3.0f);
  // The counts no longer agree: every later call fails at once, naming the first failure.
  CHECK_THROWS_WITH(c1.allreduce(b.data(), b.size(), comm::DataType::float32, comm::ReduceOp::sum),
                    doctest::Contains("did not stage chunk 17 of 32"));
}

TEST_CASE(
    "abort ends an allreduce through shared memory at once with the reason, and every later one") {
  SharedMemoryPair pair(30s);
  auto& c0 = pair.c0;
  std::vector<float> a(3 << 20, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  auto call = std::async(std::launch::async, [&] {
    c0.allreduce(a.data(), a.size(), comm::DataType::float32, comm::ReduceOp::sum);
  });
  c0.abort("rank 1 died (test)", 1);
  try {
    call.get();
    FAIL("allreduce returned normally although its peer died");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find("rank 1 died (test)") != std::string::npos);
    CHECK(e.peer() == 1);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK_THROWS_WITH(c0.allreduce(a.data(), a.size(), comm::DataType::float32, comm::ReduceOp::sum),
                    doctest::Contains("rank 1 died (test)"));
}

TEST_CASE("with shared memory off again, allreduce goes over the transport") {
  auto threw = test::run_communicators(2, {}, [&](comm::Communicator& c) {
    REQUIRE(c.use_shared_memory(true));
    CHECK_FALSE(c.use_shared_memory(false));
    CHECK_FALSE(c.uses_shared_memory());
    auto failures = test::check_allreduce(c, {20011});
    for (auto& f : failures) FAIL_CHECK(f);
  });
  for (auto& t : threw) CHECK(t == "");
}
