// LocalAllreduce (ranks as threads, each with its own shared segment): results against a
// single-process reference, slots submitted in different orders on different ranks, several
// generations; a rank that never contributes, abort, and bad arguments.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "comm/collectives/communicator.h"
#include "comm/shm/local_allreduce.h"
#include "comm/shm/segment.h"
#include "tests/support/thread_communicators.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> run_ranks(int world, const std::function<void(comm::Communicator&)>& fn) {
  return test::run_communicators(world, {}, fn);
}

// One buffer of the test: its slot, place, type and how it is reduced.
struct Case {
  int slot;
  size_t offset;
  size_t count;
  comm::DataType type;
  comm::LocalReduce how;
};

// Rank r's value i of slot s in generation g: small integers (exact in every type), some negative.
double value(int rank, int generation, int slot, size_t i) {
  return static_cast<double>(static_cast<int64_t>((i * 7 + static_cast<size_t>(slot) * 13 +
                                                   static_cast<size_t>(rank) * 31 +
                                                   static_cast<size_t>(generation) * 5) %
                                                  97) -
                             40) *
         (rank + 1) * 0.25;
}

template <typename T>
void fill(char* at, const Case& c, int rank, int generation) {
  auto* p = reinterpret_cast<T*>(at + c.offset);
  for (size_t i = 0; i < c.count; ++i) p[i] = static_cast<T>(value(rank, generation, c.slot, i));
}

// The reference: the same arithmetic, in rank order, on one thread.
template <typename T>
T expected(const Case& c, int world, int generation, size_t i) {
  auto x = [&](int k) { return static_cast<T>(value(k, generation, c.slot, i)); };
  const auto op = c.how.op;
  if (op == comm::ReduceOp::min || op == comm::ReduceOp::max) {
    T m = x(0);
    for (int k = 1; k < world; ++k)
      m = op == comm::ReduceOp::min ? std::min(m, x(k)) : std::max(m, x(k));
    return m;
  }
  using Factor = std::conditional_t<std::is_same<T, float>::value, float, double>;
  const auto f = static_cast<Factor>(c.how.scale);
  const bool scaled = op == comm::ReduceOp::sum && c.how.scale != 1.0;
  if (scaled && c.how.scale_before) {
    T s = static_cast<T>(x(0) * f);
    for (int k = 1; k < world; ++k) s = static_cast<T>(s + static_cast<T>(x(k) * f));
    return s;
  }
  T s = x(0);
  for (int k = 1; k < world; ++k) s = static_cast<T>(s + x(k));
  if (op == comm::ReduceOp::avg) return static_cast<T>(s / static_cast<T>(world));
  if (scaled) return static_cast<T>(s * f);
  return s;
}

template <typename T>
size_t mismatches(const char* at, const Case& c, int world, int generation) {
  const auto* p = reinterpret_cast<const T*>(at + c.offset);
  size_t bad = 0;
  for (size_t i = 0; i < c.count; ++i) bad += p[i] != expected<T>(c, world, generation, i);
  return bad;
}

void fill_case(char* at, const Case& c, int rank, int generation) {
  switch (c.type) {
    case comm::DataType::float32:
      return fill<float>(at, c, rank, generation);
    case comm::DataType::float64:
      return fill<double>(at, c, rank, generation);
    case comm::DataType::int32:
      return fill<int32_t>(at, c, rank, generation);
    default:
      return fill<int64_t>(at, c, rank, generation);
  }
}

size_t check_case(const char* at, const Case& c, int world, int generation) {
  switch (c.type) {
    case comm::DataType::float32:
      return mismatches<float>(at, c, world, generation);
    case comm::DataType::float64:
      return mismatches<double>(at, c, world, generation);
    case comm::DataType::int32:
      return mismatches<int32_t>(at, c, world, generation);
    default:
      return mismatches<int64_t>(at, c, world, generation);
  }
}

