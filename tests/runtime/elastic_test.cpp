// The pieces of elastic training that need no process: the quorum rule of a generation, the
// membership service driven through its sockets by hand, the elastic sampler, and the launch
// options of an elastic job.
#include <sys/socket.h>
#include <unistd.h>

#include "tests/support/torch_doctest.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "comm/status.h"
#include "elastic/elastic.h"
#include "elastic/launch.h"
#include "elastic/membership.h"

using namespace troupe;
using namespace troupe::elastic;

namespace {

/// The rank side of a slot's socket, by hand.
struct FakeRank {
  int fd = -1;
  void send(Message type, const std::vector<std::string>& fields) const {
    const std::string bytes = encode(type, fields);
    REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(bytes.size()));
  }
  /// The next message, if one is waiting (the server writes synchronously, so it is there),
  /// past the notice that the first generation forms (sent to the slots not joined yet).
  std::pair<Message, std::vector<std::string>> receive() const {
    for (;;) {
      std::string buffer(kMaxMessageBytes, '\0');
      const ssize_t got = ::recv(fd, buffer.data(), buffer.size(), MSG_DONTWAIT);
      REQUIRE(got > 0);
      auto message = decode(std::string(buffer.data(), static_cast<size_t>(got)), "test");
      if (message.first != Message::reform || message.second.at(0) != "1") return message;
    }
  }
  bool idle() const {
    char byte;
    return ::recv(fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK) < 0;
  }
  /// The rank's end of its socket closes, as when its process dies.
  void close() {
    ::close(fd);
    fd = -1;
  }
};

std::vector<FakeRank> attach_all(MembershipServer& server, int n) {
  std::vector<FakeRank> ranks;
  for (int s = 0; s < n; ++s) {
    ranks.push_back({server.attach(s)});
    // The launcher closes its copy of the rank's end after fork; here the test keeps it.
  }
  return ranks;
}

void join(MembershipServer& server, const std::vector<FakeRank>& ranks, int slot, int64_t step) {
  ranks[static_cast<size_t>(slot)].send(Message::join, {std::to_string(step), "host"});
  server.on_readable(slot);
}

// Slot `slot`'s next message is an assignment with these fields (generation, rank, world size,
// source, step), then the ranks of a whole world, which it returns.
std::string expect_assign(const std::vector<FakeRank>& ranks, int slot,
                          const std::vector<std::string>& fields) {
  CAPTURE(slot);
  auto [type, f] = ranks[static_cast<size_t>(slot)].receive();
  CHECK(type == Message::assign);
  REQUIRE(f.size() == fields.size() + 1);
  CHECK(std::vector<std::string>(f.begin(), f.end() - 1) == fields);
  return f.back();
}

// Slots 0..members-1 are assigned generation 1 (ranks by slot, healed from slot 0 at step 0) and
// answer with their addresses "address<slot>".
void expect_first_generation(MembershipServer& server, const std::vector<FakeRank>& ranks,
                             int members) {
  for (int s = 0; s < members; ++s) {
    expect_assign(ranks, s, {"1", std::to_string(s), std::to_string(members), "0", "0"});
    ranks[static_cast<size_t>(s)].send(Message::address, {"1", "address" + std::to_string(s)});
    server.on_readable(s);
  }
}

// A service for launch slots 0 and 1 as members; slot 2 joins as a spare once attach_spare()
// attaches it. The ranks' sockets still open close at the end.
struct TwoMembersAndSpare {
  std::ostringstream log;
  MembershipServer server{3, 1, std::chrono::seconds(30), log, /*members=*/2};
  std::vector<FakeRank> ranks{{server.attach(0)}, {server.attach(1)}};
  void attach_spare() { ranks.push_back({server.attach(2, true)}); }
  ~TwoMembersAndSpare() {
    for (auto& r : ranks)
      if (r.fd >= 0) r.close();
  }
};

}  // namespace

TEST_CASE("a first generation numbers its members by launch slot and heals from the lowest") {
  auto g = close_generation(1, {{2, -1}, {0, -1}, {3, -1}}, {0, 1, 2, 3}, 1, 2);
  CHECK(g.error.empty());
  CHECK(g.slots == std::vector<int>{0, 2, 3});
  CHECK(g.source == 0);
  CHECK(g.step == 0);
}

