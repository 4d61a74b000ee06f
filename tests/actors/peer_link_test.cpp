// actors::peer_link on its own, driven by messages: its gossip rounds over an edge, its public
// copy of a neighbour, its liveness. The links run under CAF's test coordinator
// (scheduler.policy = testing), so every message is delivered on this thread when the test says
// sched.run(), and over the inproc transport, whose completions run inline: each case is
// deterministic. (CAF's test DSL, caf/test/dsl.hpp, needs CAF's own unit-test engine, not
// doctest; the coordinator underneath it does not.) Answers go to a recorder actor.
#include "actors/peer_link.h"

#include <doctest/doctest.h>

#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/gossip_links.h"
#include "comm/codecs/minmax.h"
#include "comm/transport/inproc/transport.h"

using namespace troupe;
using actors::EdgePayload;
using actors::EdgeResult;
using actors::EdgeRound;
using actors::EdgeSettings;

namespace {

struct Answers {
  std::vector<EdgeResult> edges;
  std::vector<std::pair<int, std::string>> states;
  std::vector<actors::StreamSent> sent;
  std::vector<actors::StreamArrival> arrivals;
  std::vector<std::string> arrived;  // each arrival's bytes, copied when it came
  size_t message_bytes = 0;
};

caf::behavior recorder(caf::event_based_actor*, Answers* out) {
  return {
      [out](actors::edge_done_atom, const EdgeResult& r) { out->edges.push_back(r); },
      [out](actors::link_state_atom, int peer, const std::string& failure) {
        out->states.emplace_back(peer, failure);
      },
      [out](actors::posted_atom, const actors::StreamSent& s) { out->sent.push_back(s); },
      [out](actors::arrived_atom, const actors::StreamArrival& a) {
        out->arrivals.push_back(a);
        out->arrived.push_back(a.data ? std::string(a.data, out->message_bytes) : std::string());
      },
  };
}

/// An actor system whose scheduler is CAF's test coordinator, two inproc ranks, and a recorder
/// per rank for the answers of that rank's links.
struct Deterministic {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  caf::scheduler::test_coordinator* sched = nullptr;
  comm::InprocFabric fabric{2};
  Answers answers[2];
  caf::actor recorders[2];
  std::vector<caf::actor> spawned;

  Deterministic() {
    config.set("scheduler.policy", caf::atom("testing"));
    config.set("logger.file-verbosity", caf::atom("quiet"));
    system = std::make_unique<caf::actor_system>(config);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(system->scheduler());
    for (int r = 0; r < 2; ++r) recorders[r] = keep(system->spawn(recorder, &answers[r]));
  }
  ~Deterministic() {
    for (auto& a : spawned) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    sched->run();
  }
  caf::actor keep(caf::actor a) {
    spawned.push_back(a);
    return a;
  }
  /// Rank `rank`'s link to the other rank.
  caf::actor link(int rank, EdgeSettings edge) {
    edge.peer = 1 - rank;
    return keep(actors::spawn_gossip_link(*system, std::move(edge), fabric.transport(rank)));
  }
  /// Sends `link` of rank `rank` a round, as that rank's recorder.
  void exchange(int rank, const caf::actor& link, EdgeRound r) {
    caf::send_as(recorders[rank], link, actors::exchange_atom::value, r);
  }
};

EdgeRound round_of(uint64_t index, bool send, bool receive, const void* data, size_t bytes) {
  EdgeRound r;
  r.round = index;
  r.send = send;
  r.receive = receive;
  r.data = data;
  r.bytes = bytes;
  return r;
}

}  // namespace

TEST_CASE(
    "two peer links carry a D-PSGD round: each neighbour's weights arrive in the other's link") {
  Deterministic t;
  auto a = t.link(0, {}), b = t.link(1, {});
  const std::vector<float> x0 = {1, 2, 3, 4}, x1 = {-5, 6.5f, 0, 1e-3f};
  const size_t bytes = x0.size() * sizeof(float);
  t.exchange(0, a, round_of(7, true, true, x0.data(), bytes));
  t.sched->run();
  CHECK(t.answers[0].edges.empty());  // rank 1 has posted nothing yet: the round waits for it
  t.exchange(1, b, round_of(7, true, true, x1.data(), bytes));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 1);
  REQUIRE(t.answers[1].edges.size() == 1);
  const EdgeResult& r0 = t.answers[0].edges[0];
  const EdgeResult& r1 = t.answers[1].edges[0];
  CHECK(r0.ok);
  CHECK(r0.error == "");
  CHECK(r0.peer == 1);
  CHECK(r0.round == 7);
  CHECK(r0.bytes_sent == bytes);
  CHECK(r0.bytes_received == bytes);
  CHECK(std::vector<float>(r0.values, r0.values + 4) == x1);
  CHECK(r1.peer == 0);
  CHECK(std::vector<float>(r1.values, r1.values + 4) == x0);
}

