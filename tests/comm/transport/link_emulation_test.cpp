// Link emulation: shapes read from text, which links a job shapes, and an emulated transport over
// inproc — no message earlier than its link allows, sends that take turns, failures and shutdown
// that do not wait for the wire, and collectives that still agree.
#include "comm/transport/link_emulation.h"

#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/collective_checks.h"

using namespace troupe;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

/// The moment an operation completed and how.
struct Completion {
  std::promise<std::pair<Clock::time_point, comm::Status>> promise;
  std::future<std::pair<Clock::time_point, comm::Status>> future = promise.get_future();
  comm::Callback callback() {
    return [this](const comm::Status& s) { promise.set_value({Clock::now(), s}); };
  }
  bool done_within(Clock::duration limit) {
    return future.wait_for(limit) == std::future_status::ready;
  }
};

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

/// The time a link of `shape` needs for `bytes`: serialisation plus latency.
Clock::duration wire_time(const comm::LinkShape& shape, size_t bytes) {
  return std::chrono::duration_cast<Clock::duration>(
             std::chrono::duration<double>(static_cast<double>(bytes) / shape.bytes_per_sec)) +
         shape.latency;
}

/// Rank 0's emulated transport, its link to rank 1 shaped to `to_one`, and rank 1's plain one.
struct Pair {
  comm::InprocFabric fabric{2};
  std::shared_ptr<comm::Transport> sender, receiver = fabric.transport(1);
  explicit Pair(comm::LinkShape to_one)
      : sender(std::make_shared<comm::EmulatedTransport>(
            fabric.transport(0), std::vector<comm::LinkShape>{{}, to_one})) {}
};

}  // namespace

TEST_CASE("a link shape is read from a rate, a latency or both, in decimal units") {
  auto gbit = comm::parse_link_shape("1gbit,5ms");
  CHECK(gbit.bytes_per_sec == doctest::Approx(125e6));
  CHECK(gbit.latency == 5ms);
  CHECK(gbit.active());
  CHECK(comm::parse_link_shape("100mbit").bytes_per_sec == doctest::Approx(12.5e6));
  CHECK(comm::parse_link_shape("100mbit").latency == 0us);
  auto gbytes = comm::parse_link_shape("10GB/s,200us");
  CHECK(gbytes.bytes_per_sec == doctest::Approx(1e10));
  CHECK(gbytes.latency == 200us);
  CHECK(comm::parse_link_shape(" 20ms , 2.5 Gbit/s ").bytes_per_sec == doctest::Approx(312.5e6));
  CHECK(comm::parse_link_shape("5ms").bytes_per_sec == 0);
  CHECK(comm::parse_link_shape("1.5s").latency == 1500ms);
  CHECK(comm::parse_link_shape("1KB").bytes_per_sec == doctest::Approx(1000));
  CHECK(comm::parse_link_shape("8kbit").bytes_per_sec == doctest::Approx(1000));
  CHECK(comm::parse_link_shape("3MB/s").bytes_per_sec == doctest::Approx(3e6));
  CHECK_FALSE(comm::parse_link_shape("none").active());
  CHECK_FALSE(comm::parse_link_shape("").active());
  CHECK_FALSE(comm::parse_link_shape("0ms").active());
}

TEST_CASE("a malformed link shape is an error naming the text and the expected form") {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"1gbt,5ms", "unit 'gbt'"},   {"fast", "does not start with a number"},
      {"1gbit,", "an empty part"},  {"1gbit,2gbit", "two rates"},
      {"5ms,1ms", "two latencies"}, {"0gbit", "not positive"},
      {"100", "has no unit"},       {"1gb", "unit 'gb'"},
      {"-1ms", "does not start"},   {"2min", "unit 'min'"},
      {"61s", "over a minute"}};
  for (const auto& entry : bad) {
    const std::string& text = entry.first;
    const std::string& problem = entry.second;
    CAPTURE(text);
    CHECK_THROWS_AS(comm::parse_link_shape(text), comm::Error);
    const std::string quoted = "'" + text + "'";
    CHECK_THROWS_WITH(comm::parse_link_shape(text), doctest::Contains(quoted.c_str()));
    CHECK_THROWS_WITH(comm::parse_link_shape(text), doctest::Contains(problem.c_str()));
    CHECK_THROWS_WITH(comm::parse_link_shape(text), doctest::Contains("expected a rate such as"));
  }
}

TEST_CASE("rank links are read as RANK=SHAPE entries separated by semicolons") {
  auto links = comm::parse_rank_links("3=100mbit,20ms; 1=10ms;");
  REQUIRE(links.size() == 2);
  CHECK(links[0].first == 3);
  CHECK(links[0].second.bytes_per_sec == doctest::Approx(12.5e6));
  CHECK(links[0].second.latency == 20ms);
  CHECK(links[1].first == 1);
  CHECK(links[1].second.latency == 10ms);
  CHECK(comm::parse_rank_links("").empty());
  CHECK_THROWS_WITH(comm::parse_rank_links("x=1gbit"), doctest::Contains("rank 'x'"));
  CHECK_THROWS_WITH(comm::parse_rank_links("3"), doctest::Contains("entry '3' has no '='"));
  CHECK_THROWS_WITH(comm::parse_rank_links("3=1gbit;3=5ms"),
                    doctest::Contains("names rank 3 a second time"));
  CHECK_THROWS_WITH(comm::parse_rank_links("3=bogus"), doctest::Contains("'bogus'"));
}

