#include "comm/gossip/topology.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <map>
#include <queue>
#include <utility>

#include "comm/status.h"

namespace troupe::comm {

namespace {

const TopologyKind kKinds[] = {
    TopologyKind::ring,        TopologyKind::torus,           TopologyKind::complete,
    TopologyKind::exponential, TopologyKind::random_matching, TopologyKind::edge_list};
const Mixing kMixings[] = {Mixing::uniform, Mixing::metropolis};

// Tolerances of doubly_stochastic() and spectral_gap(), as the header states them.
constexpr double kStochasticTolerance = 1e-12;
constexpr double kSymmetryTolerance = 1e-9;
// random_matching has no period; doubly_stochastic() checks this many of its rounds.
constexpr uint64_t kMatchingRoundsChecked = 16;

std::string edge_text(const std::pair<int, int>& edge) {
  return "[" + std::to_string(edge.first) + ", " + std::to_string(edge.second) + "]";
}

std::string plural(size_t count, const char* noun) {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : "s");
}

/// Exponential graph: the number of distinct shifts 2^0 .. 2^(L-1), L = ceil(log2 n); 0 for n = 1.
int exponential_period(int world_size) {
  int period = 0;
  while ((int64_t{1} << period) < world_size) ++period;
  return period;
}

/// SplitMix64 (Steele, Lea and Flood): a tiny generator whose output is fixed by its definition,
/// so every rank and every standard library draws the same matchings.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}

  uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  /// Uniform in [0, bound), bound >= 1, without modulo bias: draws below 2^64 mod bound, the
  /// incomplete last block of residues, are rejected.
  uint64_t below(uint64_t bound) {
    const uint64_t rejected = (0 - bound) % bound;
    uint64_t x = next();
    while (x < rejected) x = next();
    return x % bound;
  }

 private:
  uint64_t state_;
};

/// Round `round`'s matching: partner[i] is the rank i averages with, or -1 when i sits out. A
/// uniformly random permutation (Fisher-Yates) is cut into consecutive pairs.
std::vector<int> random_matching(int world_size, uint64_t seed, uint64_t round) {
  // Seed and round go through the generator's mixing one after the other, so that neighbouring
  // seeds or rounds give unrelated streams.
  SplitMix64 generator(SplitMix64(SplitMix64(seed).next() ^ round).next());
  std::vector<int> order(static_cast<size_t>(world_size));
  for (int i = 0; i < world_size; ++i) order[static_cast<size_t>(i)] = i;
  for (size_t i = order.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(generator.below(i));
    std::swap(order[i - 1], order[j]);
  }
  std::vector<int> partner(static_cast<size_t>(world_size), -1);
  for (size_t i = 0; i + 1 < order.size(); i += 2) {
    partner[static_cast<size_t>(order[i])] = order[i + 1];
    partner[static_cast<size_t>(order[i + 1])] = order[i];
  }
  return partner;
}

/// Sorts, removes duplicates and `self`.
std::vector<int> neighbour_set(std::vector<int> ranks, int self) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  ranks.erase(std::remove(ranks.begin(), ranks.end(), self), ranks.end());
  return ranks;
}

int wrap(int64_t value, int modulus) {
  const int64_t r = value % modulus;
  return static_cast<int>(r < 0 ? r + modulus : r);
}

std::vector<std::vector<int>> ring_neighbours(int n) {
  std::vector<std::vector<int>> neighbours(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    neighbours[static_cast<size_t>(i)] = neighbour_set({wrap(i - 1, n), wrap(i + 1, n)}, i);
  return neighbours;
}

std::vector<std::vector<int>> torus_neighbours(int rows, int cols) {
  std::vector<std::vector<int>> neighbours(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const int self = r * cols + c;
      // With a side of 1 the wrap-around neighbour is the rank itself, with a side of 2 both
      // neighbours on that side are the same rank: neighbour_set drops both cases.
      neighbours[static_cast<size_t>(self)] =
          neighbour_set({wrap(r - 1, rows) * cols + c, wrap(r + 1, rows) * cols + c,
                         r * cols + wrap(c - 1, cols), r * cols + wrap(c + 1, cols)},
                        self);
    }
  }
  return neighbours;
}