TEST_CASE("a directed edge carries a round one way: the sender's link answers with no values") {
  Deterministic t;
  auto a = t.link(0, {}), b = t.link(1, {});
  const std::vector<float> x0 = {3, 1, 4};
  t.exchange(0, a, round_of(0, true, false, x0.data(), 12));
  t.exchange(1, b, round_of(0, false, true, nullptr, 12));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 1);
  REQUIRE(t.answers[1].edges.size() == 1);
  CHECK(t.answers[0].edges[0].ok);
  CHECK(t.answers[0].edges[0].values == nullptr);
  CHECK(t.answers[0].edges[0].bytes_received == 0);
  CHECK(t.answers[1].edges[0].bytes_sent == 0);
  CHECK(std::vector<float>(t.answers[1].edges[0].values, t.answers[1].edges[0].values + 3) == x0);
}

TEST_CASE("a Choco-SGD link adds each 8-bit difference to its public copy of the neighbour") {
  Deterministic t;
  const size_t n = 37, block = 8;  // a last, short block
  std::vector<float> start(n);
  for (size_t i = 0; i < n; ++i) start[i] = 0.25f * static_cast<float>(i) - 3;
  EdgeSettings edge;
  edge.payload = EdgePayload::minmax8_difference;
  edge.public_copy = start;
  edge.block = block;
  auto a = t.link(0, edge);             // rank 0's copy of rank 1
  auto b = t.link(1, {});               // rank 1 only sends its differences
  std::vector<float> expected = start;  // the reference: decode, then add, outside the link
  std::vector<float> decoded(n);
  for (uint64_t round = 0; round < 3; ++round) {
    std::vector<float> difference(n);
    for (size_t i = 0; i < n; ++i)
      difference[i] = static_cast<float>((i * 7 + round * 3) % 11) - 5.0f + 0.1f * round;
    std::vector<uint8_t> q(comm::minmax_bytes(comm::MinMaxBits::eight, n, block));
    comm::minmax_encode(comm::MinMaxBits::eight, difference.data(), n, block, q.data());
    comm::minmax_decode(comm::MinMaxBits::eight, q.data(), n, block, decoded.data());
    for (size_t i = 0; i < n; ++i) expected[i] += decoded[i];
    t.exchange(0, a, round_of(round, false, true, nullptr, q.size()));
    t.exchange(1, b, round_of(round, true, false, q.data(), q.size()));
    t.sched->run();
    REQUIRE(t.answers[0].edges.size() == round + 1);
    const EdgeResult& r = t.answers[0].edges.back();
    REQUIRE(r.ok);
    CHECK(r.round == round);
    CHECK(std::vector<float>(r.values, r.values + n) == expected);
  }
}

TEST_CASE("a peer link told that its peer died fails the round in flight and every later one") {
  Deterministic t;
  auto a = t.link(0, {});
  std::vector<float> x(4, 1.0f);
  t.exchange(0, a, round_of(1, true, true, x.data(), 16));
  t.sched->run();
  CHECK(t.answers[0].edges.empty());
  caf::send_as(t.recorders[0], a, actors::health_atom::value);
  t.sched->run();
  REQUIRE(t.answers[0].states.size() == 1);
  CHECK(t.answers[0].states[0] == std::make_pair(1, std::string()));

  caf::anon_send(a, actors::fail_atom::value, std::string("rank 1 died: killed"));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 1);
  CHECK_FALSE(t.answers[0].edges[0].ok);
  CHECK(t.answers[0].edges[0].error.find("rank 1 died: killed") != std::string::npos);
  CHECK(t.answers[0].edges[0].values == nullptr);

  t.exchange(0, a, round_of(2, true, true, x.data(), 16));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 2);
  CHECK_FALSE(t.answers[0].edges[1].ok);
  CHECK(t.answers[0].edges[1].error == "gossip round 2 with rank 1: rank 1 died: killed");

  caf::send_as(t.recorders[0], a, actors::health_atom::value);
  t.sched->run();
  REQUIRE(t.answers[0].states.size() == 2);
  CHECK(t.answers[0].states[1] == std::make_pair(1, std::string("rank 1 died: killed")));
}