TEST_CASE("a generation heals from the member with the most completed steps") {
  auto g = close_generation(3, {{0, 41}, {1, 42}, {3, -1}}, {0, 1, 2}, 1, 1);
  CHECK(g.error.empty());
  CHECK(g.slots == std::vector<int>{0, 1, 3});
  CHECK(g.source == 1);
  CHECK(g.step == 42);
}

TEST_CASE("a generation below --min-ranks has no quorum, and says so") {
  auto g = close_generation(2, {{0, 10}, {1, 10}}, {0, 1, 2}, 1, 3);
  CHECK(g.error.find("generation 2 has no quorum") != std::string::npos);
  CHECK(g.error.find("slots) 0, 1 reported") != std::string::npos);
  CHECK(g.error.find("--min-ranks 3") != std::string::npos);
}

TEST_CASE("a side that holds no majority of the ranks that may still live does not go on") {
  // Four ranks before; two report, two went silent (their processes live): a possible partition.
  auto silent = close_generation(2, {{0, 7}, {1, 7}}, {0, 1, 2, 3}, 0, 1);
  CHECK(silent.error.find("no quorum") != std::string::npos);
  CHECK(silent.error.find("more than half") != std::string::npos);
  // The same two when the other two are known dead: no other side can exist.
  CHECK(close_generation(2, {{0, 7}, {1, 7}}, {0, 1, 2, 3}, 2, 1).error.empty());
  // A restarted rank holds no state: it does not count towards the majority.
  CHECK(!close_generation(2, {{0, 7}, {2, -1}}, {0, 1, 2}, 0, 1).error.empty());
}

TEST_CASE("membership messages round-trip, and a malformed one is refused naming its sender") {
  auto [type, fields] = decode(encode(Message::table, {"3", "", std::string(5, '\0')}), "x");
  CHECK(type == Message::table);
  CHECK(fields == std::vector<std::string>{"3", "", std::string(5, '\0')});
  CHECK_THROWS_WITH_AS(decode(std::string(1, '\x09'), "rank slot 4"),
                       doctest::Contains("rank slot 4: a membership message of 1 bytes with an "
                                         "unknown type"),
                       comm::Error);
  std::string cut = encode(Message::join, {"12345"});
  cut.pop_back();
  CHECK_THROWS_WITH_AS(decode(cut, "rank slot 1"), doctest::Contains("overruns"), comm::Error);
}

TEST_CASE("the membership service forms a world, and re-forms it when a rank dies") {
  std::ostringstream log;
  MembershipServer server(3, 2, std::chrono::seconds(30), log);
  auto ranks = attach_all(server, 3);
  join(server, ranks, 0, -1);
  join(server, ranks, 1, -1);
  CHECK(ranks[0].idle());  // slot 2 lives and has not joined: the generation waits
  join(server, ranks, 2, -1);
  expect_first_generation(server, ranks, 3);
  for (int s = 0; s < 3; ++s) {
    auto [type, f] = ranks[static_cast<size_t>(s)].receive();
    CHECK(type == Message::table);
    CHECK(f == std::vector<std::string>{"1", "host", "address0", "host", "address1", "host",
                                        "address2"});
  }
  CHECK(server.generations() == 1);

  // Slot 1 dies: its socket closes. The others hear at once that generation 2 forms.
  ::close(ranks[1].fd);
  server.on_exit(1, "was killed by signal 9 (Killed)");
  for (int s : {0, 2}) {
    auto [type, f] = ranks[static_cast<size_t>(s)].receive();
    CHECK(type == Message::reform);
    CHECK(f[0] == "2");
    CHECK(f[1].find("rank slot 1 died (was killed by signal 9") != std::string::npos);
  }
  join(server, ranks, 2, 12);  // slot 2 completed one more step than slot 0
  join(server, ranks, 0, 11);
  expect_assign(ranks, 0, {"2", "0", "2", "1", "12"});
  expect_assign(ranks, 2, {"2", "1", "2", "1", "12"});
  CHECK(!server.stopped());
  ::close(ranks[0].fd);
  ::close(ranks[2].fd);
}

