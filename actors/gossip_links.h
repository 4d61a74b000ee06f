#pragma once
/// GossipLinks: a gossip module's peer links (actors/peer_link.h, one per neighbour) and the
/// rounds it runs through them, seen from the trainer's thread.
///
/// start() sends each link of the round its part (exchange_atom) and returns at once: the round
/// travels while the trainer computes. wait() is the one blocking call, made where the algorithm
/// needs the neighbours' values: it collects the links' edge_done answers (in the mailbox of a
/// scoped actor, so answers that came while the trainer computed are already there) until every
/// link of the round has answered or the deadline passes. At the deadline a silent link is told
/// its peer is dead (fail_atom, naming the round and the time waited): its transport operations
/// fail, and it answers with that failure. Failed edges are reported, not thrown: gossip goes on
/// without them.
#include <caf/fwd.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "actors/peer_link.h"

namespace troupe::actors {

/// How a round ended over all its edges.
struct RoundOutcome {
  /// The peers of recv_from whose message arrived, in the order of recv_from, and for each the
  /// link's values (EdgeResult::values): valid until the next start().
  std::vector<int> received;
  std::vector<const float*> values;
  /// Peers whose edge failed, with the reason (sorted by peer).
  std::vector<std::pair<int, std::string>> failed;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
};

class GossipLinks {
 public:
  /// Links carry EdgePayload::weights unless added otherwise; their tags use key_prefix.
  GossipLinks(caf::actor_system& system, std::shared_ptr<comm::Transport> transport,
              uint32_t key_prefix);
  /// Stops the links. No round may be in flight (wait() for it first).
  ~GossipLinks();
  GossipLinks(const GossipLinks&) = delete;
  GossipLinks& operator=(const GossipLinks&) = delete;

  /// Spawns the link to settings.peer now (key_prefix is set here). A weights link to a peer that
  /// has none is spawned at its first round.
  void add(EdgeSettings settings);

  /// Posts round `round`: `data` (bytes long, valid until wait() returns) to every peer of
  /// send_to, and a receive of `bytes` from every peer of recv_from. One round at a time.
  void start(uint64_t round, const void* data, size_t bytes, const std::vector<int>& send_to,
             const std::vector<int>& recv_from);
  bool in_flight() const { return in_flight_; }
  /// Waits for the round in flight (see above); `what` names it in failures.
  RoundOutcome wait(std::chrono::steady_clock::time_point deadline, const std::string& what);

  /// `peer` is dead: its link fails what it carries and every later round. Any thread.
  void fail(int peer, const std::string& reason);

 private:
  caf::actor link(int peer);

  caf::actor_system& system_;
  std::shared_ptr<comm::Transport> transport_;
  uint32_t key_prefix_;
  std::unique_ptr<caf::scoped_actor> self_;  // the trainer's mailbox for the links' answers
  mutable std::mutex mutex_;                 // links_: fail() comes from other threads
  std::map<int, caf::actor> links_;

  bool in_flight_ = false;
  uint64_t round_ = 0;
  std::vector<int> recv_from_;
  std::vector<int> waiting_;  // peers whose link has not answered yet
};

}  // namespace troupe::actors