std::vector<std::vector<int>> complete_neighbours(int n) {
  std::vector<std::vector<int>> neighbours(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      if (j != i) neighbours[static_cast<size_t>(i)].push_back(j);
  return neighbours;
}

/// Checks the edges (range, self loops, duplicates, connectivity) and returns the adjacency.
std::vector<std::vector<int>> edge_list_neighbours(const std::vector<std::pair<int, int>>& edges,
                                                   int n) {
  const std::string where = "topology edge_list: ";
  const std::string range = "[0, " + std::to_string(n) + ")";
  std::vector<std::vector<int>> neighbours(static_cast<size_t>(n));
  // Each edge seen so far, keyed by (smaller rank, larger rank), as the user wrote it: a repeat
  // names the edge it repeats.
  std::map<std::pair<int, int>, std::pair<int, int>> seen;
  for (const auto& edge : edges) {
    for (int end : {edge.first, edge.second})
      if (end < 0 || end >= n)
        throw Error(where + "rank " + std::to_string(end) + " in edge " + edge_text(edge) +
                    " is outside " + range);
    if (edge.first == edge.second)
      throw Error(where + "edge " + edge_text(edge) + " is a self loop");
    const std::pair<int, int> key{std::min(edge.first, edge.second),
                                  std::max(edge.first, edge.second)};
    const auto [earlier, first_time] = seen.emplace(key, edge);
    if (!first_time)
      throw Error(where + "edge " + edge_text(edge) + " repeats edge " +
                  edge_text(earlier->second));
    neighbours[static_cast<size_t>(edge.first)].push_back(edge.second);
    neighbours[static_cast<size_t>(edge.second)].push_back(edge.first);
  }
  for (auto& list : neighbours) std::sort(list.begin(), list.end());

  // Breadth-first search from rank 0; every rank must be reached.
  std::vector<bool> reached(static_cast<size_t>(n), false);
  std::queue<int> frontier;
  reached[0] = true;
  frontier.push(0);
  while (!frontier.empty()) {
    const int rank = frontier.front();
    frontier.pop();
    for (int next : neighbours[static_cast<size_t>(rank)]) {
      if (!reached[static_cast<size_t>(next)]) {
        reached[static_cast<size_t>(next)] = true;
        frontier.push(next);
      }
    }
  }
  std::vector<int> unreached;
  for (int i = 0; i < n; ++i)
    if (!reached[static_cast<size_t>(i)]) unreached.push_back(i);
  if (!unreached.empty()) {
    constexpr size_t kNamed = 16;  // keep the message readable on large worlds
    std::string list;
    for (size_t i = 0; i < std::min(unreached.size(), kNamed); ++i)
      list += (i ? ", " : "") + std::to_string(unreached[i]);
    if (unreached.size() > kNamed)
      list += ", ... (" + std::to_string(unreached.size()) + " in all)";
    throw Error(where + "not connected: " + (unreached.size() == 1 ? "rank " : "ranks ") + list +
                " cannot be reached from rank 0");
  }
  return neighbours;
}

}  // namespace

const char* topology_kind_name(TopologyKind kind) {
  switch (kind) {
    case TopologyKind::ring:
      return "ring";
    case TopologyKind::torus:
      return "torus";
    case TopologyKind::complete:
      return "complete";
    case TopologyKind::exponential:
      return "exponential";
    case TopologyKind::random_matching:
      return "random_matching";
    case TopologyKind::edge_list:
      return "edge_list";
  }
  return "unknown";
}

TopologyKind parse_topology_kind(const std::string& text) {
  std::string allowed;
  for (TopologyKind kind : kKinds) {
    if (text == topology_kind_name(kind)) return kind;
    allowed += std::string(allowed.empty() ? "" : ", ") + topology_kind_name(kind);
  }
  throw Error("topology kind '" + text + "' is not one of " + allowed);
}