TEST_CASE(
    "a rank's own shape applies to the links to it and from it, the rest take the common one") {
  comm::LinkEmulation e;
  e.all = comm::parse_link_shape("1gbit,1ms");
  e.ranks = {{2, comm::parse_link_shape("100mbit,20ms")}};
  CHECK(e.active());
  auto from0 = e.outgoing(0, 4);
  REQUIRE(from0.size() == 4);
  CHECK_FALSE(from0[0].active());  // a rank's link to itself
  CHECK(from0[1].latency == 1ms);
  CHECK(from0[2].latency == 20ms);
  CHECK(from0[3].latency == 1ms);
  auto from2 = e.outgoing(2, 4);
  CHECK(from2[0].latency == 20ms);
  CHECK(from2[0].bytes_per_sec == doctest::Approx(12.5e6));
  CHECK(from2[3].latency == 20ms);
  CHECK_FALSE(from2[2].active());
  // Between two slow ranks: the slower rate and the longer latency.
  e.ranks.push_back({3, comm::parse_link_shape("10mbit,5ms")});
  auto from3 = e.outgoing(3, 4);
  CHECK(from3[2].bytes_per_sec == doctest::Approx(1.25e6));
  CHECK(from3[2].latency == 20ms);
  CHECK(from3[0].latency == 5ms);
  CHECK_THROWS_WITH(e.outgoing(0, 3), doctest::Contains("rank 3"));
  CHECK_FALSE(comm::LinkEmulation{}.active());
}

TEST_CASE(
    "a message on a shaped link arrives no earlier than its bytes over the bandwidth plus the "
    "latency") {
  // A rate slow enough that the link's time (88.9 ms) outweighs the transport's own, so that the
  // upper bound below both catches a rate applied 10x too slow and leaves room for a busy host.
  const auto shape = comm::parse_link_shape("100mbit,5ms");
  const size_t bytes = 1 << 20;
  Pair p(shape);
  CHECK(p.sender->name() == "inproc+emulated");
  CHECK_FALSE(p.sender->serial_callbacks());
  std::vector<char> out(bytes, 'x'), in(bytes);
  Completion sent, received;
  p.receiver->recv(0, 1, in.data(), bytes, received.callback());
  const auto start = Clock::now();
  p.sender->send(1, 1, out.data(), bytes, sent.callback());
  REQUIRE(received.done_within(10s));
  REQUIRE(sent.done_within(10s));
  const auto received_at = received.future.get();
  const auto arrived = received_at.first;
  const auto& status = received_at.second;
  CHECK(status.ok());
  CHECK(sent.future.get().second.ok());
  CHECK(in == out);
  const auto least = wire_time(shape, bytes);  // 83.9 ms + 5 ms
  INFO("took " << ms(arrived - start) << " ms, the link needs " << ms(least) << " ms");
  CHECK(arrived - start >= least);
  CHECK(arrived - start <= 3 * least + 250ms);
}

TEST_CASE("back-to-back sends on one link take turns on the wire") {
  const auto shape = comm::parse_link_shape("200mbit,2ms");
  const size_t bytes = 1 << 20;  // 42 ms each at 25 MB/s
  Pair p(shape);
  std::vector<char> out(bytes, 'y'), in1(bytes), in2(bytes);
  Completion first, second, s1, s2;
  p.receiver->recv(0, 1, in1.data(), bytes, first.callback());
  p.receiver->recv(0, 2, in2.data(), bytes, second.callback());
  const auto start = Clock::now();
  p.sender->send(1, 1, out.data(), bytes, s1.callback());
  p.sender->send(1, 2, out.data(), bytes, s2.callback());
  REQUIRE(second.done_within(10s));
  REQUIRE(first.done_within(10s));
  const auto t1 = first.future.get().first, t2 = second.future.get().first;
  const auto one = wire_time(shape, bytes);
  const auto both = one + (one - shape.latency);  // the second starts when the first has left
  INFO("first after " << ms(t1 - start) << " ms, second after " << ms(t2 - start) << " ms");
  CHECK(t1 - start >= one);
  CHECK(t2 - start >= both);
  CHECK(t2 - start <= 3 * both + 250ms);
  CHECK(s1.done_within(10s));
  CHECK(s2.done_within(10s));
  CHECK(in2 == out);
}