TEST_CASE_FIXTURE(
    TwoMembersAndSpare,
    "a spare waits at its join without opening a generation, then takes a dead rank's place") {
  attach_spare();
  CHECK(server.standby(2));
  CHECK(!server.standby(0));
  join(server, ranks, 2, -1);  // the spare is ready first: nothing forms for it
  CHECK(ranks[0].idle());
  join(server, ranks, 0, -1);
  join(server, ranks, 1, -1);
  expect_first_generation(server, ranks, 2);
  for (int s = 0; s < 2; ++s)
    CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::table);
  CHECK(ranks[2].idle());  // not a member of generation 1, still waiting
  CHECK(server.standby(2));
  CHECK(server.generations() == 1);

  // Slot 1 dies: generation 2 takes the spare at once, beside the survivor, from its step.
  ranks[1].close();
  server.on_exit(1, "was killed by signal 9 (Killed)");
  CHECK(ranks[0].receive().first == Message::reform);
  CHECK(ranks[2].idle());  // a joined spare needs no notice
  join(server, ranks, 0, 7);
  expect_assign(ranks, 0, {"2", "0", "2", "0", "7"});
  expect_assign(ranks, 2, {"2", "1", "2", "0", "7"});
  CHECK(!server.standby(2));
  CHECK(log.str().find("spare slot 2 joins generation 2") != std::string::npos);
  for (int s : {0, 2}) {
    ranks[static_cast<size_t>(s)].send(Message::address, {"2", "a" + std::to_string(s)});
    server.on_readable(s);
  }
  CHECK(ranks[0].receive().first == Message::table);
  CHECK(server.generations() == 2);
}

TEST_CASE_FIXTURE(
    TwoMembersAndSpare,
    "a spare that is ready while the world is short of its ranks opens a generation") {
  join(server, ranks, 0, -1);
  join(server, ranks, 1, -1);
  expect_first_generation(server, ranks, 2);
  CHECK(ranks[0].receive().first == Message::table);
  // Slot 1 dies with no spare ready: slot 0 goes on alone in generation 2.
  ranks[1].close();
  server.on_exit(1, "was killed by signal 9 (Killed)");
  CHECK(ranks[0].receive().first == Message::reform);
  join(server, ranks, 0, 5);
  // A world of one, of a job whose whole world has two ranks (what fixes its global batch).
  CHECK(expect_assign(ranks, 0, {"2", "0", "1", "0", "5"}) == "2");
  ranks[0].send(Message::address, {"2", "a"});
  server.on_readable(0);
  CHECK(ranks[0].receive().first == Message::table);
  // The spare, ready later, opens generation 3 at once and joins slot 0 there.
  attach_spare();
  join(server, ranks, 2, -1);
  auto [type, f] = ranks[0].receive();
  CHECK(type == Message::reform);
  CHECK(f.at(0) == "3");
  join(server, ranks, 0, 6);
  expect_assign(ranks, 0, {"3", "0", "2", "0", "6"});
  CHECK(expect_assign(ranks, 2, {"3", "1", "2", "0", "6"}) == "2");
}

TEST_CASE_FIXTURE(TwoMembersAndSpare,
                  "a spare is not taken while the generation has all its members") {
  attach_spare();
  join(server, ranks, 2, -1);
  join(server, ranks, 0, -1);
  join(server, ranks, 1, -1);
  expect_first_generation(server, ranks, 2);
  // Both members ask for a new generation (an error of their own, no death): no place is free.
  join(server, ranks, 0, 3);
  join(server, ranks, 1, 3);
  for (int s = 0; s < 2; ++s) {
    auto [type, f] = ranks[static_cast<size_t>(s)].receive();
    if (type == Message::table) std::tie(type, f) = ranks[static_cast<size_t>(s)].receive();
    if (type == Message::reform) std::tie(type, f) = ranks[static_cast<size_t>(s)].receive();
    CHECK(type == Message::assign);
    CHECK(f.at(2) == "2");
  }
  CHECK(ranks[2].idle());
  CHECK(server.standby(2));
  CHECK_THROWS_WITH_AS(MembershipServer(2, 1, std::chrono::seconds(1), log, 3),
                       doctest::Contains("3 members of 2 slots"), comm::Error);
  for (auto& r : ranks) ::close(r.fd);
}

