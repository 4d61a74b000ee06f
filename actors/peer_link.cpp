#include "actors/peer_link.h"

#include <caf/all.hpp>

#include "actors/atoms.h"
#include "actors/handoff.h"
#include "comm/codecs/minmax.h"
#include "comm/tags.h"

namespace troupe::actors {

namespace {

/// (op_done_atom, round, is_send, ok, error): one of the round's transport operations ended.
using op_done_atom = caf::atom_constant<caf::atom("op_done")>;
/// (stream_op_atom, is_send, ok, error, bytes): a stream's send or receive ended.
using stream_op_atom = caf::atom_constant<caf::atom("stream_op")>;

struct PeerLinkState {
  int peer = -1;
  std::shared_ptr<comm::Transport> transport;
  std::string failure;  // why the peer is unreachable; empty while it is alive

  bool gossip = false;  // spawned by spawn_gossip_link: carries rounds
  EdgeSettings edge;
  // The neighbour's last message; shared with the pending receive's callback, so that the buffer
  // outlives the actor while the transport may still write into it.
  std::shared_ptr<std::vector<char>> inbox = std::make_shared<std::vector<char>>();
  bool carried_any = false;
  uint64_t last_round = 0;  // the edge's sequence number: the last round it carried

  // The round in flight.
  bool in_flight = false;
  EdgeRound current;
  int pending = 0;
  caf::actor owner;
  EdgeResult result;

  // A message stream: the next message's sequence number each way, and who posts and listens.
  uint32_t out_seq = 0;
  uint32_t in_seq = 0;
  bool listening = false;
  caf::actor stream_owner;

