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
/// tensors.
#include <caf/fwd.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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

/// On start_atom the averager starts (or resumes) a round every interval. On stop_atom it runs one
/// more round at once, flagged: every rank that sees the flag ends its rounds after that round,
/// so all ranks stop after the same round (ranks then stop_atom'd or start_atom'd again resume in
/// step). A failed round ends the rounds; stop_atom then answers (stopped_atom, false, error), and
/// BackgroundStats::error says why. (abort_atom, reason, rank) — a rank died — fails the round in
/// flight (within failure_grace) or, between rounds, ends the rounds at once, naming the reason.
caf::actor spawn_averager(caf::actor_system& system, ModelAccess model, AveragerSettings settings,
                          std::shared_ptr<comm::Transport> transport,
                          std::shared_ptr<BackgroundStats> stats);

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

/// On start_atom the gossiper starts exchanging. On stop_atom it stops initiating, finishes its
/// exchange in flight, tells every live neighbour "bye", and answers once every live neighbour has
/// said bye too (it serves their requests until then). drop_atom (rank, reason) drops a neighbour.
/// Each neighbour's two message streams are carried by a peer link (actors/peer_link.h,
/// EdgePayload::messages) that the gossiper spawns and links to itself.
caf::actor spawn_gossiper(caf::actor_system& system, ModelAccess model, GossiperSettings settings,
                          std::shared_ptr<comm::Transport> transport,
                          std::shared_ptr<BackgroundStats> stats);

}  // namespace troupe::actors