TEST_CASE("a place is filled by a spare of the dead rank's node first, then by any node's") {
  // Two nodes of two ranks and one spare each: ranks in slots 0, 1 (node 0) and 2, 3 (node 1),
  // spares in slots 4 (node 0) and 5 (node 1), as troupe launch numbers them.
  std::ostringstream log;
  MembershipServer server(6, 1, std::chrono::seconds(30), log, /*members=*/4);
  CHECK_THROWS_WITH_AS(server.set_slot_nodes({0, 0, 1}),
                       doctest::Contains("nodes of 3 slots (expected 6, one per slot)"),
                       comm::Error);
  server.set_slot_nodes({0, 0, 1, 1, 0, 1});
  std::vector<FakeRank> ranks;
  for (int s = 0; s < 6; ++s) ranks.push_back({server.attach(s, /*standby=*/s >= 4)});
  for (int s : {4, 5, 0, 1, 2, 3}) join(server, ranks, s, -1);
  expect_first_generation(server, ranks, 4);
  for (int s = 0; s < 4; ++s)
    CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::table);

  // Slot 2 of node 1 dies: node 1's spare (slot 5) takes its place, not the lower slot 4.
  ranks[2].close();
  server.on_exit(2, "was killed by signal 9 (Killed)");
  for (int s : {0, 1, 3}) {
    CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::reform);
    join(server, ranks, s, 7);
  }
  expect_assign(ranks, 5, {"2", "3", "4", "0", "7"});
  CHECK(ranks[4].idle());
  CHECK(server.standby(4));
  CHECK(log.str().find("spare slot 5 joins generation 2 (node 1)") != std::string::npos);
  for (int s : {0, 1, 3, 5}) {
    if (s != 5) expect_assign(ranks, s, {"2", std::to_string(s == 3 ? 2 : s), "4", "0", "7"});
    ranks[static_cast<size_t>(s)].send(Message::address, {"2", "a" + std::to_string(s)});
    server.on_readable(s);
  }
  for (int s : {0, 1, 3, 5}) CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::table);
  CHECK(server.generations() == 2);
  CHECK(server.rank_alive());

  // Slot 3 of node 1 dies too: node 1 has no spare waiting, so node 0's takes the place.
  ranks[3].close();
  server.on_exit(3, "was killed by signal 9 (Killed)");
  for (int s : {0, 1, 5}) {
    CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::reform);
    join(server, ranks, s, 9);
  }
  expect_assign(ranks, 4, {"3", "2", "4", "0", "9"});
  CHECK(log.str().find("spare slot 4 joins generation 3 (node 0)") != std::string::npos);
  for (auto& r : ranks)
    if (r.fd >= 0) r.close();
}

TEST_CASE("the membership service stops a world below --min-ranks, telling every survivor why") {
  std::ostringstream log;
  MembershipServer server(3, 3, std::chrono::seconds(30), log);
  auto ranks = attach_all(server, 3);
  for (int s = 0; s < 3; ++s) join(server, ranks, s, -1);
  for (int s = 0; s < 3; ++s) {
    ranks[static_cast<size_t>(s)].receive();
    ranks[static_cast<size_t>(s)].send(Message::address, {"1", "a"});
    server.on_readable(s);
  }
  for (int s = 0; s < 3; ++s) ranks[static_cast<size_t>(s)].receive();
  ::close(ranks[2].fd);
  server.on_readable(2);
  for (int s : {0, 1}) {
    CHECK(ranks[static_cast<size_t>(s)].receive().first == Message::reform);
    join(server, ranks, s, 5);
  }
  for (int s : {0, 1}) {
    auto [type, f] = ranks[static_cast<size_t>(s)].receive();
    CHECK(type == Message::stop);
    CHECK(f[0].find("generation 2 has no quorum") != std::string::npos);
    CHECK(f[0].find("--min-ranks 3") != std::string::npos);
  }
  CHECK(server.stopped());
  CHECK(log.str().find("no quorum") != std::string::npos);
  ::close(ranks[0].fd);
  ::close(ranks[1].fd);
}

