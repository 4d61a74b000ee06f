#pragma once
/// NeighborExchange: one gossip round over the Transport — this rank's buffer to each peer it
/// sends to, each peer's buffer from those it receives from — in which a peer that fails drops out
/// of the round instead of failing it (gossip goes on with the neighbours that are left).
///
/// Unlike a collective (schedule.h), a round has no lanes or local steps: every send and receive
/// is posted at once, and the round ends when each has completed or failed. Completion callbacks
/// run on transport threads; the round's owner either blocks in wait() (with a deadline: peers
/// still silent then are declared dead with Transport::fail_peer, which ends their operations) or
/// sets on_done() to be told (an actor).
///
/// Also here: mix(), the weighted sum that ends a gossip round, x = w_self x + sum_j w_j x_j.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/transport/transport.h"

namespace troupe::comm {

/// How a round ended.
struct ExchangeOutcome {
  /// recv_from peers whose buffer arrived in full, in the order of recv_from.
  std::vector<int> received;
  /// Peers whose send or receive failed, with the first reason for each (sorted by peer).
  std::vector<std::pair<int, std::string>> failed;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
};

class NeighborExchange : public std::enable_shared_from_this<NeighborExchange> {
 public:
  /// Posts the round: `send` (bytes long) to every peer of send_to under `tag`, and from each
  /// peer recv_from[i] exactly `bytes` into recv_buffers[i]. Every buffer must stay valid until the
  /// round has ended. Peers are distinct from this rank and from each other within each list.
  static std::shared_ptr<NeighborExchange> start(std::shared_ptr<Transport> transport, Tag tag,
                                                 const void* send, size_t bytes,
                                                 std::vector<int> send_to,
                                                 std::vector<int> recv_from,
                                                 std::vector<void*> recv_buffers);

  /// Blocks until every operation has ended. At `deadline`, peers whose operations are still
  /// pending are failed with a reason naming the round (`what`) and the time waited, and the call
  /// waits for their operations to end (Transport::fail_peer ends them at once).
  ExchangeOutcome wait(std::chrono::steady_clock::time_point deadline, const std::string& what);
  bool done() const;
  /// Called once (on a transport thread, or at once if already done) when the round has ended.
  void on_done(std::function<void()> fn);
  /// The outcome once done().
  ExchangeOutcome outcome() const;
  /// Peers with an operation still pending.
  std::vector<int> pending_peers() const;

 private:
  struct Op {
    int peer = -1;
    bool is_send = false;
    size_t bytes = 0;
    bool done = false;
    bool ok = false;
    std::string error;
  };
  NeighborExchange(std::shared_ptr<Transport> transport, std::vector<Op> ops);
  void complete(size_t index, const Status& status);

  // Weak: the operations' callbacks keep the round alive, and may be destroyed on the transport's
  // own thread; the round must never hold the last reference to the transport there.
  std::weak_ptr<Transport> transport_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Op> ops_;
  size_t remaining_;
  std::function<void()> on_done_;
};

/// out[i] = self_weight * self[i] + sum_j weights[j] * others[j][i] for i in [0, n). `out` may be
/// `self`. Computed in cache-sized blocks (one pass over memory), in float32 with float weights.
void mix(float* out, const float* self, double self_weight, const std::vector<const float*>& others,
         const std::vector<double>& weights, size_t n);

}  // namespace troupe::comm
