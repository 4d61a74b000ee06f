#pragma once
/// Background model averaging: the actors of the asynchronous algorithms (algorithms/gossip/),
/// which talk to other ranks on their own schedule while training goes on.
///
/// - averager (Bagua's asynchronous model average): every `interval` it takes a snapshot s of the
///   model, averages the snapshots of all ranks by an allreduce that it drives itself (transport
///   completions come back to it as messages), and applies x += avg - s, so local progress made
///   while the allreduce ran is kept. The trainer never waits for it.
/// - gossiper (AD-PSGD): repeatedly picks a random live neighbour and averages with it pairwise:
///   it sends its snapshot s_i in a request; the neighbour answers with its own snapshot s_j and
///   applies x_j += (s_i - s_j) / 2; the initiator applies x_i += (s_j - s_i) / 2. No global step;
///   the sum of the models is kept exactly. A neighbour that dies is dropped (and logged), and
///   gossip goes on with the others.
/// Both stop together with the other ranks on stop_atom (see each spawn function), answered with
/// (stopped_atom, ok, error). Buffers are raw float32 memory here: actors/ knows nothing of
/// tensors. The code above holds a Background, a handle on either, whose calls are the messages
/// of background_actor, the part of their typed interfaces that is theirs to receive.
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "comm/collectives/collectives.h"
#include "comm/transport/transport.h"

namespace troupe::actors {

/// How a background actor reads and changes the model: `count` float32 elements, each function
/// called on the actor's thread and guarded by the owner's model lock. Changes are handed over as
/// differences from a snapshot, so that what the trainer did since the snapshot is kept; when
/// they land in the weights is the owner's business (algorithms/gossip: at the trainer's next step,
/// never between a forward and its backward), and a snapshot already includes those handed over.
struct ModelAccess {
  size_t count = 0;
  /// Copies the model into dst. Returns its generation, passed back to apply: the owner starts a
  /// new one when the weights are replaced wholesale (a checkpoint loaded).
  std::function<uint64_t(float* dst)> snapshot;
  /// x += weight * (target - snapshot), element-wise, where `snapshot` was taken in `generation`
  /// (a change computed from a snapshot of an older generation is dropped).
  std::function<void(const float* target, const float* snapshot, float weight, uint64_t generation)>
      apply;
};

/// What a background actor has done; read from any thread.
struct BackgroundStats {
  std::atomic<uint64_t> rounds{0};  // averages (averager) or pairwise exchanges (gossiper) done
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::mutex mutex;
  std::vector<int> dropped;  // gossiper: neighbours dropped, in order
  std::string error;         // averager: why rounds stopped early (a dead rank, named)
};

struct AveragerSettings {
  std::chrono::milliseconds interval{100};
  /// Keys of its allreduces: comm::tags::round_key(key_prefix, round) (comm/tags.h).
  uint32_t key_prefix = 0;
  comm::CollectiveOptions collectives;
  /// After abort_atom, how long the round's operations with live ranks may still end by themselves
  /// before they are failed (they may wait on a rank that stopped because of the dead one).
  std::chrono::milliseconds failure_grace{200};
};

struct GossiperSettings {
  /// The neighbours (undirected: each of them gossips with this rank too).
  std::vector<int> neighbours;
  /// At least this long between the starts of two exchanges this rank initiates.
  std::chrono::milliseconds min_interval{10};
  /// Tags of the message stream from this rank to each neighbour: tag_of(round_key(key_prefix,
  /// seq)) (comm/tags.h).
  uint32_t key_prefix = 0;
  /// Seeds the choice of neighbours (mixed with the rank).
  uint64_t seed = 0;
};

/// What a background actor takes from its owner: start (or resume) the rounds; a rank is gone
/// (abort_atom, reason, rank); stop, answered once the rounds have ended with the other ranks.
using background_actor =
    caf::typed_actor<caf::reacts_to<start_atom>, caf::reacts_to<abort_atom, std::string, int>,
                     caf::replies_to<stop_atom>::with<stopped_atom, bool, std::string>>;

/// How a stop ended: answered (else `error` says why not, within the deadline), and then whether
/// the rounds had ended well (else `error` says why they ended early).
struct BackgroundStop {
  bool answered = false;
  bool ok = false;
  std::string error;
};

class Background {
 public:
  Background() = default;

  /// The averager. On start it starts (or resumes) a round every interval. On stop it runs one
  /// more round at once, flagged: every rank that sees the flag ends its rounds after that round,
  /// so all ranks stop after the same round (ranks then stopped or started again resume in
  /// step). A failed round ends the rounds; stop then answers not ok, and BackgroundStats::error
  /// says why. lost(rank, reason) — a rank died — fails the round in flight (within
  /// failure_grace) or, between rounds, ends the rounds at once, naming the reason.
  static Background averager(caf::actor_system& system, ModelAccess model,
                             AveragerSettings settings, std::shared_ptr<comm::Transport> transport,
                             std::shared_ptr<BackgroundStats> stats);
  /// The gossiper. On start it starts exchanging. On stop it stops initiating, finishes its
  /// exchange in flight, tells every live neighbour "bye", and answers once every live neighbour
  /// has said bye too (it serves their requests until then). lost(rank, reason) drops that
  /// neighbour. Each neighbour's two message streams are carried by a peer link
  /// (actors/peer_link.h, EdgePayload::messages) that the gossiper spawns and links to itself.
  static Background gossiper(caf::actor_system& system, ModelAccess model,
                             GossiperSettings settings, std::shared_ptr<comm::Transport> transport,
                             std::shared_ptr<BackgroundStats> stats);

  void start() const;
  /// Rank `rank` is gone (-1: the world is ending), for `reason`.
  void lost(int rank, const std::string& reason) const;
  /// Ends the rounds with the other ranks; waits for the answer at most `timeout`.
  BackgroundStop stop(std::chrono::milliseconds timeout) const;
  /// Ends the actor and waits at most `timeout` until it is gone; false if it is not.
  bool exit_and_wait(std::chrono::milliseconds timeout) const;
  /// Ends the actor.
  void exit() const;

  explicit operator bool() const { return static_cast<bool>(actor_); }
  const background_actor& actor() const { return actor_; }

 private:
  explicit Background(background_actor actor) : actor_(std::move(actor)) {}
  background_actor actor_;
};

}  // namespace troupe::actors