const char* mixing_name(Mixing mixing) {
  switch (mixing) {
    case Mixing::uniform:
      return "uniform";
    case Mixing::metropolis:
      return "metropolis";
  }
  return "unknown";
}

Mixing parse_mixing(const std::string& text) {
  std::string allowed;
  for (Mixing mixing : kMixings) {
    if (text == mixing_name(mixing)) return mixing;
    allowed += std::string(allowed.empty() ? "" : ", ") + mixing_name(mixing);
  }
  throw Error("mixing '" + text + "' is not one of " + allowed);
}

Topology::Topology(TopologySpec spec, int world_size)
    : spec_(std::move(spec)), world_size_(world_size) {
  const std::string where = std::string("topology ") + topology_kind_name(spec_.kind) + ": ";
  if (world_size_ < 1)
    throw Error(where + "world size " + std::to_string(world_size_) + ", expected at least 1");
  if (spec_.kind != TopologyKind::edge_list && !spec_.edges.empty())
    throw Error(where + plural(spec_.edges.size(), "edge") +
                " given, expected none (only edge_list takes edges)");

  switch (spec_.kind) {
    case TopologyKind::ring:
      neighbours_ = ring_neighbours(world_size_);
      break;
    case TopologyKind::torus: {
      if (spec_.rows < 1 || spec_.cols < 1)
        throw Error(where + "rows " + std::to_string(spec_.rows) + " and cols " +
                    std::to_string(spec_.cols) + ", expected both at least 1");
      const int64_t product = int64_t{spec_.rows} * spec_.cols;
      if (product != world_size_)
        throw Error(where + "rows * cols = " + std::to_string(spec_.rows) + " * " +
                    std::to_string(spec_.cols) + " = " + std::to_string(product) +
                    ", expected the world size " + std::to_string(world_size_));
      neighbours_ = torus_neighbours(spec_.rows, spec_.cols);
      break;
    }
    case TopologyKind::complete:
      neighbours_ = complete_neighbours(world_size_);
      break;
    case TopologyKind::edge_list:
      neighbours_ = edge_list_neighbours(spec_.edges, world_size_);
      break;
    case TopologyKind::exponential:
    case TopologyKind::random_matching:
      break;  // peers are computed per round
  }
}

bool Topology::time_varying() const {
  return spec_.kind == TopologyKind::exponential || spec_.kind == TopologyKind::random_matching;
}

bool Topology::undirected() const { return spec_.kind != TopologyKind::exponential; }

RoundPeers Topology::round(int rank, uint64_t round) const {
  if (rank < 0 || rank >= world_size_)
    throw Error(describe() + ": rank " + std::to_string(rank) + " is outside [0, " +
                std::to_string(world_size_) + ")");
  RoundPeers peers;
  switch (spec_.kind) {
    case TopologyKind::exponential: {
      const int period = exponential_period(world_size_);
      if (period == 0) return peers;
      const int64_t shift = int64_t{1} << (round % static_cast<uint64_t>(period));
      const int to = wrap(rank + shift, world_size_);
      const int from = wrap(rank - shift, world_size_);
      if (to == rank) return peers;  // 2^k < n makes this impossible; kept as a guard
      peers.send_to = {to};
      peers.recv_from = {from};
      peers.recv_weights = {0.5};
      peers.self_weight = 0.5;
      return peers;
    }
    case TopologyKind::random_matching: {
      const int partner =
          random_matching(world_size_, spec_.seed, round)[static_cast<size_t>(rank)];
      if (partner < 0) return peers;
      peers.send_to = {partner};
      peers.recv_from = {partner};
      peers.recv_weights = {0.5};
      peers.self_weight = 0.5;
      return peers;
    }
    case TopologyKind::ring:
    case TopologyKind::torus:
    case TopologyKind::complete:
    case TopologyKind::edge_list:
      break;
  }

  const std::vector<int>& neighbours = neighbours_[static_cast<size_t>(rank)];
  const size_t degree = neighbours.size();
  peers.send_to = neighbours;
  peers.recv_from = neighbours;
  if (spec_.mixing == Mixing::uniform) {
    const double weight = 1.0 / static_cast<double>(degree + 1);
    peers.recv_weights.assign(degree, weight);
    peers.self_weight = weight;
    return peers;
  }
  double others = 0;
  for (int j : neighbours) {
    const size_t larger = std::max(degree, neighbours_[static_cast<size_t>(j)].size());
    const double weight = 1.0 / static_cast<double>(larger + 1);
    peers.recv_weights.push_back(weight);
    others += weight;
  }
  peers.self_weight = 1.0 - others;
  return peers;
}