TEST_CASE("a generation closes at its deadline without a live rank that never joins") {
  std::ostringstream log;
  MembershipServer server(2, 1, std::chrono::milliseconds(1), log);
  auto ranks = attach_all(server, 2);
  join(server, ranks, 0, -1);
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (ranks[0].idle() && Clock::now() < give_up) server.tick();
  auto [type, f] = ranks[0].receive();
  CHECK(type == Message::assign);
  CHECK(f[2] == "1");  // a world of one
  auto [stop, why] = ranks[1].receive();
  CHECK(stop == Message::stop);
  CHECK(why[0].find("did not join generation 1") != std::string::npos);
  ::close(ranks[0].fd);
  ::close(ranks[1].fd);
}

TEST_CASE("an elastic sampler cuts the same global batches among any number of ranks") {
  ElasticSampler sampler(100, 12, 5);
  CHECK(sampler.steps_per_epoch() == 8);
  std::set<int64_t> epoch;
  for (int64_t step = 0; step < 8; ++step) {
    std::vector<int64_t> whole = sampler.indices(step, 0, 1);
    CHECK(whole.size() == 12);
    for (int world : {2, 3, 4, 5}) {
      std::vector<int64_t> joined;
      for (int r = 0; r < world; ++r) {
        auto part = sampler.indices(step, r, world);
        joined.insert(joined.end(), part.begin(), part.end());
      }
      CHECK(joined == whole);
    }
    epoch.insert(whole.begin(), whole.end());
  }
  CHECK(epoch.size() == 96);                                    // no sample twice in an epoch
  CHECK(sampler.indices(8, 0, 1) != sampler.indices(0, 0, 1));  // the next epoch reshuffles
  CHECK_THROWS_WITH_AS(ElasticSampler(10, 11, 0),
                       doctest::Contains("global_batch 11 (expected 1..10"), comm::Error);
  CHECK_THROWS_WITH_AS(sampler.indices(0, 3, 3),
                       doctest::Contains("expected step >= 0 and 0 <= rank < world"), comm::Error);
}

TEST_CASE("elastic launch options are checked before any rank starts") {
  LaunchOptions o;
  o.nprocs = 3;
  o.command = {"true"};
  o.elastic = true;
  o.min_ranks = 4;
  CHECK_THROWS_WITH_AS(
      rank_env(o, 0, 1),
      doctest::Contains("min_ranks (--min-ranks) = 4 is out of range (expected 1..3"), comm::Error);
  o.min_ranks = 2;
  o.nnodes = 2;
  o.master_addr = "node0";
  // Several nodes: the quorum counts every node's ranks.
  o.min_ranks = 6;
  CHECK_NOTHROW(rank_env(o, 0, 1));
  o.min_ranks = 7;
  CHECK_THROWS_WITH_AS(rank_env(o, 0, 1),
                       doctest::Contains("min_ranks (--min-ranks) = 7 is out of range (expected "
                                         "1..6 for --nnodes 2 x -n 3)"),
                       comm::Error);
  o.min_ranks = 2;
  o.spares = 1;  // per node: each node's launcher runs its own
  CHECK_NOTHROW(rank_env(o, 0, 1));
  o.spares = 0;
  o.nnodes = 1;
  o.elastic = false;
  o.max_restarts = 2;
  CHECK_THROWS_WITH_AS(rank_env(o, 0, 1), doctest::Contains("without elastic"), comm::Error);
  o.elastic = true;
  o.max_restarts = -1;
  CHECK_THROWS_WITH_AS(rank_env(o, 0, 1), doctest::Contains("is negative"), comm::Error);
  o.max_restarts = 1;
  o.spares = -1;
  CHECK_THROWS_WITH_AS(rank_env(o, 0, 1), doctest::Contains("spares (--spares) = -1 is negative"),
                       comm::Error);
  o.spares = 1;
  o.elastic = false;
  o.max_restarts = 0;
  CHECK_THROWS_WITH_AS(rank_env(o, 0, 1),
                       doctest::Contains("spares (--spares) = 1 without elastic"), comm::Error);
}
