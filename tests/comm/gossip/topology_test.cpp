// Gossip topologies (comm/gossip/topology.h): neighbour lists and weights against tables written
// out by hand, validation messages, and spectral gaps against closed forms and against the
// convergence of gossip averaging itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "comm/gossip/topology.h"
#include "comm/status.h"

using namespace troupe::comm;

namespace {

const double kPi = std::acos(-1.0);

TopologySpec spec_of(TopologyKind kind, Mixing mixing = Mixing::uniform) {
  TopologySpec spec;
  spec.kind = kind;
  spec.mixing = mixing;
  return spec;
}

TopologySpec torus_spec(int rows, int cols, Mixing mixing = Mixing::uniform) {
  TopologySpec spec = spec_of(TopologyKind::torus, mixing);
  spec.rows = rows;
  spec.cols = cols;
  return spec;
}

TopologySpec edge_list_spec(std::vector<std::pair<int, int>> edges,
                            Mixing mixing = Mixing::uniform) {
  TopologySpec spec = spec_of(TopologyKind::edge_list, mixing);
  spec.edges = std::move(edges);
  return spec;
}

TopologySpec matching_spec(uint64_t seed) {
  TopologySpec spec = spec_of(TopologyKind::random_matching);
  spec.seed = seed;
  return spec;
}

// The message of the comm::Error that building the topology throws ("" when none is thrown).
std::string error_of(const TopologySpec& spec, int world_size) {
  try {
    Topology topology(spec, world_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Checks that every static rank's round is undirected (send_to == recv_from) with `expected`
// neighbours, and that the weights sum to one.
void check_neighbours(const Topology& topology, const std::vector<std::vector<int>>& expected) {
  REQUIRE(topology.world_size() == static_cast<int>(expected.size()));
  for (int rank = 0; rank < topology.world_size(); ++rank) {
    CAPTURE(rank);
    const RoundPeers peers = topology.round(rank, 0);
    CHECK(peers.send_to == expected[static_cast<size_t>(rank)]);
    CHECK(peers.recv_from == expected[static_cast<size_t>(rank)]);
    REQUIRE(peers.recv_weights.size() == peers.recv_from.size());
    double sum = peers.self_weight;
    for (double w : peers.recv_weights) sum += w;
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-15));
  }
}

// partner[i] of a random_matching round, -1 when i sits out; checks the round's shape on the way.
std::vector<int> partners(const Topology& topology, uint64_t round) {
  std::vector<int> partner;
  for (int rank = 0; rank < topology.world_size(); ++rank) {
    const RoundPeers peers = topology.round(rank, round);
    REQUIRE(peers.send_to == peers.recv_from);
    REQUIRE(peers.send_to.size() <= 1);
    if (peers.send_to.empty()) {
      CHECK(peers.self_weight == 1.0);
      partner.push_back(-1);
    } else {
      CHECK(peers.self_weight == 0.5);
      CHECK(peers.recv_weights == std::vector<double>{0.5});
      partner.push_back(peers.send_to[0]);
    }
  }
  return partner;
}

// The gap of ring n with uniform weights 1/3: W is circulant, eigenvalues (1 + 2 cos(2 pi k/n))/3.
double ring_gap_closed_form(int n) {
  double second = 0;
  for (int k = 1; k < n; ++k)
    second = std::max(second, std::abs((1 + 2 * std::cos(2 * kPi * k / n)) / 3));
  return 1 - second;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names

TEST_CASE("topology kinds and mixings parse back from their names, and others are refused") {
  for (TopologyKind kind :
       {TopologyKind::ring, TopologyKind::torus, TopologyKind::complete, TopologyKind::exponential,
        TopologyKind::random_matching, TopologyKind::edge_list})
    CHECK(parse_topology_kind(topology_kind_name(kind)) == kind);
  CHECK(std::string(topology_kind_name(TopologyKind::random_matching)) == "random_matching");
  CHECK(parse_mixing("uniform") == Mixing::uniform);
  CHECK(parse_mixing("metropolis") == Mixing::metropolis);

  try {
    parse_topology_kind("hypercube");
    FAIL("no error");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(contains(what, "'hypercube'"));
    for (const char* name :
         {"ring", "torus", "complete", "exponential", "random_matching", "edge_list"})
      CHECK(contains(what, name));
  }
  try {
    parse_mixing("Metropolis");
    FAIL("no error");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(contains(what, "'Metropolis'"));
    CHECK(contains(what, "uniform"));
    CHECK(contains(what, "metropolis"));
  }
}

TEST_CASE("describe names the kind, the size and the mixing") {
  CHECK(Topology(spec_of(TopologyKind::ring), 8).describe() == "ring(8, uniform)");
  CHECK(Topology(torus_spec(2, 4, Mixing::metropolis), 8).describe() == "torus(2x4, metropolis)");
  CHECK(Topology(spec_of(TopologyKind::exponential, Mixing::metropolis), 8).describe() ==
        "exponential(8)");
  CHECK(Topology(matching_spec(1), 8).describe() == "random_matching(8, seed 1)");
  CHECK(Topology(
            edge_list_spec({{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 0}, {0, 2}}, Mixing::metropolis), 5)
            .describe() == "edge_list(5 ranks, 6 edges, metropolis)");
  CHECK(Topology(spec_of(TopologyKind::complete), 4).describe() == "complete(4, uniform)");
}

// ---------------------------------------------------------------------------------------------
// Static graphs

TEST_CASE("ring of 8 links each rank to its two neighbours with weights 1/3") {
  const Topology ring(spec_of(TopologyKind::ring), 8);
  CHECK_FALSE(ring.time_varying());
  CHECK(ring.undirected());
  check_neighbours(ring, {{1, 7}, {0, 2}, {1, 3}, {2, 4}, {3, 5}, {4, 6}, {5, 7}, {0, 6}});
  const RoundPeers peers = ring.round(3, 17);  // static: every round is the same
  CHECK(peers.recv_weights == std::vector<double>{1.0 / 3, 1.0 / 3});
  CHECK(peers.self_weight == 1.0 / 3);
}

TEST_CASE("ring of 2 counts its one neighbour once, with weights 1/2 and 1/2") {
  for (Mixing mixing : {Mixing::uniform, Mixing::metropolis}) {
    const Topology ring(spec_of(TopologyKind::ring, mixing), 2);
    check_neighbours(ring, {{1}, {0}});
    for (int rank = 0; rank < 2; ++rank) {
      const RoundPeers peers = ring.round(rank, 0);
      CHECK(peers.recv_weights == std::vector<double>{0.5});
      CHECK(peers.self_weight == 0.5);
    }
    CHECK(ring.mixing_matrix(0) == std::vector<std::vector<double>>{{0.5, 0.5}, {0.5, 0.5}});
  }
}

TEST_CASE("a world of one rank has no neighbours and keeps its own vector") {
  for (const TopologySpec& spec :
       {spec_of(TopologyKind::ring), spec_of(TopologyKind::complete, Mixing::metropolis),
        torus_spec(1, 1), spec_of(TopologyKind::exponential), matching_spec(3),
        edge_list_spec({})}) {
    const Topology topology(spec, 1);
    CAPTURE(topology.describe());
    for (uint64_t round = 0; round < 3; ++round) {
      const RoundPeers peers = topology.round(0, round);
      CHECK(peers.send_to.empty());
      CHECK(peers.recv_from.empty());
      CHECK(peers.recv_weights.empty());
      CHECK(peers.self_weight == 1.0);
    }
    CHECK(topology.mixing_matrix(0) == std::vector<std::vector<double>>{{1.0}});
    CHECK(topology.doubly_stochastic());
  }
}

TEST_CASE("torus 2x4 merges the wrap-around neighbour with the direct one") {
  // Rank r * 4 + c sits at row r, column c; with 2 rows, up and down are the same rank.
  const Topology torus(torus_spec(2, 4), 8);
  check_neighbours(
      torus,
      {{1, 3, 4}, {0, 2, 5}, {1, 3, 6}, {0, 2, 7}, {0, 5, 7}, {1, 4, 6}, {2, 5, 7}, {3, 4, 6}});
  CHECK(torus.round(5, 0).self_weight == 0.25);
  CHECK(torus.round(5, 0).recv_weights == std::vector<double>{0.25, 0.25, 0.25});
}

TEST_CASE("torus 3x3 gives every rank four neighbours") {
  const Topology torus(torus_spec(3, 3), 9);
  check_neighbours(torus, {{1, 2, 3, 6},
                           {0, 2, 4, 7},
                           {0, 1, 5, 8},
                           {0, 4, 5, 6},
                           {1, 3, 5, 7},
                           {2, 3, 4, 8},
                           {0, 3, 7, 8},
                           {1, 4, 6, 8},
                           {2, 5, 6, 7}});
  CHECK(torus.round(4, 0).self_weight == 0.2);
}

TEST_CASE("a torus with one row or one column is a ring") {
  const Topology ring(spec_of(TopologyKind::ring), 5);
  for (const TopologySpec& spec : {torus_spec(1, 5), torus_spec(5, 1)}) {
    const Topology torus(spec, 5);
    CAPTURE(torus.describe());
    CHECK(torus.mixing_matrix(0) == ring.mixing_matrix(0));
  }
  check_neighbours(Topology(torus_spec(1, 2), 2), {{1}, {0}});
  check_neighbours(Topology(torus_spec(2, 2), 4), {{1, 2}, {0, 3}, {0, 3}, {1, 2}});
}

TEST_CASE("complete graph links everyone with weights 1/n") {
  const Topology complete(spec_of(TopologyKind::complete), 4);
  check_neighbours(complete, {{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}});
  const auto w = complete.mixing_matrix(0);
  for (const auto& row : w)
    for (double x : row) CHECK(x == 0.25);
}

TEST_CASE("metropolis weights on an irregular graph match the formula worked by hand") {
  // Degrees: 0 -> 3, 1 -> 1, 2 -> 1, 3 -> 2, 4 -> 1.
  const Topology graph(edge_list_spec({{0, 1}, {2, 0}, {0, 3}, {3, 4}}, Mixing::metropolis), 5);
  check_neighbours(graph, {{1, 2, 3}, {0}, {0}, {0, 4}, {3}});
  const std::vector<std::vector<double>> expected = {
      {1.0 / 4, 1.0 / 4, 1.0 / 4, 1.0 / 4, 0},
      {1.0 / 4, 3.0 / 4, 0, 0, 0},
      {1.0 / 4, 0, 3.0 / 4, 0, 0},
      {1.0 / 4, 0, 0, 5.0 / 12, 1.0 / 3},
      {0, 0, 0, 1.0 / 3, 2.0 / 3},
  };
  const auto w = graph.mixing_matrix(0);
  for (size_t i = 0; i < 5; ++i)
    for (size_t j = 0; j < 5; ++j) {
      CAPTURE(i);
      CAPTURE(j);
      CHECK(w[i][j] == doctest::Approx(expected[i][j]).epsilon(1e-15));
    }
  CHECK(graph.doubly_stochastic());
}

TEST_CASE("every static kind is doubly stochastic with metropolis, regular ones with uniform") {
  const std::vector<std::pair<int, int>> irregular = {{0, 1}, {1, 2}, {2, 3}, {3, 0},
                                                      {0, 2}, {2, 4}, {4, 5}, {5, 6}};
  struct Case {
    TopologySpec spec;
    int world_size;
  };
  const std::vector<Case> cases = {
      {spec_of(TopologyKind::ring), 2},
      {spec_of(TopologyKind::ring), 3},
      {spec_of(TopologyKind::ring), 8},
      {spec_of(TopologyKind::ring), 13},
      {torus_spec(2, 4), 8},
      {torus_spec(3, 3), 9},
      {torus_spec(4, 4), 16},
      {torus_spec(3, 5), 15},
      {torus_spec(1, 6), 6},
      {spec_of(TopologyKind::complete), 2},
      {spec_of(TopologyKind::complete), 7},
      {edge_list_spec({{0, 1}, {1, 2}, {2, 0}}), 3},
  };
  for (Case c : cases) {
    c.spec.mixing = Mixing::uniform;
    CAPTURE(Topology(c.spec, c.world_size).describe());
    CHECK(Topology(c.spec, c.world_size).doubly_stochastic());
    c.spec.mixing = Mixing::metropolis;
    CHECK(Topology(c.spec, c.world_size).doubly_stochastic());
  }
  CHECK(Topology(edge_list_spec(irregular, Mixing::metropolis), 7).doubly_stochastic());
}

TEST_CASE("uniform weights on an irregular graph are not doubly stochastic") {
  // A path 0 - 1 - 2: rank 1 gives 1/3 to each, the ends 1/2: column 1 sums to 1/2+1/3+1/2.
  const Topology path(edge_list_spec({{0, 1}, {1, 2}}), 3);
  CHECK_FALSE(path.doubly_stochastic());
  const auto w = path.mixing_matrix(0);
  CHECK(w[0][0] + w[1][0] + w[2][0] == doctest::Approx(5.0 / 6));
  CHECK(w[0][1] + w[1][1] + w[2][1] == doctest::Approx(4.0 / 3));
  // Its rows still sum to one: each rank's round is a proper average.
  for (const auto& row : w) CHECK(row[0] + row[1] + row[2] == doctest::Approx(1.0));
  CHECK(Topology(edge_list_spec({{0, 1}, {1, 2}}, Mixing::metropolis), 3).doubly_stochastic());
}

// ---------------------------------------------------------------------------------------------
// Time-varying graphs

TEST_CASE("exponential graph of 8 cycles through shifts 1, 2, 4") {
  const Topology exponential(spec_of(TopologyKind::exponential), 8);
  CHECK(exponential.time_varying());
  CHECK_FALSE(exponential.undirected());
  struct Expected {
    int rank;
    uint64_t round;
    int send_to;
    int recv_from;
  };
  for (const Expected& e : std::vector<Expected>{{0, 0, 1, 7},
                                                 {0, 1, 2, 6},
                                                 {0, 2, 4, 4},
                                                 {0, 3, 1, 7},
                                                 {5, 0, 6, 4},
                                                 {5, 1, 7, 3},
                                                 {5, 2, 1, 1},
                                                 {5, 3, 6, 4},
                                                 {7, 0, 0, 6},
                                                 {7, 1, 1, 5},
                                                 {7, 2, 3, 3},
                                                 {7, 3, 0, 6},
                                                 {3, 301, 5, 1}}) {  // 301 mod 3 = 1: shift 2
    CAPTURE(e.rank);
    CAPTURE(e.round);
    const RoundPeers peers = exponential.round(e.rank, e.round);
    CHECK(peers.send_to == std::vector<int>{e.send_to});
    CHECK(peers.recv_from == std::vector<int>{e.recv_from});
    CHECK(peers.recv_weights == std::vector<double>{0.5});
    CHECK(peers.self_weight == 0.5);
  }
  CHECK(exponential.doubly_stochastic());
}

TEST_CASE("exponential graph of 5 has period 3 and of 2 a single peer") {
  const Topology five(spec_of(TopologyKind::exponential), 5);
  // ceil(log2 5) = 3: shifts 1, 2, 4, then 1 again.
  const int shifts[] = {1, 2, 4, 1};
  for (uint64_t round = 0; round < 4; ++round) {
    for (int rank = 0; rank < 5; ++rank) {
      const RoundPeers peers = five.round(rank, round);
      CHECK(peers.send_to == std::vector<int>{(rank + shifts[round]) % 5});
      CHECK(peers.recv_from == std::vector<int>{(rank + 5 - shifts[round]) % 5});
    }
  }
  CHECK(five.doubly_stochastic());
  const Topology two(spec_of(TopologyKind::exponential), 2);
  for (uint64_t round = 0; round < 3; ++round) {
    CHECK(two.round(0, round).send_to == std::vector<int>{1});
    CHECK(two.round(1, round).recv_from == std::vector<int>{0});
  }
}

TEST_CASE("random matching pairs every rank exactly once, symmetrically") {
  for (int n : {2, 4, 7, 8, 33}) {
    const Topology matching(matching_spec(12345), n);
    CHECK(matching.time_varying());
    CHECK(matching.undirected());
    for (uint64_t round = 0; round < 50; ++round) {
      CAPTURE(n);
      CAPTURE(round);
      const std::vector<int> partner = partners(matching, round);
      int unpaired = 0;
      for (int i = 0; i < n; ++i) {
        const int p = partner[static_cast<size_t>(i)];
        if (p < 0) {
          ++unpaired;
          continue;
        }
        REQUIRE(p != i);
        REQUIRE(p < n);
        CHECK(partner[static_cast<size_t>(p)] == i);
      }
      CHECK(unpaired == n % 2);
    }
    CHECK(matching.doubly_stochastic());
  }
}

TEST_CASE("random matching is the same for the same seed and changes with round and seed") {
  const Topology a(matching_spec(1), 8), b(matching_spec(1), 8), other(matching_spec(2), 8);
  std::set<std::vector<int>> distinct;
  int differing_from_other_seed = 0;
  for (uint64_t round = 0; round < 20; ++round) {
    const std::vector<int> pa = partners(a, round);
    CHECK(pa == partners(b, round));
    distinct.insert(pa);
    if (pa != partners(other, round)) ++differing_from_other_seed;
  }
  // 105 perfect matchings of 8 ranks: 20 uniform draws give about 18 distinct ones.
  CHECK(distinct.size() >= 12);
  CHECK(differing_from_other_seed >= 15);
  // Rounds far apart and a seed that differs in its top bit only.
  TopologySpec high = matching_spec(1ull << 63);
  CHECK(partners(a, 1000000007) != partners(a, 1000000008));
  bool any_difference = false;
  for (uint64_t round = 0; round < 5; ++round)
    any_difference |= partners(Topology(high, 8), round) != partners(a, round);
  CHECK(any_difference);
}

TEST_CASE("random matching draws each matching of 4 ranks and each odd rank out equally often") {
  // 4 ranks have 3 perfect matchings; over 3000 rounds each should come up 1000 +- 3 sigma (~77).
  const Topology four(matching_spec(7), 4);
  std::map<std::vector<int>, int> counts;
  for (uint64_t round = 0; round < 3000; ++round) ++counts[partners(four, round)];
  CHECK(counts.size() == 3);
  for (const auto& entry : counts) CHECK(std::abs(entry.second - 1000) < 80);

  // 5 ranks: each sits out a fifth of the rounds (400 +- 3 sigma of ~54 over 2000 rounds).
  const Topology five(matching_spec(7), 5);
  std::vector<int> out(5, 0);
  for (uint64_t round = 0; round < 2000; ++round) {
    const std::vector<int> partner = partners(five, round);
    for (int i = 0; i < 5; ++i)
      if (partner[static_cast<size_t>(i)] < 0) ++out[static_cast<size_t>(i)];
  }
  for (int count : out) CHECK(std::abs(count - 400) < 60);
}

// ---------------------------------------------------------------------------------------------
// Validation

TEST_CASE("topology validation names the thing, the value and what was expected") {
  SUBCASE("world size") {
    const std::string what = error_of(spec_of(TopologyKind::ring), 0);
    CHECK(contains(what, "world size 0"));
    CHECK(contains(what, "at least 1"));
    CHECK(contains(error_of(spec_of(TopologyKind::complete), -3), "world size -3"));
  }
  SUBCASE("torus shape") {
    CHECK(error_of(torus_spec(2, 3), 8) ==
          "topology torus: rows * cols = 2 * 3 = 6, expected the world size 8");
    const std::string zero = error_of(torus_spec(0, 8), 8);
    CHECK(contains(zero, "rows 0"));
    CHECK(contains(zero, "at least 1"));
    CHECK(contains(error_of(torus_spec(4, -2), 8), "cols -2"));
  }
  SUBCASE("edge out of range") {
    CHECK(error_of(edge_list_spec({{0, 1}, {3, 9}}), 8) ==
          "topology edge_list: rank 9 in edge [3, 9] is outside [0, 8)");
    CHECK(contains(error_of(edge_list_spec({{-1, 2}}), 8), "rank -1 in edge [-1, 2]"));
  }
  SUBCASE("self loop") {
    CHECK(error_of(edge_list_spec({{0, 1}, {1, 2}, {2, 2}}), 3) ==
          "topology edge_list: edge [2, 2] is a self loop");
  }
  SUBCASE("duplicate edge") {
    CHECK(error_of(edge_list_spec({{0, 1}, {1, 2}, {1, 0}}), 3) ==
          "topology edge_list: edge [1, 0] repeats edge [0, 1]");
    CHECK(error_of(edge_list_spec({{0, 1}, {1, 2}, {1, 2}}), 3) ==
          "topology edge_list: edge [1, 2] repeats edge [1, 2]");
  }
  SUBCASE("not connected") {
    CHECK(error_of(edge_list_spec({{0, 1}, {1, 2}, {2, 3}, {0, 3}, {4, 5}}), 6) ==
          "topology edge_list: not connected: ranks 4, 5 cannot be reached from rank 0");
    CHECK(contains(error_of(edge_list_spec({{0, 1}}), 3), "rank 2 cannot be reached"));
    CHECK(contains(error_of(edge_list_spec({}), 2), "rank 1 cannot be reached"));
  }
  SUBCASE("edges on a kind that does not take them") {
    TopologySpec spec = spec_of(TopologyKind::exponential);
    spec.edges = {{0, 1}};
    const std::string what = error_of(spec, 4);
    CHECK(contains(what, "exponential"));
    CHECK(contains(what, "1 edge"));
    CHECK(contains(what, "expected none"));
  }
  SUBCASE("rank and dead ranks out of range") {
    const Topology ring(spec_of(TopologyKind::ring), 8);
    CHECK_THROWS_WITH_AS(ring.round(8, 0), "ring(8, uniform): rank 8 is outside [0, 8)", Error);
    CHECK_THROWS_AS(ring.round(-1, 0), Error);
    CHECK_THROWS_WITH_AS(ring.round(0, 0, {12}), "ring(8, uniform): dead rank 12 is outside [0, 8)",
                         Error);
  }
  SUBCASE("mixing is ignored by time-varying kinds") {
    CHECK(error_of(spec_of(TopologyKind::exponential, Mixing::metropolis), 8).empty());
    CHECK(error_of(spec_of(TopologyKind::random_matching, Mixing::metropolis), 8).empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Dead peers

TEST_CASE("dead peers are dropped and the remaining weights renormalised") {
  SUBCASE("ring: one dead neighbour leaves 1/2, 1/2; both dead leave the rank alone") {
    const Topology ring(spec_of(TopologyKind::ring), 8);
    RoundPeers peers = ring.round(0, 0, {7});
    CHECK(peers.send_to == std::vector<int>{1});
    CHECK(peers.recv_from == std::vector<int>{1});
    REQUIRE(peers.recv_weights.size() == 1);
    CHECK(peers.recv_weights[0] == doctest::Approx(0.5).epsilon(1e-15));
    CHECK(peers.self_weight == doctest::Approx(0.5).epsilon(1e-15));

    peers = ring.round(0, 0, {1, 5, 7});
    CHECK(peers.send_to.empty());
    CHECK(peers.recv_from.empty());
    CHECK(peers.recv_weights.empty());
    CHECK(peers.self_weight == 1.0);

    // Dead ranks that are not neighbours change nothing.
    peers = ring.round(0, 0, {3, 4});
    CHECK(peers.recv_from == std::vector<int>{1, 7});
    CHECK(peers.recv_weights == std::vector<double>{1.0 / 3, 1.0 / 3});
    CHECK(peers.self_weight == 1.0 / 3);
  }
  SUBCASE("metropolis keeps the proportions") {
    // Rank 3 has self 5/12 and gives 1/4 to rank 0, 1/3 to rank 4 (see the hand-worked matrix).
    const Topology graph(edge_list_spec({{0, 1}, {2, 0}, {0, 3}, {3, 4}}, Mixing::metropolis), 5);
    RoundPeers peers = graph.round(3, 0, {4});
    CHECK(peers.recv_from == std::vector<int>{0});
    REQUIRE(peers.recv_weights.size() == 1);
    CHECK(peers.self_weight == doctest::Approx(5.0 / 8).epsilon(1e-15));
    CHECK(peers.recv_weights[0] == doctest::Approx(3.0 / 8).epsilon(1e-15));

    // Rank 0 (self 1/4, 1/4 to each of 1, 2, 3) with 2 and 3 dead, given in any order.
    peers = graph.round(0, 0, {3, 2});
    CHECK(peers.send_to == std::vector<int>{1});
    CHECK(peers.recv_from == std::vector<int>{1});
    CHECK(peers.self_weight == doctest::Approx(0.5).epsilon(1e-15));
    CHECK(peers.recv_weights[0] == doctest::Approx(0.5).epsilon(1e-15));

    // Rank 0 with only 1 dead: 1/4 each over 3/4 -> 1/3 each.
    peers = graph.round(0, 0, {1});
    CHECK(peers.recv_from == std::vector<int>{2, 3});
    CHECK(peers.self_weight == doctest::Approx(1.0 / 3).epsilon(1e-15));
    for (double w : peers.recv_weights) CHECK(w == doctest::Approx(1.0 / 3).epsilon(1e-15));
  }
  SUBCASE("directed: a dead target is not sent to, a dead source not received from") {
    const Topology exponential(spec_of(TopologyKind::exponential), 8);
    RoundPeers peers = exponential.round(0, 0, {1});
    CHECK(peers.send_to.empty());
    CHECK(peers.recv_from == std::vector<int>{7});
    CHECK(peers.self_weight == 0.5);
    peers = exponential.round(0, 0, {7});
    CHECK(peers.send_to == std::vector<int>{1});
    CHECK(peers.recv_from.empty());
    CHECK(peers.self_weight == 1.0);
  }
}

// ---------------------------------------------------------------------------------------------
// Spectral gap

TEST_CASE("spectral gap of small matrices with known eigenvalues") {
  // Eigenvalues 1 and 0, 1 and 1/2, 1 and -1/2: the negative one counts by its absolute value.
  CHECK(spectral_gap({{0.5, 0.5}, {0.5, 0.5}}) == doctest::Approx(1.0).epsilon(1e-12));
  CHECK(spectral_gap({{0.75, 0.25}, {0.25, 0.75}}) == doctest::Approx(0.5).epsilon(1e-12));
  CHECK(spectral_gap({{0.25, 0.75}, {0.75, 0.25}}) == doctest::Approx(0.5).epsilon(1e-12));
  // A single rank: nothing but lambda_1.
  CHECK(spectral_gap({{1.0}}) == 1.0);
  // Two disconnected halves: lambda = 1 twice, so no gap.
  CHECK(std::abs(spectral_gap(
            {{0.5, 0.5, 0, 0}, {0.5, 0.5, 0, 0}, {0, 0, 0.5, 0.5}, {0, 0, 0.5, 0.5}})) < 1e-12);
}

TEST_CASE("spectral gap of the complete graph with W = J/n is 1") {
  for (int n : {2, 3, 5, 8, 17}) {
    CAPTURE(n);
    const double gap = spectral_gap(Topology(spec_of(TopologyKind::complete), n).mixing_matrix(0));
    CHECK(std::abs(gap - 1) < 1e-9);
  }
}

TEST_CASE("spectral gap of the uniform ring matches its circulant closed form") {
  for (int n : {3, 4, 5, 6, 8, 11, 16, 31}) {
    CAPTURE(n);
    const double gap = spectral_gap(Topology(spec_of(TopologyKind::ring), n).mixing_matrix(0));
    CHECK(std::abs(gap - ring_gap_closed_form(n)) < 1e-9);
  }
  // Torus 4x4 with metropolis weights 1/5: eigenvalues (1 + 2 cos(pi a/2) + 2 cos(pi b/2)) / 5,
  // the largest besides 1 being +-3/5.
  const double torus_gap =
      spectral_gap(Topology(torus_spec(4, 4, Mixing::metropolis), 16).mixing_matrix(0));
  CHECK(std::abs(torus_gap - 0.4) < 1e-9);
}

TEST_CASE("spectral gap refuses matrices that are not square or not symmetric") {
  CHECK_THROWS_AS(spectral_gap({}), Error);
  try {
    spectral_gap({{0.5, 0.5}, {0.5}});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(contains(e.what(), "row 1"));
    CHECK(contains(e.what(), "square"));
  }
  try {
    // Uniform weights on a path: rows sum to one but W is not symmetric.
    spectral_gap(Topology(edge_list_spec({{0, 1}, {1, 2}}), 3).mixing_matrix(0));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(contains(e.what(), "W[0][1] = 0.5"));
    CHECK(contains(e.what(), "0.3333333333"));
    CHECK(contains(e.what(), "symmetric"));
  }
  // Asymmetry below the tolerance is accepted.
  CHECK_NOTHROW(spectral_gap({{0.5, 0.5 + 1e-12}, {0.5, 0.5}}));
}

TEST_CASE("gossip averaging converges at the rate its spectral gap predicts") {
  struct Case {
    TopologySpec spec;
    int world_size;
  };
  for (const Case& c : {Case{spec_of(TopologyKind::ring, Mixing::metropolis), 8},
                        Case{torus_spec(4, 4, Mixing::metropolis), 16}}) {
    const Topology topology(c.spec, c.world_size);
    CAPTURE(topology.describe());
    const auto w = topology.mixing_matrix(0);
    const double lambda = 1 - spectral_gap(w);
    const size_t n = static_cast<size_t>(c.world_size);
    constexpr size_t kDim = 5;
    constexpr int kRounds = 60;

    // Fixed random vectors; std::mt19937's raw output is fixed by the standard.
    std::mt19937 generator(2024);
    std::vector<std::vector<double>> x(n, std::vector<double>(kDim));
    for (auto& row : x)
      for (double& v : row) v = static_cast<double>(generator() % 2001) / 1000.0 - 1.0;
    std::vector<double> mean(kDim, 0.0);
    for (const auto& row : x)
      for (size_t d = 0; d < kDim; ++d) mean[d] += row[d] / static_cast<double>(n);

    // ||X_t - mean||, in the Frobenius norm; the mean is that of X_0 (W preserves it).
    auto deviation = [&](const std::vector<std::vector<double>>& state) {
      double sum = 0;
      for (const auto& row : state)
        for (size_t d = 0; d < kDim; ++d) sum += (row[d] - mean[d]) * (row[d] - mean[d]);
      return std::sqrt(sum);
    };

    std::vector<double> norms = {deviation(x)};
    for (int t = 1; t <= kRounds; ++t) {
      std::vector<std::vector<double>> next(n, std::vector<double>(kDim, 0.0));
      for (size_t i = 0; i < n; ++i)
        for (size_t j = 0; j < n; ++j)
          for (size_t d = 0; d < kDim; ++d) next[i][d] += w[i][j] * x[j][d];
      x = std::move(next);
      norms.push_back(deviation(x));
    }

    // W is symmetric and the deviation orthogonal to the constant vector: no round can shrink
    // it by less than |lambda_2| (checked while rounding noise is far below the deviation).
    for (int t = 1; t <= kRounds; ++t) {
      if (norms[static_cast<size_t>(t)] < 1e-9 * norms[0]) break;
      CAPTURE(t);
      CHECK(norms[static_cast<size_t>(t)] / norms[static_cast<size_t>(t - 1)] <= lambda + 1e-9);
    }
    // Once the faster modes have died out, the deviation shrinks by |lambda_2| per round.
    const double rate = std::pow(norms[kRounds] / norms[10], 1.0 / (kRounds - 10));
    CHECK(rate <= lambda * (1 + 1e-6));
    CHECK(rate >= lambda * 0.97);
    CHECK(norms[kRounds] < 1e-3 * norms[0]);  // and it did converge
  }
}
