// Every collective x op x dtype, as threads over the inproc transport, against a single-process
// reference; and the ways a collective ends in an error instead of a hang.
#include <doctest/doctest.h>

#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/collective_checks.h"
#include "tests/support/thread_communicators.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

// Runs fn(communicator) on `world` threads over one fabric; returns each rank's failures.
std::vector<std::vector<std::string>> run_ranks(
    int world, comm::CollectiveOptions options,
    const std::function<std::vector<std::string>(comm::Communicator&)>& fn) {
  std::vector<std::vector<std::string>> out(static_cast<size_t>(world));
  auto threw = test::run_communicators(
      world, options, [&](comm::Communicator& c) { out[static_cast<size_t>(c.rank())] = fn(c); });
  for (size_t r = 0; r < threw.size(); ++r)
    if (!threw[r].empty()) out[r] = {"threw: " + threw[r]};
  return out;
}

void expect_no_failures(const std::vector<std::vector<std::string>>& per_rank) {
  for (size_t r = 0; r < per_rank.size(); ++r)
    for (auto& f : per_rank[r]) FAIL_CHECK("rank " << r << ": " << f);
}

}  // namespace

TEST_CASE("every collective, op and dtype matches a single-process reference, world sizes 1 to 8") {
  for (int world = 1; world <= 8; ++world) {
    CAPTURE(world);
    const std::vector<size_t> counts = {0, 1, 3, static_cast<size_t>(world) + 1, 1000, 20011};
    // Default tuning: small messages by recursive doubling, large by the pipelined ring.
    expect_no_failures(run_ranks(
        world, {}, [&](comm::Communicator& c) { return test::check_collectives(c, counts); }));
    // Tiny thresholds force the ring and several lanes even for small counts.
    comm::CollectiveOptions ring;
    ring.small_bytes = 0;
    ring.chunk_bytes = 64;
    ring.max_lanes = 3;
    expect_no_failures(run_ranks(world, ring, [&](comm::Communicator& c) {
      return test::check_collectives(c, {1, 5, 777});
    }));
  }
}

TEST_CASE("ring allreduce gives every rank bit-identical float results") {
  const int world = 5;
  const size_t count = 100003;
  comm::CollectiveOptions opt;
  opt.small_bytes = 0;
  std::vector<std::vector<float>> results(world);
  run_ranks(world, opt, [&](comm::Communicator& c) {
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = 1.0f / static_cast<float>(1 + i + 13 * c.rank());
    c.allreduce(v.data(), count, comm::DataType::float32, comm::ReduceOp::sum);
    results[c.rank()] = v;
    return std::vector<std::string>{};
  });
  for (int r = 1; r < world; ++r) CHECK(results[r] == results[0]);
  double want = 0;
  for (int r = 0; r < world; ++r) want += 1.0 / (1 + 42 + 13 * r);
  CHECK(results[0][42] == doctest::Approx(want).epsilon(1e-6));
}