TEST_CASE("an unshaped link is not delayed: its send reaches the transport underneath at once") {
  comm::InprocFabric fabric(3);
  auto sender = std::make_shared<comm::EmulatedTransport>(
      fabric.transport(0),
      std::vector<comm::LinkShape>{{}, {}, comm::parse_link_shape("1kbit,10s")});
  auto receiver = fabric.transport(1);
  std::vector<char> out(1 << 20, 'z'), in(1 << 20);
  Completion sent, received;
  receiver->recv(0, 1, in.data(), in.size(), received.callback());
  sender->send(1, 1, out.data(), out.size(), sent.callback());
  // Inproc completes a send whose receive is waiting inside send(): no timer hop happened.
  CHECK(sent.done_within(0s));
  CHECK(received.done_within(0s));
  CHECK(in == out);
}

TEST_CASE("fail_peer fails a delayed send at once with the reason, and later sends too") {
  Pair p(comm::parse_link_shape("1kbit,10s"));  // 1 MiB would take hours
  std::vector<char> out(1 << 20);
  Completion pending, later;
  p.sender->send(1, 1, out.data(), out.size(), pending.callback());
  const auto start = Clock::now();
  p.sender->fail_peer(1, "rank 1 died (test)");
  REQUIRE(pending.done_within(2s));
  auto [when, status] = pending.future.get();
  CHECK(when - start < 1s);
  CHECK_FALSE(status.ok());
  CHECK(status.message() == "rank 1 died (test)");
  CHECK(status.peer() == 1);
  p.sender->send(1, 2, out.data(), out.size(), later.callback());
  REQUIRE(later.done_within(2s));
  CHECK(later.future.get().second.message() == "rank 1 died (test)");
}

TEST_CASE("destroying an emulated transport with delayed sends fails them and returns promptly") {
  Pair p(comm::parse_link_shape("1kbit,10s"));
  std::vector<char> out(1 << 20);
  Completion pending;
  p.sender->send(1, 1, out.data(), out.size(), pending.callback());
  const auto start = Clock::now();
  p.sender.reset();
  CHECK(Clock::now() - start < 1s);
  REQUIRE(pending.done_within(0s));
  CHECK(pending.future.get().second.message() == "transport shut down");
}

TEST_CASE("the last owner may destroy an emulated transport inside its own callback") {
  comm::InprocFabric fabric(2);
  auto receiver = fabric.transport(1);
  std::shared_ptr<comm::Transport> sender = std::make_shared<comm::EmulatedTransport>(
      fabric.transport(0), std::vector<comm::LinkShape>{{}, comm::parse_link_shape("100ms")});
  auto owner = std::make_shared<std::shared_ptr<comm::Transport>>(sender);
  char in = 0, out = 1;
  bool last = false;
  Completion received, destroyed;
  receiver->recv(0, 1, &in, 1, received.callback());
  // The callback runs on the timer thread, where it drops the only reference left.
  sender->send(1, 1, &out, 1, [owner, &last, &destroyed](const comm::Status& s) {
    last = owner->use_count() == 1;
    owner->reset();
    destroyed.callback()(s);
  });
  sender.reset();
  REQUIRE(destroyed.done_within(5s));
  CHECK(destroyed.future.get().second.ok());
  CHECK(last);
  REQUIRE(received.done_within(5s));
  CHECK(in == 1);
}

TEST_CASE("collectives through emulated links with one slow rank still match the reference") {
  const int world = 4;
  comm::LinkEmulation links;
  links.all = comm::parse_link_shape("1gbit,200us");
  links.ranks = {{2, comm::parse_link_shape("100mbit,1ms")}};
  comm::CollectiveOptions ring;  // the pipelined ring for everything, several lanes
  ring.small_bytes = 0;
  ring.chunk_bytes = 1024;
  ring.max_lanes = 3;
  comm::InprocFabric fabric(world);
  std::vector<std::future<std::vector<std::string>>> ranks;
  std::vector<Clock::duration> first_allreduce(world);
  const auto start = Clock::now();
  for (int r = 0; r < world; ++r)
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto t =
          std::make_shared<comm::EmulatedTransport>(fabric.transport(r), links.outgoing(r, world));
      comm::Communicator c(t, ring, 60s);
      try {
        std::vector<std::string> failures;
        std::vector<float> v(10000, static_cast<float>(r + 1));
        c.allreduce(v.data(), v.size(), comm::DataType::float32, comm::ReduceOp::sum);
        first_allreduce[r] = Clock::now() - start;
        for (float x : v)
          if (x != 10.0f) {
            failures.push_back("allreduce gave " + std::to_string(x) + ", expected 10");
            break;
          }
        for (auto& f : test::check_collectives(c, {1, 3001})) failures.push_back(f);
        return failures;
      } catch (const std::exception& e) {
        return std::vector<std::string>{std::string("threw: ") + e.what()};
      }
    }));
  for (int r = 0; r < world; ++r)
    for (auto& f : ranks[r].get()) FAIL_CHECK("rank " << r << ": " << f);
  // The last value a rank receives has passed 2(W-1) = 6 consecutive links of the ring since the
  // start, at least 2 of them to or from rank 2 (1 ms each).
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(first_allreduce[r] >= 2ms);
  }
}