std::vector<Case> cases() {
  using comm::DataType;
  using comm::ReduceOp;
  std::vector<Case> out = {
      {0, 0, 20011, DataType::float32, {ReduceOp::avg, 1.0, false}},
      {1, 0, 1, DataType::float32, {ReduceOp::sum, 1.0, false}},
      {2, 0, 4099, DataType::float32, {ReduceOp::sum, 0.125, false}},
      {3, 0, 333, DataType::float32, {ReduceOp::sum, 0.3, true}},
      {4, 0, 7000, DataType::float64, {ReduceOp::avg, 1.0, false}},
      {5, 0, 515, DataType::int32, {ReduceOp::avg, 1.0, false}},
      {6, 0, 100, DataType::int64, {ReduceOp::max, 1.0, false}},
      {7, 0, 17, DataType::float32, {ReduceOp::min, 1.0, false}},
      {4095, 0, 0, DataType::float32, {ReduceOp::sum, 1.0, false}},
  };
  size_t at = 0;
  for (auto& c : out) {  // packed back to back, 8-byte aligned: shares cross lines and pages
    c.offset = at;
    at += (c.count * comm::element_size(c.type) + 7) / 8 * 8;
  }
  return out;
}

}  // namespace

TEST_CASE("LocalAllreduce matches a single-process reference, slots in any order, 3 generations") {
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    const auto all = cases();
    std::vector<std::vector<std::string>> failures(static_cast<size_t>(world));
    auto errors = run_ranks(world, [&](comm::Communicator& c) {
      const int rank = c.rank();
      auto local = comm::LocalAllreduce::connect(c, 200000, 10s);
      REQUIRE(local->world_size() == world);
      REQUIRE(local->data_bytes() >= 200000);
      for (int g = 1; g <= 3; ++g) {
        for (auto& k : all) fill_case(local->data(), k, rank, g);
        std::vector<std::promise<comm::Status>> done(all.size());
        // Each rank submits the slots in its own rotation of the list.
        for (size_t j = 0; j < all.size(); ++j) {
          const size_t k = (j + static_cast<size_t>(rank) * 3) % all.size();
          const auto& b = all[k];
          local->allreduce(b.slot, b.offset, b.count, b.type, b.how,
                           [&done, k](const comm::Status& s) { done[k].set_value(s); });
        }
        for (size_t k = 0; k < all.size(); ++k) {
          auto f = done[k].get_future();
          if (f.wait_for(10s) != std::future_status::ready) {
            failures[static_cast<size_t>(rank)].push_back("slot " + std::to_string(all[k].slot) +
                                                          " never ended");
            return;
          }
          const auto s = f.get();
          if (!s.ok()) failures[static_cast<size_t>(rank)].push_back(s.message());
          const size_t bad = check_case(local->data(), all[k], world, g);
          if (bad)
            failures[static_cast<size_t>(rank)].push_back(
                "generation " + std::to_string(g) + " slot " + std::to_string(all[k].slot) + ": " +
                std::to_string(bad) + " of " + std::to_string(all[k].count) + " wrong");
        }
        if (g % 2 == 0) c.barrier();  // odd generations: refill as soon as this rank is done
      }
    });
    for (int r = 0; r < world; ++r) {
      CHECK_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
      for (auto& f : failures[static_cast<size_t>(r)]) FAIL_CHECK("rank " << r << ": " << f);
    }
  }
}