TEST_CASE("a peer link refuses rounds out of order, a second round in flight and a wrong size") {
  Deterministic t;
  EdgeSettings choco;
  choco.payload = EdgePayload::minmax8_difference;
  choco.public_copy.assign(10, 0.0f);
  choco.block = 4;
  auto a = t.link(0, choco);
  const size_t right = comm::minmax_bytes(comm::MinMaxBits::eight, 10, 4);
  std::vector<uint8_t> q(right);
  t.exchange(0, a, round_of(5, false, true, nullptr, right));  // stays in flight: rank 1 is silent
  t.exchange(0, a, round_of(6, false, true, nullptr, right));
  t.exchange(0, a, round_of(9, false, true, nullptr, right + 1));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 2);
  CHECK(
      t.answers[0].edges[0].error ==
      "gossip round 6 with rank 1: round 5 is still in flight on this edge (one round at a time)");
  CHECK(t.answers[0].edges[1].round == 9);
  CHECK(t.answers[0].edges[1].error.find(
            "gossip round 9 with rank 1: round 5 is still in flight") == 0);

  auto b = t.link(1, {});  // rank 1 sends round 5: the round in flight ends well
  t.exchange(1, b, round_of(5, true, false, q.data(), right));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 3);
  CHECK(t.answers[0].edges[2].round == 5);
  CHECK(t.answers[0].edges[2].ok);

  t.exchange(0, a, round_of(4, false, true, nullptr, right));
  t.exchange(0, a, round_of(9, false, true, nullptr, right + 1));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 5);
  CHECK(t.answers[0].edges[3].error ==
        "gossip round 4 with rank 1: the edge has carried round 5 already; rounds go in "
        "increasing order");
  CHECK(t.answers[0].edges[4].error ==
        "gossip round 9 with rank 1: " + std::to_string(right + 1) +
            " bytes, but an 8-bit difference of 10 values in blocks of 4 has " +
            std::to_string(right));
}

TEST_CASE("a worker's peer link carries no gossip rounds, and a gossip link needs another rank") {
  Deterministic t;
  auto worker_link = t.keep(actors::spawn_peer_link(*t.system, 1, t.fabric.transport(0)));
  std::vector<float> x(2);
  t.exchange(0, worker_link, round_of(0, true, true, x.data(), 8));
  t.sched->run();
  REQUIRE(t.answers[0].edges.size() == 1);
  CHECK(t.answers[0].edges[0].error ==
        "gossip round 0 with rank 1: this peer link belongs to the worker and carries no gossip "
        "rounds");

  EdgeSettings self_edge;
  self_edge.peer = 0;
  CHECK_THROWS_WITH(actors::spawn_gossip_link(*t.system, self_edge, t.fabric.transport(0)),
                    "gossip link of rank 0 to rank 0: expected another rank in [0, 2)");
  EdgeSettings no_copy;
  no_copy.peer = 1;
  no_copy.payload = EdgePayload::minmax8_difference;
  no_copy.block = 4;
  CHECK_THROWS_WITH(actors::spawn_gossip_link(*t.system, no_copy, t.fabric.transport(0)),
                    "gossip link of rank 0 to rank 1: an 8-bit difference link needs a block >= 1 "
                    "and a public copy to start from (block 4, 0 values)");
}

