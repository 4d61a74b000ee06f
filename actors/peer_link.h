#pragma once
/// A peer link: the actor that owns one edge between this rank and a remote rank.
///
/// It holds whether the peer is alive (and, when not, why) and owns the peer's side of the
/// transport: told the peer is gone (fail_atom), it fails the transport's pending and later
/// operations with that rank, so nothing waits for a dead peer. Two kinds of owners spawn links:
/// - the worker, one link per remote rank of the job (liveness only, spawn_peer_link);
/// - a gossip module, one link per neighbour of its topology (spawn_gossip_link): the link then
///   also carries the module's rounds over its edge. A round is a message to the link; the link
///   posts the edge's send and receive on the transport (zero-copy: the bytes go from the owner's
///   send buffer to the link's own receive buffer, never through a CAF message), keeps the edge's
///   state across rounds (the neighbour's buffer, Choco-SGD's public copy of the neighbour, the
///   last round it carried) and answers with one edge_done message when both ended.
///   A link of EdgePayload::messages carries an ordered stream of messages each way instead
///   (AD-PSGD's requests, replies and byes): its sequence numbers, and its receive buffer.
///
/// Messages (actors/atoms.h):
///   (exchange_atom, EdgeRound)  -> later (edge_done_atom, EdgeResult), to the sender
///   (post_atom, StreamMessage)  -> later (posted_atom, StreamSent)     [message streams]
///   (listen_atom)               -> later (arrived_atom, StreamArrival) [message streams]
///   (fail_atom, reason)         -> no reply; the peer is dead, for good
///   (health_atom)               -> (link_state_atom, peer, failure); failure "" while alive
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/fwd.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/transport.h"

namespace troupe::actors {

/// What a gossip link does with the bytes its neighbour sends.
enum class EdgePayload {
  /// The neighbour's weights (D-PSGD): kept in the link's buffer as they came.
  weights,
  /// An 8-bit min-max difference (Choco-SGD, comm/codecs/minmax.h): added to the link's public
  /// copy of the neighbour's weights, x_hat_j += decode(q_j).
  minmax8_difference,
  /// A stream of messages of message_bytes each way (AD-PSGD): posted and received one by one,
  /// in order, under the tags comm::tags::tag_of(round_key(key_prefix, sequence number)).
  messages,
};

/// A gossip link's edge: fixed when it is spawned.
struct EdgeSettings {
  int peer = -1;
  /// Tags of the edge's rounds: tag_of(round_key(key_prefix, round)) (comm/tags.h), as the
  /// neighbour computes them for the same round.
  uint32_t key_prefix = 0;
  EdgePayload payload = EdgePayload::weights;
  /// minmax8_difference: the public copy's first value (every rank starts from the same weights)
  /// and the codec's block.
  std::vector<float> public_copy;
  size_t block = 0;
  /// messages: the size of every message of the stream.
  size_t message_bytes = 0;
};

/// The next message of a stream link: the link keeps it alive until its send has ended.
struct StreamMessage {
  std::shared_ptr<const std::vector<char>> bytes;
};

/// A stream message's send ended.
struct StreamSent {
  int peer = -1;
  bool ok = false;
  std::string error;
  size_t bytes = 0;
};

/// The stream's next message arrived (or could not). `data` (message_bytes long) points into the
/// link's buffer: valid until the owner's next listen_atom.
struct StreamArrival {
  int peer = -1;
  bool ok = false;
  std::string error;
  const char* data = nullptr;
};

/// One round over one edge. `send` (bytes long) must stay valid until the link has answered; the
/// link receives `bytes` into its own buffer. Rounds of one edge are carried in increasing order.
struct EdgeRound {
  uint64_t round = 0;
  bool send = false;
  bool receive = false;
  const void* data = nullptr;
  size_t bytes = 0;
};

/// How a round ended on one edge. `values` points into the link's state: the neighbour's weights
/// (EdgePayload::weights) or its updated public copy (minmax8_difference); valid until the owner
/// sends the link its next round. Null when nothing was received.
struct EdgeResult {
  int peer = -1;
  uint64_t round = 0;
  bool ok = false;
  std::string error;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
  const float* values = nullptr;
};

/// A link that only owns the peer's liveness (the worker's).
caf::actor spawn_peer_link(caf::actor_system& system, int peer,
                           std::shared_ptr<comm::Transport> transport);

/// A link that also carries a gossip module's rounds over the edge to settings.peer.
caf::actor spawn_gossip_link(caf::actor_system& system, EdgeSettings settings,
                             std::shared_ptr<comm::Transport> transport);

}  // namespace troupe::actors

// Both stay inside one process: they carry pointers, never tensors across processes.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::EdgeRound)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::EdgeResult)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::StreamMessage)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::StreamSent)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::StreamArrival)