TEST_CASE("LocalAllreduce: a rank that never contributes fails the operation at its deadline") {
  std::promise<void> rank0_done;
  auto rank0_finished = rank0_done.get_future().share();
  comm::Status status;
  std::vector<int> waiting, waiting_after, waiting_other_slot;
  std::string later;
  auto errors = run_ranks(2, [&](comm::Communicator& c) {
    auto local = comm::LocalAllreduce::connect(c, 4096, 300ms);
    if (c.rank() == 1) {  // alive, mapped, but silent
      rank0_finished.wait();
      return;
    }
    std::promise<comm::Status> done;
    local->allreduce(5, 0, 10, comm::DataType::float32, {},
                     [&done](const comm::Status& s) { done.set_value(s); });
    waiting = local->waiting_on(5);
    auto f = done.get_future();
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    status = f.get();
    // The LocalAllreduce is broken from now on: a later operation fails at once.
    std::promise<comm::Status> again;
    local->allreduce(6, 0, 10, comm::DataType::float32, {},
                     [&again](const comm::Status& s) { again.set_value(s); });
    auto g = again.get_future();
    REQUIRE(g.wait_for(10s) == std::future_status::ready);
    later = g.get().message();
    // The failed operations are gone, yet a stall report asking now (DDP's reducer asks at its
    // own deadline, which may come just after this one) still learns whom they waited for.
    waiting_after = local->waiting_on(5);
    waiting_other_slot = local->waiting_on(7);
    rank0_done.set_value();
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(waiting == std::vector<int>{1});
  CHECK(waiting_after == std::vector<int>{1});
  CHECK(waiting_other_slot == std::vector<int>{1});
  CHECK_FALSE(status.ok());
  CHECK(status.peer() == 1);
  // Who did not contribute, by when, where, and the setting that sets the deadline.
  CHECK(status.message().rfind(
            "a reduction through shared memory timed out: ranks 1 did not contribute within "
            "300 ms (LocalAllreduce slot 5, generation 1) (the deadline of troupe's collectives: "
            "troupe::RuntimeOptions::collective_timeout",
            0) == 0);
  CHECK(later == status.message());
}

TEST_CASE("LocalAllreduce: abort fails what is pending with the reason given") {
  std::promise<void> rank0_done;
  auto rank0_finished = rank0_done.get_future().share();
  comm::Status status;
  std::vector<int> waiting;
  auto errors = run_ranks(2, [&](comm::Communicator& c) {
    auto local = comm::LocalAllreduce::connect(c, 4096, 60s);
    if (c.rank() == 1) {
      rank0_finished.wait();
      return;
    }
    std::promise<comm::Status> done;
    local->allreduce(0, 64, 3, comm::DataType::float64, {},
                     [&done](const comm::Status& s) { done.set_value(s); });
    local->abort(comm::Status::failure("rank 1 died", 1));
    auto f = done.get_future();
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    status = f.get();
    waiting = local->waiting_on(0);
    rank0_done.set_value();
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(waiting == std::vector<int>{1});
  CHECK(status.message() == "rank 1 died");
  CHECK(status.peer() == 1);
}

TEST_CASE(
    "LocalAllreduce: an operation every rank has finished ends well though abort() came before "
    "this rank's worker saw it") {
  // Rank 0's worker is held inside slot 0's callback (callbacks run on it) while both ranks
  // finish slot 1 (no elements: its flags are published when it is submitted); then abort()
  // comes, as when rank 1 saw slot 1 end, went on and died. Slot 1 ends well on rank 0 too; an
  // operation after the abort fails with its reason.
  comm::Status first, second, later;
  auto errors = run_ranks(2, [&](comm::Communicator& c) {
    const int rank = c.rank();
    auto local = comm::LocalAllreduce::connect(c, 4096, 60s);
    std::promise<void> held, release;
    auto released = release.get_future();
    std::promise<comm::Status> first_done, second_done, later_done;
    local->allreduce(0, 0, 16, comm::DataType::float32, {}, [&, rank](const comm::Status& s) {
      first_done.set_value(s);
      if (rank != 0) return;
      held.set_value();
      released.wait();
    });
    if (rank == 0) held.get_future().wait();
    local->allreduce(1, 64, 0, comm::DataType::float32, {},
                     [&](const comm::Status& s) { second_done.set_value(s); });
    c.barrier();  // slot 1 is finished on both ranks
    auto f = second_done.get_future();
    if (rank == 0) {
      local->abort(comm::Status::failure("rank 1 died", 1));
      release.set_value();
      REQUIRE(f.wait_for(10s) == std::future_status::ready);
      second = f.get();
      first = first_done.get_future().get();
      local->allreduce(2, 128, 4, comm::DataType::float32, {},
                       [&](const comm::Status& s) { later_done.set_value(s); });
      auto g = later_done.get_future();
      REQUIRE(g.wait_for(10s) == std::future_status::ready);
      later = g.get();
    } else {
      REQUIRE(f.wait_for(10s) == std::future_status::ready);
    }
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(first.ok());
  CHECK_MESSAGE(second.ok(), second.message());
  CHECK(later.message() == "rank 1 died");
}

TEST_CASE("LocalAllreduce and SharedSegment refuse bad arguments with named errors") {
  auto errors = run_ranks(1, [](comm::Communicator& c) {
    CHECK_THROWS_WITH(comm::LocalAllreduce::connect(c, 0, 1s),
                      "LocalAllreduce: data_bytes 0 (expected > 0)");
    auto local = comm::LocalAllreduce::connect(c, 1000, 1s);
    CHECK(local->data_bytes() == 4096);
    auto none = [](const comm::Status&) {};
    const comm::LocalReduce sum;
    CHECK_THROWS_WITH(local->allreduce(-1, 0, 1, comm::DataType::float32, sum, none),
                      "LocalAllreduce::allreduce(slot -1): slot outside 0..4095");
    CHECK_THROWS_WITH(local->allreduce(4096, 0, 1, comm::DataType::float32, sum, none),
                      "LocalAllreduce::allreduce(slot 4096): slot outside 0..4095");
    CHECK_THROWS_WITH(
        local->allreduce(0, 2, 1, comm::DataType::float32, sum, none),
        "LocalAllreduce::allreduce(slot 0): offset 2 is not a multiple of the float32 "
        "element size 4");
    CHECK_THROWS_WITH(
        local->allreduce(0, 4000, 25, comm::DataType::float32, sum, none),
        "LocalAllreduce::allreduce(slot 0): 25 float32 elements at byte 4000 end past "
        "the data region of 4096 bytes");
    CHECK_THROWS_WITH(
        local->allreduce(0, 0, 1, comm::DataType::float32, {comm::ReduceOp::avg, 0.5, false}, none),
        "LocalAllreduce::allreduce(slot 0): scale 0.5 with op avg (expected op sum)");
    CHECK_THROWS_WITH(local->allreduce(0, 0, 1, comm::DataType::float32, sum, nullptr),
                      "LocalAllreduce::allreduce(slot 0): no callback");
    // World 1: the buffer is the result.
    reinterpret_cast<float*>(local->data())[0] = 2.5f;
    std::promise<comm::Status> done;
    local->allreduce(0, 0, 1, comm::DataType::float32, {comm::ReduceOp::avg, 1.0, false},
                     [&done](const comm::Status& s) { done.set_value(s); });
    auto f = done.get_future();
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    CHECK(f.get().ok());
    CHECK(reinterpret_cast<float*>(local->data())[0] == 2.5f);
    float mine[3] = {1.5f, 2.5f, 3.5f};
    CHECK_THROWS_WITH(
        local->allreduce_private(mine, 3, comm::DataType::float32, comm::ReduceOp::sum, 100),
        "LocalAllreduce::allreduce_private: chunk_bytes 100 (expected a multiple of "
        "64 of which the region of 4096 bytes holds at least 2)");
    CHECK_THROWS_WITH(
        local->allreduce_private(mine, 3, comm::DataType::float32, comm::ReduceOp::sum, 4096),
        doctest::Contains("chunk_bytes 4096 (expected"));
    local->allreduce_private(mine, 3, comm::DataType::float32, comm::ReduceOp::avg, 2048);
    CHECK(mine[2] == 3.5f);  // world 1: the buffer is the result
  });
  CHECK(errors == std::vector<std::string>{""});

  CHECK_THROWS_WITH(comm::SharedSegment::create("no-slash", 10),
                    "shared segment name 'no-slash': expected '/' then 1 to 200 letters, digits, "
                    "'-', '_' or '.'");
  CHECK_THROWS_WITH(comm::SharedSegment::create("/a/b", 10),
                    doctest::Contains("shared segment name '/a/b'"));
  const std::string name = "/troupe-test-" + std::to_string(::getpid());
  CHECK_THROWS_WITH(
      comm::SharedSegment::open(name, 10),
      ("shared segment '" + name + "': shm_open failed: No such file or directory").c_str());
  auto made = comm::SharedSegment::create(name, 8192);
  CHECK(made->size() == 8192);
  CHECK_THROWS_WITH(
      comm::SharedSegment::create(name, 8192),
      ("shared segment '" + name + "': shm_open(O_CREAT|O_EXCL) failed: File exists").c_str());
  CHECK_THROWS_WITH(comm::SharedSegment::open(name, 4096),
                    ("shared segment '" + name + "' is 8192 bytes (expected 4096)").c_str());
  auto mapped = comm::SharedSegment::open(name, 8192);
  made->data()[100] = 42;
  CHECK(mapped->data()[100] == 42);  // one memory, two mappings
  made->unlink();
  CHECK_THROWS_WITH(comm::SharedSegment::open(name, 8192), doctest::Contains("No such file"));
  CHECK(mapped->data()[100] == 42);  // still mapped after the name is gone
}

TEST_CASE(
    "LocalAllreduce with two ranks: the rank that contributed first reduces the whole buffer "
    "when the other came more than 1 ms later, and halves otherwise add up") {
  // Rank 0 contributes, then both pass a barrier, then rank 1 waits 20 ms and contributes: rank 1
  // came later by at least 20 ms, whatever the scheduler does. Then both contribute at once: each
  // reduces some share (halves, or all and none if the threads ran far apart), never more than
  // the buffer between them, and the sums are right either way.
  const Case k{0, 0, 100000, comm::DataType::float32, comm::LocalReduce{}};
  std::vector<uint64_t> first(2), second(2);
  std::vector<size_t> bad(2);
  auto errors = run_ranks(2, [&](comm::Communicator& c) {
    const int rank = c.rank();
    auto local = comm::LocalAllreduce::connect(c, 400000, 10s);
    auto reduce_once = [&](bool rank1_later, int generation) {
      fill_case(local->data(), k, rank, generation);
      std::promise<comm::Status> done;
      auto submit = [&] {
        local->allreduce(k.slot, k.offset, k.count, k.type, k.how,
                         [&done](const comm::Status& s) { done.set_value(s); });
      };
      if (!rank1_later || rank == 0) submit();
      if (rank1_later) {
        c.barrier();
        if (rank == 1) {
          std::this_thread::sleep_for(20ms);  // the skew under test, not a synchronisation
          submit();
        }
      }
      auto f = done.get_future();
      REQUIRE(f.wait_for(10s) == std::future_status::ready);
      REQUIRE(f.get().ok());
      bad[static_cast<size_t>(rank)] += check_case(local->data(), k, 2, generation);
      c.barrier();  // both have read the result before either refills
    };
    reduce_once(true, 1);
    first[static_cast<size_t>(rank)] = local->elements_reduced();
    reduce_once(false, 2);
    second[static_cast<size_t>(rank)] =
        local->elements_reduced() - first[static_cast<size_t>(rank)];
  });
  CHECK_MESSAGE(errors[0].empty(), errors[0]);
  CHECK_MESSAGE(errors[1].empty(), errors[1]);
  CHECK(bad == std::vector<size_t>{0, 0});
  CHECK(first == std::vector<uint64_t>{k.count, 0});
  CHECK(second[0] + second[1] == k.count);
}

TEST_CASE(
    "LocalAllreduce with sources reads each rank's pieces where its table says, writes the "
    "result into the buffer (or in place over the sources) and leaves the gaps, and the sources "
    "or the buffer, as they were") {
  // A buffer of 6000 float32 at byte 0 with three pieces and gaps between them (a bucket's
  // parameters padded apart); every rank keeps its contribution to pieces 0 and 2 elsewhere in
  // its region, at offsets of its own (off the buffer's alignment by 4 bytes per rank), and its
  // contribution to piece 1 in the buffer itself. World 2 takes the one-pass kernel (sum, avg),
  // a scale before the sum and worlds 3 and 4 the blocked one. In place, the result goes over
  // every rank's contributions instead: piece 1's into the buffer, the others' elsewhere, and the
  // buffer's places of pieces 0 and 2 keep what they held.
  const std::vector<size_t> first = {0, 1030, 4100};
  const std::vector<size_t> count = {1000, 3001, 50};
  const size_t buffer_count = 6000;
  const size_t table = 30000;      // bytes: after the buffer
  const float gap_value = -77.0f;  // what the gaps hold before and must hold after
  for (const bool in_place : {false, true})
    for (int world : {2, 3, 4}) {
      for (const comm::LocalReduce how :
           {comm::LocalReduce{}, comm::LocalReduce{comm::ReduceOp::avg, 1.0, false},
            comm::LocalReduce{comm::ReduceOp::sum, 0.3, true}}) {
        CAPTURE(in_place);
        CAPTURE(world);
        CAPTURE(how.scale);
        const Case whole{9, 0, buffer_count, comm::DataType::float32, how};
        std::vector<std::string> failures(static_cast<size_t>(world));
        auto errors = run_ranks(world, [&](comm::Communicator& c) {
          const int rank = c.rank();
          auto& failed = failures[static_cast<size_t>(rank)];
          auto local = comm::LocalAllreduce::connect(c, 200000, 10s);
          char* region = local->data();
          auto* buffer = reinterpret_cast<float*>(region);
          auto* entries = reinterpret_cast<uint64_t*>(region + table);
          for (size_t i = 0; i < buffer_count; ++i) buffer[i] = gap_value;
          std::vector<float> source_values;
          for (size_t p = 0; p < first.size(); ++p) {
            entries[p] = p == 1 ? first[p] * sizeof(float)
                                : 40000 + p * 20000 + static_cast<size_t>(rank) * 4;
            auto* at = reinterpret_cast<float*>(region + entries[p]);
            for (size_t i = 0; i < count[p]; ++i)
              at[i] = static_cast<float>(value(rank, 1, whole.slot, first[p] + i));
          }
          auto sources = std::make_shared<comm::LocalSources>(
              comm::LocalSources{table, first, count, in_place});
          std::promise<comm::Status> done;
          local->allreduce(
              whole.slot, 0, buffer_count, comm::DataType::float32, how,
              [&done](const comm::Status& s) { done.set_value(s); }, sources);
          auto f = done.get_future();
          REQUIRE(f.wait_for(10s) == std::future_status::ready);
          const auto status = f.get();
          if (!status.ok()) failed += status.message() + "; ";
          size_t wrong = 0, gaps = 0, sources_changed = 0;
          size_t piece = 0;
          for (size_t i = 0; i < buffer_count; ++i) {
            while (piece < first.size() && i >= first[piece] + count[piece]) ++piece;
            const bool inside = piece < first.size() && i >= first[piece];
            if (inside && (!in_place || piece == 1))
              wrong += buffer[i] != expected<float>(whole, world, 1, i);
            else
              gaps += buffer[i] != gap_value;  // a gap, or in place a piece kept elsewhere
          }
          for (size_t p : {size_t{0}, size_t{2}}) {
            const auto* at = reinterpret_cast<const float*>(region + entries[p]);
            for (size_t i = 0; i < count[p]; ++i) {
              if (in_place)
                wrong += at[i] != expected<float>(whole, world, 1, first[p] + i);
              else
                sources_changed +=
                    at[i] != static_cast<float>(value(rank, 1, whole.slot, first[p] + i));
            }
          }
          if (wrong) failed += std::to_string(wrong) + " results wrong; ";
          if (gaps) failed += std::to_string(gaps) + " gap (in place: buffer) elements changed; ";
          if (sources_changed)
            failed += std::to_string(sources_changed) + " source elements changed; ";
        });
        for (int r = 0; r < world; ++r) {
          CHECK_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
          CHECK_MESSAGE(failures[static_cast<size_t>(r)].empty(),
                        "rank " << r << ": " << failures[static_cast<size_t>(r)]);
        }
      }
    }
}

TEST_CASE(
    "LocalAllreduce refuses bad sources at submission, and fails a reduction whose peer's table "
    "points outside its region, naming the rank, the piece and the offset") {
  auto errors = run_ranks(1, [](comm::Communicator& c) {
    auto local = comm::LocalAllreduce::connect(c, 4096, 1s);
    auto none = [](const comm::Status&) {};
    auto* entries = reinterpret_cast<uint64_t*>(local->data() + 2048);
    entries[0] = 0;
    entries[1] = 64;
    auto submit = [&](comm::LocalSources s) {
      local->allreduce(0, 0, 100, comm::DataType::float32, {}, none,
                       std::make_shared<comm::LocalSources>(std::move(s)));
    };
    CHECK_THROWS_WITH(submit({2048, {0, 10}, {5}}),
                      "LocalAllreduce::allreduce(slot 0): sources with 2 first elements and 1 "
                      "counts (expected one of each per piece)");
    CHECK_THROWS_WITH(submit({2044, {0}, {5}}),
                      "LocalAllreduce::allreduce(slot 0): the sources' table of 1 entries at byte "
                      "2044 is not 8-byte aligned inside the data region of 4096 bytes");
    CHECK_THROWS_WITH(submit({2048, {0, 4}, {5, 5}}),
                      "LocalAllreduce::allreduce(slot 0): piece 1 (5 elements from 4) overlaps the "
                      "one before it or ends past the buffer's 100 elements (expected ascending, "
                      "disjoint pieces)");
    CHECK_THROWS_WITH(submit({2048, {0, 98}, {5, 5}}),
                      doctest::Contains("piece 1 (5 elements from 98)"));
    entries[1] = 4090;
    CHECK_THROWS_WITH(submit({2048, {0, 10}, {5, 5}}),
                      "LocalAllreduce::allreduce(slot 0): piece 1's source at byte 4090 (5 float32 "
                      "elements) is off the element size or ends past the data region of 4096 "
                      "bytes");
    entries[1] = 4088;
    CHECK_THROWS_WITH(submit({2048, {0, 10}, {5, 5}}),
                      doctest::Contains("piece 1's source at byte 4088"));
  });
  CHECK(errors == std::vector<std::string>{""});

  // Rank 1 submits a good table, then breaks it (memory it should have left alone) before rank 0
  // submits: whichever worker reads rank 1's entry fails with its name and offset.
  std::promise<void> broken;
  auto broken_now = broken.get_future().share();
  std::vector<comm::Status> status(2);
  auto errors2 = run_ranks(2, [&](comm::Communicator& c) {
    const int rank = c.rank();
    auto local = comm::LocalAllreduce::connect(c, 4096, 500ms);
    auto* entries = reinterpret_cast<uint64_t*>(local->data() + 2048);
    entries[0] = 1024;
    std::promise<comm::Status> done;
    if (rank == 0) broken_now.wait();
    local->allreduce(
        3, 0, 64, comm::DataType::float32, {},
        [&done](const comm::Status& s) { done.set_value(s); },
        std::make_shared<comm::LocalSources>(comm::LocalSources{2048, {0}, {64}}));
    if (rank == 1) {
      entries[0] = 1u << 20;
      broken.set_value();
    }
    auto f = done.get_future();
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    status[static_cast<size_t>(rank)] = f.get();
  });
  CHECK(errors2 == std::vector<std::string>{"", ""});
  CHECK_FALSE(status[0].ok());
  CHECK_FALSE(status[1].ok());
  bool named = false;
  for (auto& s : status)
    named |= s.message() ==
             "a reduction through shared memory (LocalAllreduce slot 3) cannot read its sources: "
             "rank 1's source of piece 0 (64 float32 elements at byte 1048576) lies outside its "
             "data region of 4096 bytes or off the element size";
  CHECK(named);
}