TEST_CASE("a collective that a rank never joins times out naming that rank") {
  comm::InprocFabric fabric(3);
  comm::Communicator c0(fabric.transport(0), {}, 200ms);
  comm::Communicator c1(fabric.transport(1), {}, 200ms);
  std::vector<float> a(10, 1.0f), b(10, 1.0f);
  auto other = std::async(std::launch::async, [&] {
    try {
      c1.allreduce(b.data(), 10, comm::DataType::float32, comm::ReduceOp::sum);
    } catch (const comm::Error&) {
    }
  });
  auto start = std::chrono::steady_clock::now();
  try {
    c0.allreduce(a.data(), 10, comm::DataType::float32, comm::ReduceOp::sum);
    FAIL("allreduce without rank 2 returned normally");
  } catch (const comm::Error& e) {
    std::string what = e.what();
    CHECK(what.find("timed out after 200 ms") != std::string::npos);
    CHECK(what.find("rank(s) ") != std::string::npos);
    CHECK(what.find("allreduce") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  other.get();
}

TEST_CASE("a peer declared dead ends a pending allreduce with an error naming it") {
  comm::InprocFabric fabric(2);
  auto t0 = fabric.transport(0);
  comm::Communicator c0(t0, {}, 30s);
  std::vector<float> a(1 << 20, 1.0f);
  auto call = std::async(std::launch::async, [&] {
    c0.allreduce(a.data(), a.size(), comm::DataType::float32, comm::ReduceOp::sum);
  });
  t0->fail_peer(1, "rank 1 died (test)");
  try {
    call.get();
    FAIL("allreduce returned normally although its peer died");
  } catch (const comm::Error& e) {
    CHECK(std::string(e.what()).find("rank 1 died (test)") != std::string::npos);
    CHECK(e.peer() == 1);
  }
}

TEST_CASE("bad collective arguments are rejected with the value and what was expected") {
  comm::InprocFabric fabric(1);
  comm::Communicator c(fabric.transport(0));
  float x = 1;
  CHECK_THROWS_WITH(c.broadcast(&x, 1, comm::DataType::float32, 3),
                    doctest::Contains("root 3 is outside [0, 1)"));
  CHECK_THROWS_WITH(c.allgatherv(&x, &x, {1, 1}, comm::DataType::float32),
                    doctest::Contains("2 counts given, expected one per rank (1)"));
  CHECK_THROWS_WITH(comm::parse_data_type("float8"), doctest::Contains("'float8'"));
  CHECK_THROWS_WITH(comm::InprocFabric(0), doctest::Contains("world size 0"));
}

TEST_CASE("hierarchical allreduce matches a single-process reference for every host layout") {
  const std::vector<std::vector<int>> layouts = {{0, 0, 1, 1, 1}, {0, 1, 0, 1}, {5, 5, 5},
                                                 {0, 1, 2},       {7},          {0, 0, 1, 2, 2, 2}};
  for (const auto& hosts : layouts) {
    const int world = static_cast<int>(hosts.size());
    CAPTURE(world);
    CAPTURE(hosts[0]);
    for (auto op : {comm::ReduceOp::sum, comm::ReduceOp::avg, comm::ReduceOp::max}) {
      CAPTURE(comm::to_string(op));
      comm::CollectiveOptions ring;  // large buffers by the ring among leaders, in lanes
      ring.small_bytes = 256;
      ring.chunk_bytes = 128;
      expect_no_failures(run_ranks(world, ring, [&](comm::Communicator& c) {
        std::vector<std::string> failures;
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{3001}}) {
          auto value = [](int rank, size_t i) {
            return static_cast<double>((rank + 1) * 3 + i % 11);
          };
          std::vector<double> data(count);
          for (size_t i = 0; i < count; ++i) data[i] = value(c.rank(), i);
          c.hierarchical_allreduce(data.data(), count, comm::DataType::float64, op, hosts);
          for (size_t i = 0; i < count; ++i) {
            double expected = op == comm::ReduceOp::max ? value(world - 1, i) : 0;
            if (op != comm::ReduceOp::max)
              for (int r = 0; r < world; ++r) expected += value(r, i);
            if (op == comm::ReduceOp::avg) expected /= world;
            if (std::abs(data[i] - expected) > 1e-9 * std::abs(expected)) {
              failures.push_back("count " + std::to_string(count) + " element " +
                                 std::to_string(i) + ": " + std::to_string(data[i]) +
                                 ", expected " + std::to_string(expected));
              break;
            }
          }
        }
        return failures;
      }));
    }
  }
}

TEST_CASE("hierarchical allreduce refuses a host list of the wrong length") {
  auto per_rank = run_ranks(2, {}, [](comm::Communicator& c) {
    double x = 1;
    try {
      c.hierarchical_allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum, {0, 0, 1});
    } catch (const comm::Error& e) {
      if (std::string(e.what()).find("3 host entries for a world of 2 ranks") != std::string::npos)
        return std::vector<std::string>{};
      return std::vector<std::string>{std::string("wrong message: ") + e.what()};
    }
    return std::vector<std::string>{"no error"};
  });
  expect_no_failures(per_rank);
}
