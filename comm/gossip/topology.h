#pragma once
/// Topology: who talks to whom in a decentralized (gossip) algorithm, and with which weights.
///
/// A topology is a graph on the ranks 0..world_size-1 plus a mixing matrix W: after a gossip round
/// rank i holds sum_j W[i][j] x_j, where j runs over i itself and the ranks it received from in
/// that round. Kinds:
/// - ring: i talks to i-1 and i+1 (mod n); with n = 2 the one neighbour is counted once.
/// - torus: a rows x cols grid with wrap-around (4 neighbours, fewer when a side is 1 or 2).
/// - complete: everyone talks to everyone.
/// - exponential: directed and time-varying, as in Stochastic Gradient Push: in round t rank i
///   sends to i + 2^k and receives from i - 2^k (mod n), k = t mod ceil(log2 n); weights 1/2, 1/2.
/// - random_matching: a perfect matching drawn per round from a seed shared by all ranks (like
///   Bagua's shift_one, one peer per rank per step, but drawn at random); each pair averages
///   1/2, 1/2; with odd n one rank sits out. The matching is a uniformly random permutation
///   (Fisher-Yates over SplitMix64, seeded from the seed and the round) cut into pairs: the same on
///   every rank and with every standard library.
/// - edge_list: an explicit undirected graph.
/// Mixing weights of the static kinds: uniform, W[i][j] = 1/(deg(i)+1) for j a neighbour or i
/// itself (doubly stochastic on regular graphs only), or Metropolis-Hastings,
/// W[i][j] = 1/(1 + max(deg(i), deg(j))), W[i][i] = 1 - sum of the others (always doubly
/// stochastic on an undirected graph). exponential and random_matching ignore `mixing`.
///
/// Validation (comm::Error naming the thing, the value and what was expected): world size >= 1,
/// torus rows and cols >= 1 with rows * cols == world size, edges given for edge_list only,
/// edge-list ranks in [0, n), no self loops, no duplicate edges ((a, b) and (b, a) are the same
/// edge), the graph connected.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace troupe::comm {

enum class TopologyKind { ring, torus, complete, exponential, random_matching, edge_list };
enum class Mixing { uniform, metropolis };

/// What a user asks for; Topology checks it against a world size.
struct TopologySpec {
  TopologyKind kind = TopologyKind::ring;
  int rows = 0;  // torus: rows * cols must equal the world size
  int cols = 0;
  std::vector<std::pair<int, int>> edges;  // edge_list: undirected edges
  Mixing mixing = Mixing::uniform;
  uint64_t seed = 0;  // random_matching: the shared seed
};

/// "ring", "torus", "complete", "exponential", "random_matching", "edge_list".
const char* topology_kind_name(TopologyKind kind);
/// The inverse of topology_kind_name; throws comm::Error naming the text and the allowed names.
TopologyKind parse_topology_kind(const std::string& text);
const char* mixing_name(Mixing mixing);  // "uniform", "metropolis"
Mixing parse_mixing(const std::string& text);

/// One rank's part of one gossip round.
struct RoundPeers {
  /// Ranks this rank sends its vector to (sorted, unique, never itself).
  std::vector<int> send_to;
  /// Ranks it receives from (sorted, unique, never itself), and the weight of each received vector.
  std::vector<int> recv_from;
  std::vector<double> recv_weights;
  /// The weight of its own vector. self_weight + sum(recv_weights) == 1.
  double self_weight = 1;
};

class Topology {
 public:
  /// Validates `spec` for `world_size` ranks; throws comm::Error on the first problem.
  Topology(TopologySpec spec, int world_size);

  int world_size() const { return world_size_; }
  const TopologySpec& spec() const { return spec_; }
  /// True for exponential and random_matching (the peers change from round to round).
  bool time_varying() const;
  /// True when every round's graph is undirected (send_to == recv_from on every rank): all kinds
  /// but exponential.
  bool undirected() const;

  /// Rank `rank`'s peers and weights in round `round`; throws comm::Error when `rank` is outside
  /// [0, world size).
  RoundPeers round(int rank, uint64_t round) const;
  /// The same with the ranks in `dead` (any order) removed: the remaining weights (its own
  /// included) are renormalised to sum to 1 in the same proportions. A rank whose peers are all
  /// dead keeps its own vector (self_weight 1). A dead rank outside [0, world size) throws.
  RoundPeers round(int rank, uint64_t round, const std::vector<int>& dead) const;
  /// W of round `round` as a dense world_size x world_size matrix, W[i][j] = weight rank i gives
  /// to rank j's vector.
  std::vector<std::vector<double>> mixing_matrix(uint64_t round) const;
  /// True when rows and columns of every round's W sum to 1 (within 1e-12), checked numerically.
  /// For time-varying kinds the rounds of one period are checked (exponential) or the first 16
  /// (random_matching, which has no period).
  bool doubly_stochastic() const;
  /// Human-readable: "ring(8, uniform)", "torus(2x4, metropolis)", ...
  std::string describe() const;

 private:
  TopologySpec spec_;
  int world_size_;
  std::vector<std::vector<int>> neighbours_;  // static kinds: undirected adjacency, sorted
};

/// 1 - |lambda_2| of a symmetric doubly stochastic W (the second largest eigenvalue in absolute
/// value), computed with a dense symmetric eigen-solver (Jacobi rotations). Gossip averaging with W
/// shrinks the distance to the mean by about |lambda_2| per round. Throws comm::Error when W is not
/// square or not symmetric (within 1e-9).
double spectral_gap(const std::vector<std::vector<double>>& w);

}  // namespace troupe::comm