TEST_CASE("a message-stream link carries AD-PSGD's messages in order, one receive at a time") {
  Deterministic t;
  EdgeSettings stream;
  stream.payload = EdgePayload::messages;
  stream.message_bytes = 8;
  t.answers[0].message_bytes = t.answers[1].message_bytes = 8;
  auto a = t.link(0, stream), b = t.link(1, stream);
  auto message = [](const char* text) {
    return actors::StreamMessage{std::make_shared<const std::vector<char>>(text, text + 8)};
  };
  caf::send_as(t.recorders[0], a, actors::post_atom::value, message("request1"));
  caf::send_as(t.recorders[0], a, actors::post_atom::value, message("bye_____"));
  caf::send_as(t.recorders[0], a, actors::post_atom::value,
               actors::StreamMessage{std::make_shared<const std::vector<char>>(9, 'x')});
  t.sched->run();
  CHECK(t.answers[0].sent.size() == 1);  // the wrong size, at once; the others wait for rank 1
  CHECK(t.answers[0].sent[0].error ==
        "message stream with rank 1: a message of 9 bytes, expected 8");
  CHECK_FALSE(t.answers[0].sent[0].ok);

  caf::send_as(t.recorders[1], b, actors::listen_atom::value);
  caf::send_as(t.recorders[1], b, actors::listen_atom::value);  // refused: one at a time
  t.sched->run();
  REQUIRE(t.answers[1].arrivals.size() == 2);
  CHECK(t.answers[1].arrivals[0].error ==
        "message stream with rank 0: a receive is posted already (one at a time)");
  CHECK(t.answers[1].arrivals[1].ok);
  CHECK(t.answers[1].arrivals[1].peer == 0);
  CHECK(t.answers[1].arrived[1] == "request1");
  REQUIRE(t.answers[0].sent.size() == 2);
  CHECK(t.answers[0].sent[1].ok);
  CHECK(t.answers[0].sent[1].bytes == 8);

  caf::send_as(t.recorders[1], b, actors::listen_atom::value);
  caf::send_as(t.recorders[1], b, actors::post_atom::value, message("reply__1"));
  caf::send_as(t.recorders[0], a, actors::listen_atom::value);
  t.sched->run();
  REQUIRE(t.answers[1].arrivals.size() == 3);
  CHECK(t.answers[1].arrived[2] == "bye_____");
  REQUIRE(t.answers[0].arrivals.size() == 1);
  CHECK(t.answers[0].arrived[0] == "reply__1");

  caf::send_as(t.recorders[0], a, actors::listen_atom::value);  // rank 1 then dies
  t.sched->run();
  caf::anon_send(a, actors::fail_atom::value, std::string("rank 1 died"));
  t.sched->run();
  REQUIRE(t.answers[0].arrivals.size() == 2);
  CHECK_FALSE(t.answers[0].arrivals[1].ok);
  CHECK(t.answers[0].arrivals[1].error == "rank 1 died");
  caf::send_as(t.recorders[0], a, actors::post_atom::value, message("request2"));
  t.sched->run();
  CHECK(t.answers[0].sent.back().error == "message stream with rank 1: rank 1 died");
}

// GossipLinks waits on the trainer's thread, so it runs on CAF's real scheduler; its deadline is
// the only clock involved.
TEST_CASE("GossipLinks fails a neighbour that stays silent past the round's deadline, naming it") {
  caf::actor_system_config config;
  config.set("scheduler.max-threads", 2);
  caf::actor_system system{config};
  comm::InprocFabric fabric(3);
  actors::GossipLinks links(system, fabric.transport(0), 5u << 28);
  // Rank 1 answers through links of its own; rank 2 never does.
  actors::GossipLinks other(system, fabric.transport(1), 5u << 28);
  std::vector<float> x0 = {1, 2}, x1 = {3, 4};
  links.start(0, x0.data(), 8, {1, 2}, {1, 2});
  other.start(0, x1.data(), 8, {0}, {0});
  auto outcome =
      links.wait(std::chrono::steady_clock::now() + std::chrono::milliseconds(200), "test round 0");
  CHECK(outcome.received == std::vector<int>{1});
  REQUIRE(outcome.values.size() == 1);
  CHECK(std::vector<float>(outcome.values[0], outcome.values[0] + 2) == x1);
  REQUIRE(outcome.failed.size() == 1);
  CHECK(outcome.failed[0].first == 2);
  CHECK(outcome.failed[0].second.find("test round 0: no message from rank 2 after ") == 0);
  CHECK(outcome.bytes_received == 8);
  CHECK(outcome.bytes_sent == 8);  // to rank 1; the send to rank 2 failed
  auto theirs = other.wait(std::chrono::steady_clock::now() + std::chrono::seconds(30), "theirs");
  CHECK(theirs.received == std::vector<int>{0});
  CHECK(std::vector<float>(theirs.values[0], theirs.values[0] + 2) == x0);
  CHECK_THROWS_WITH(links.wait(std::chrono::steady_clock::now(), "test round 1"),
                    "test round 1: no round in flight to wait for");
}