RoundPeers Topology::round(int rank, uint64_t round, const std::vector<int>& dead) const {
  RoundPeers all = this->round(rank, round);
  for (int d : dead)
    if (d < 0 || d >= world_size_)
      throw Error(describe() + ": dead rank " + std::to_string(d) + " is outside [0, " +
                  std::to_string(world_size_) + ")");
  const auto is_dead = [&](int r) { return std::find(dead.begin(), dead.end(), r) != dead.end(); };

  RoundPeers alive;
  for (int r : all.send_to)
    if (!is_dead(r)) alive.send_to.push_back(r);
  double total = all.self_weight;
  for (size_t k = 0; k < all.recv_from.size(); ++k) {
    if (is_dead(all.recv_from[k])) continue;
    alive.recv_from.push_back(all.recv_from[k]);
    alive.recv_weights.push_back(all.recv_weights[k]);
    total += all.recv_weights[k];
  }
  if (alive.recv_from.size() == all.recv_from.size()) {
    all.send_to = std::move(alive.send_to);
    return all;  // nobody we receive from died: the weights stay exactly as they were
  }
  if (alive.recv_from.empty() || total <= 0) {
    alive.recv_weights.clear();
    alive.self_weight = 1;
    return alive;
  }
  alive.self_weight = all.self_weight / total;
  for (double& weight : alive.recv_weights) weight /= total;
  return alive;
}

std::vector<std::vector<double>> Topology::mixing_matrix(uint64_t round) const {
  const size_t n = static_cast<size_t>(world_size_);
  std::vector<std::vector<double>> w(n, std::vector<double>(n, 0.0));
  for (int i = 0; i < world_size_; ++i) {
    const RoundPeers peers = this->round(i, round);
    auto& row = w[static_cast<size_t>(i)];
    row[static_cast<size_t>(i)] += peers.self_weight;
    for (size_t k = 0; k < peers.recv_from.size(); ++k)
      row[static_cast<size_t>(peers.recv_from[k])] += peers.recv_weights[k];
  }
  return w;
}

bool Topology::doubly_stochastic() const {
  uint64_t rounds = 1;
  if (spec_.kind == TopologyKind::exponential)
    rounds = static_cast<uint64_t>(std::max(1, exponential_period(world_size_)));
  if (spec_.kind == TopologyKind::random_matching) rounds = kMatchingRoundsChecked;

  const size_t n = static_cast<size_t>(world_size_);
  for (uint64_t t = 0; t < rounds; ++t) {
    const auto w = mixing_matrix(t);
    for (size_t i = 0; i < n; ++i) {
      double row = 0, col = 0;
      for (size_t j = 0; j < n; ++j) {
        row += w[i][j];
        col += w[j][i];
      }
      if (std::abs(row - 1) > kStochasticTolerance || std::abs(col - 1) > kStochasticTolerance)
        return false;
    }
  }
  return true;
}

std::string Topology::describe() const {
  const std::string n = std::to_string(world_size_);
  const std::string mixing = mixing_name(spec_.mixing);
  switch (spec_.kind) {
    case TopologyKind::ring:
      return "ring(" + n + ", " + mixing + ")";
    case TopologyKind::torus:
      return "torus(" + std::to_string(spec_.rows) + "x" + std::to_string(spec_.cols) + ", " +
             mixing + ")";
    case TopologyKind::complete:
      return "complete(" + n + ", " + mixing + ")";
    case TopologyKind::exponential:
      return "exponential(" + n + ")";
    case TopologyKind::random_matching:
      return "random_matching(" + n + ", seed " + std::to_string(spec_.seed) + ")";
    case TopologyKind::edge_list:
      return "edge_list(" + plural(static_cast<size_t>(world_size_), "rank") + ", " +
             plural(spec_.edges.size(), "edge") + ", " + mixing + ")";
  }
  return "unknown topology";
}