  static inline const char* name = "troupe.peer_link";
};

using PeerLink = caf::stateful_actor<PeerLinkState>;

void answer(PeerLink* self, EdgeResult result) {
  auto& st = self->state;
  if (st.owner) {
    handoff_release();  // the round's buffers go back to the trainer (actors/handoff.h)
    self->send(st.owner, edge_done_atom::value, std::move(result));
  }
  st.owner = nullptr;
}

std::string edge_name(const PeerLinkState& st, uint64_t round) {
  return "gossip round " + std::to_string(round) + " with rank " + std::to_string(st.peer);
}

void end_round(PeerLink* self) {
  auto& st = self->state;
  st.in_flight = false;
  EdgeResult result = std::move(st.result);
  result.ok = result.error.empty();
  if (!result.ok) {
    // A failed operation means the peer is gone (the transport fails only those) or speaks
    // another protocol: either way the edge is dead for the rounds to come.
    if (st.failure.empty()) st.failure = result.error;
  } else if (st.current.receive) {
    if (st.edge.payload == EdgePayload::weights) {
      result.values = reinterpret_cast<const float*>(st.inbox->data());
    } else {
      comm::minmax_decode_add(
          comm::MinMaxBits::eight, reinterpret_cast<const uint8_t*>(st.inbox->data()),
          st.edge.public_copy.size(), st.edge.block, st.edge.public_copy.data());
      result.values = st.edge.public_copy.data();
    }
  }
  answer(self, std::move(result));
}

// Checks a round before it is posted; returns why it cannot be, or "".
std::string refusal(const PeerLinkState& st, const EdgeRound& r) {
  const std::string what = edge_name(st, r.round);
  if (!st.gossip)
    return what + ": this peer link belongs to the worker and carries no gossip rounds";
  if (st.in_flight)
    return what + ": round " + std::to_string(st.current.round) +
           " is still in flight on this edge (one round at a time)";
  if (st.carried_any && r.round <= st.last_round)
    return what + ": the edge has carried round " + std::to_string(st.last_round) +
           " already; rounds go in increasing order";
  if (r.send && r.bytes > 0 && !r.data) return what + ": no buffer to send";
  if (r.receive && st.edge.payload == EdgePayload::minmax8_difference) {
    const size_t expected =
        comm::minmax_bytes(comm::MinMaxBits::eight, st.edge.public_copy.size(), st.edge.block);
    if (r.bytes != expected)
      return what + ": " + std::to_string(r.bytes) + " bytes, but an 8-bit difference of " +
             std::to_string(st.edge.public_copy.size()) + " values in blocks of " +
             std::to_string(st.edge.block) + " has " + std::to_string(expected);
  }
  if (r.receive && st.edge.payload == EdgePayload::weights && r.bytes % sizeof(float) != 0)
    return what + ": " + std::to_string(r.bytes) + " bytes of weights, expected a multiple of " +
           std::to_string(sizeof(float));
  return {};
}

void start_round(PeerLink* self, const EdgeRound& r) {
  auto& st = self->state;
  st.result = EdgeResult{};
  st.result.peer = st.peer;
  st.result.round = r.round;
  st.carried_any = true;
  st.last_round = r.round;
  if (!st.failure.empty()) {  // a dead neighbour: the round fails at once, naming why
    st.result.error = edge_name(st, r.round) + ": " + st.failure;
    answer(self, std::move(st.result));
    return;
  }
  st.in_flight = true;
  st.current = r;
  st.pending = (r.send ? 1 : 0) + (r.receive ? 1 : 0);
  if (st.pending == 0) {
    end_round(self);
    return;
  }
  const comm::Tag tag = comm::tags::tag_of(comm::tags::round_key(st.edge.key_prefix, r.round));
  caf::actor me = caf::actor_cast<caf::actor>(self);
  const uint64_t round = r.round;
  // Both are posted before either callback can run the round's end (they only send messages).
  if (r.receive) {
    if (st.inbox->size() != r.bytes) st.inbox->resize(r.bytes);  // once, unless the size changes
    auto inbox = st.inbox;
    st.transport->recv(st.peer, tag, inbox->data(), r.bytes,
                       [me, round, inbox](const comm::Status& s) {
                         handoff_release();  // the received bytes are in the inbox
                         caf::anon_send(me, op_done_atom::value, round, false, s.ok(), s.message());
                       });
  }
  if (r.send)
    st.transport->send(st.peer, tag, r.data, r.bytes, [me, round](const comm::Status& s) {
      handoff_release();
      caf::anon_send(me, op_done_atom::value, round, true, s.ok(), s.message());
    });
}

comm::Tag stream_tag(const PeerLinkState& st, uint32_t seq) {
  return comm::tags::tag_of(comm::tags::round_key(st.edge.key_prefix, seq));
}

// Why a stream operation cannot be posted, or "".
std::string stream_refusal(const PeerLinkState& st) {
  const std::string what = "message stream with rank " + std::to_string(st.peer);
  if (!st.gossip || st.edge.payload != EdgePayload::messages)
    return what + ": this peer link carries no message stream";
  if (!st.failure.empty()) return what + ": " + st.failure;
  return {};
}

void listen(PeerLink* self) {
  auto& st = self->state;
  auto sender = caf::actor_cast<caf::actor>(self->current_sender());
  std::string why = stream_refusal(st);
  if (why.empty() && st.listening)
    why = "message stream with rank " + std::to_string(st.peer) +
          ": a receive is posted already (one at a time)";
  if (!why.empty()) {
    StreamArrival refused;
    refused.peer = st.peer;
    refused.error = std::move(why);
    if (sender) self->send(sender, arrived_atom::value, std::move(refused));
    return;
  }
  st.stream_owner = std::move(sender);
  st.listening = true;
  if (st.inbox->size() != st.edge.message_bytes) st.inbox->resize(st.edge.message_bytes);
  caf::actor me = caf::actor_cast<caf::actor>(self);
  auto inbox = st.inbox;
  st.transport->recv(st.peer, stream_tag(st, st.in_seq++), inbox->data(), inbox->size(),
                     [me, inbox](const comm::Status& s) {
                       caf::anon_send(me, stream_op_atom::value, false, s.ok(), s.message(),
                                      static_cast<uint64_t>(inbox->size()));
                     });
}

void post(PeerLink* self, const StreamMessage& m) {
  auto& st = self->state;
  auto sender = caf::actor_cast<caf::actor>(self->current_sender());
  std::string why = stream_refusal(st);
  if (why.empty() && (!m.bytes || m.bytes->size() != st.edge.message_bytes))
    why = "message stream with rank " + std::to_string(st.peer) + ": a message of " +
          std::to_string(m.bytes ? m.bytes->size() : 0) + " bytes, expected " +
          std::to_string(st.edge.message_bytes);
  if (!why.empty()) {
    StreamSent refused;
    refused.peer = st.peer;
    refused.error = std::move(why);
    if (sender) self->send(sender, posted_atom::value, std::move(refused));
    return;
  }
  st.stream_owner = std::move(sender);
  caf::actor me = caf::actor_cast<caf::actor>(self);
  auto message = m.bytes;  // kept alive by the callback until the send ends
  st.transport->send(st.peer, stream_tag(st, st.out_seq++), message->data(), message->size(),
                     [me, message](const comm::Status& s) {
                       caf::anon_send(me, stream_op_atom::value, true, s.ok(), s.message(),
                                      static_cast<uint64_t>(message->size()));
                     });
}

void stream_op_done(PeerLink* self, bool is_send, bool ok, const std::string& error,
                    uint64_t bytes) {
  auto& st = self->state;
  if (!ok && st.failure.empty()) st.failure = error;
  if (is_send) {
    StreamSent sent;
    sent.peer = st.peer;
    sent.ok = ok;
    sent.error = error;
    sent.bytes = ok ? bytes : 0;
    if (st.stream_owner) self->send(st.stream_owner, posted_atom::value, std::move(sent));
    return;
  }
  st.listening = false;
  StreamArrival arrival;
  arrival.peer = st.peer;
  arrival.ok = ok;
  arrival.error = error;
  arrival.data = ok ? st.inbox->data() : nullptr;
  if (st.stream_owner) self->send(st.stream_owner, arrived_atom::value, std::move(arrival));
}

caf::behavior peer_link(PeerLink* self, int peer, std::shared_ptr<comm::Transport> transport,
                        std::shared_ptr<EdgeSettings> edge) {
  auto& st = self->state;
  st.peer = peer;
  st.transport = std::move(transport);
  if (edge) {
    st.gossip = true;
    st.edge = std::move(*edge);
  }
  return {
      [self](fail_atom, const std::string& reason) {
        auto& st = self->state;
        if (!st.failure.empty()) return;
        st.failure = reason;
        // Ends the round in flight, if any: its operations fail and come back as op_done.
        st.transport->fail_peer(st.peer, reason);
      },
      [self](health_atom) -> caf::result<link_state_atom, int, std::string> {
        return {link_state_atom::value, self->state.peer, self->state.failure};
      },
      [self](exchange_atom, const EdgeRound& r) {
        handoff_acquire();  // the trainer's send buffer
        auto& st = self->state;
        auto sender = caf::actor_cast<caf::actor>(self->current_sender());
        if (auto why = refusal(st, r); !why.empty()) {  // the round in flight, if any, goes on
          EdgeResult refused;
          refused.peer = st.peer;
          refused.round = r.round;
          refused.error = std::move(why);
          if (sender) self->send(sender, edge_done_atom::value, std::move(refused));
          return;
        }
        st.owner = std::move(sender);
        start_round(self, r);
      },
      [self](op_done_atom, uint64_t round, bool is_send, bool ok, const std::string& error) {
        handoff_acquire();
        auto& st = self->state;
        if (!st.in_flight || round != st.current.round) return;
        if (ok) {
          (is_send ? st.result.bytes_sent : st.result.bytes_received) += st.current.bytes;
        } else if (st.result.error.empty()) {
          st.result.error = error;
        }
        if (--st.pending == 0) end_round(self);
      },
      [self](listen_atom) { listen(self); },
      [self](post_atom, const StreamMessage& m) { post(self, m); },
      [self](stream_op_atom, bool is_send, bool ok, const std::string& error, uint64_t bytes) {
        stream_op_done(self, is_send, ok, error, bytes);
      },
  };
}

}  // namespace

caf::actor spawn_peer_link(caf::actor_system& system, int peer,
                           std::shared_ptr<comm::Transport> transport) {
  return system.spawn(peer_link, peer, std::move(transport), std::shared_ptr<EdgeSettings>());
}

caf::actor spawn_gossip_link(caf::actor_system& system, EdgeSettings settings,
                             std::shared_ptr<comm::Transport> transport) {
  if (!transport) throw comm::Error("gossip link: no transport");
  const int world = transport->world_size(), me = transport->rank();
  if (settings.peer < 0 || settings.peer >= world || settings.peer == me)
    throw comm::Error("gossip link of rank " + std::to_string(me) + " to rank " +
                      std::to_string(settings.peer) + ": expected another rank in [0, " +
                      std::to_string(world) + ")");
  if (settings.payload == EdgePayload::minmax8_difference &&
      (settings.block == 0 || settings.public_copy.empty()))
    throw comm::Error("gossip link of rank " + std::to_string(me) + " to rank " +
                      std::to_string(settings.peer) + ": an 8-bit difference link needs a block " +
                      ">= 1 and a public copy to start from (block " +
                      std::to_string(settings.block) + ", " +
                      std::to_string(settings.public_copy.size()) + " values)");
  if (settings.payload == EdgePayload::messages && settings.message_bytes == 0)
    throw comm::Error("gossip link of rank " + std::to_string(me) + " to rank " +
                      std::to_string(settings.peer) + ": a message stream needs a message size");
  const int peer = settings.peer;
  return system.spawn(peer_link, peer, std::move(transport),
                      std::make_shared<EdgeSettings>(std::move(settings)));
}

}  // namespace troupe::actors