namespace {

/// The eigenvalues of the symmetric matrix `a`, by cyclic Jacobi rotations: each rotation in the
/// (p, q) plane zeroes a[p][q]; sweeps over all pairs drive the off-diagonal part to zero
/// (quadratically once it is small), leaving the eigenvalues on the diagonal.
std::vector<double> symmetric_eigenvalues(std::vector<std::vector<double>> a) {
  const size_t n = a.size();
  constexpr int kMaxSweeps = 100;
  for (int sweep = 0; sweep < kMaxSweeps; ++sweep) {
    double off = 0, total = 0;
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        total += a[i][j] * a[i][j];
        if (i != j) off += a[i][j] * a[i][j];
      }
    }
    if (off <= 1e-32 * total) break;

    for (size_t p = 0; p + 1 < n; ++p) {
      for (size_t q = p + 1; q < n; ++q) {
        const double apq = a[p][q];
        if (apq == 0) continue;
        // The rotation angle phi solves cot(2 phi) = theta; t = tan(phi) is the smaller root of
        // t^2 + 2 theta t - 1 = 0, which keeps the rotation below 45 degrees (stable).
        const double theta = (a[q][q] - a[p][p]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::hypot(theta, 1.0));
        const double c = 1 / std::sqrt(t * t + 1);
        const double s = t * c;
        for (size_t r = 0; r < n; ++r) {
          if (r == p || r == q) continue;
          const double arp = a[r][p];
          const double arq = a[r][q];
          a[r][p] = a[p][r] = c * arp - s * arq;
          a[r][q] = a[q][r] = s * arp + c * arq;
        }
        a[p][p] -= t * apq;
        a[q][q] += t * apq;
        a[p][q] = a[q][p] = 0;
      }
    }
  }
  std::vector<double> eigenvalues(n);
  for (size_t i = 0; i < n; ++i) eigenvalues[i] = a[i][i];
  return eigenvalues;
}

}  // namespace

double spectral_gap(const std::vector<std::vector<double>>& w) {
  const size_t n = w.size();
  if (n == 0) throw Error("spectral_gap: W has 0 rows, expected a non-empty square matrix");
  for (size_t i = 0; i < n; ++i)
    if (w[i].size() != n)
      throw Error("spectral_gap: row " + std::to_string(i) + " of W has " +
                  std::to_string(w[i].size()) + " entries, expected " + std::to_string(n) +
                  " (a square matrix)");
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j)
      if (std::abs(w[i][j] - w[j][i]) > kSymmetryTolerance)
        throw Error("spectral_gap: W[" + std::to_string(i) + "][" + std::to_string(j) +
                    "] = " + number_text(w[i][j]) + " but W[" + std::to_string(j) + "][" +
                    std::to_string(i) + "] = " + number_text(w[j][i]) +
                    ", expected a symmetric matrix (within 1e-9)");

  // Averaged with its transpose, W is exactly symmetric, as the rotations assume.
  std::vector<std::vector<double>> symmetric = w;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) symmetric[i][j] = symmetric[j][i] = (w[i][j] + w[j][i]) / 2;
  const std::vector<double> eigenvalues = symmetric_eigenvalues(std::move(symmetric));
  // lambda_1 = 1 belongs to the constant vector; the rest govern how fast gossip converges.
  size_t top = 0;
  for (size_t i = 1; i < n; ++i)
    if (std::abs(eigenvalues[i] - 1) < std::abs(eigenvalues[top] - 1)) top = i;
  double second = 0;
  for (size_t i = 0; i < n; ++i)
    if (i != top) second = std::max(second, std::abs(eigenvalues[i]));
  return 1 - second;
}

}  // namespace troupe::comm
