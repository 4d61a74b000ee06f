#pragma once
/// Link emulation: peer links shaped to a bandwidth and a latency, so that a job on one fast host
/// shows what an algorithm would gain or lose on a slower network.
///
/// This is EMULATION, not a network model. Each directed link (this rank -> peer) is a serial wire
/// on the sender's side: a send of B bytes starts when the link is free (or now), occupies it for
/// B / bandwidth, and its bytes arrive `latency` after they have all left; only then is the real
/// send issued on the transport underneath, so the receiver sees the data no earlier than such a
/// link would deliver it. There is no loss, no congestion shared between links, no switch, and the
/// medium underneath (shared memory, TCP) still moves the bytes at its own speed afterwards.
/// Receives pass through untouched: shaping is done by the sender, so a link shaped on the sending
/// rank is shaped whatever the receiver does.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/link_shape.h"
#include "comm/transport/transport.h"

namespace troupe::comm {

/// A Transport that sends through `inner` as if over links of the given shapes (see the top of
/// this file). One timer thread holds the delayed sends in a queue ordered by arrival time and
/// issues each on `inner` when it is due; sends on unshaped links go to `inner` at once.
/// Callbacks come from the timer thread or from `inner`'s threads, so serial_callbacks() is false.
/// fail_peer fails the sends still delayed for that peer at once, with the reason, and forwards
/// to `inner`. The destructor stops the timer thread and fails the delayed sends with
/// "transport shut down".
class EmulatedTransport final : public Transport {
 public:
  /// `shapes[p]` is the link from this rank to peer p; throws comm::Error unless there is one per
  /// rank of `inner` and every shape is valid (a rate that is not negative, finite).
  EmulatedTransport(std::shared_ptr<Transport> inner, std::vector<LinkShape> shapes);
  ~EmulatedTransport() override;
  EmulatedTransport(const EmulatedTransport&) = delete;
  EmulatedTransport& operator=(const EmulatedTransport&) = delete;

  /// The transport underneath.
  const std::shared_ptr<Transport>& inner() const;

  int rank() const override;
  int world_size() const override;
  /// The inner transport's name + "+emulated", e.g. "inproc+emulated".
  std::string name() const override;
  bool serial_callbacks() const override { return false; }
  void send(int peer, Tag tag, const void* data, size_t bytes, Callback done) override;
  void recv(int peer, Tag tag, void* data, size_t bytes, Callback done) override;
  void fail_peer(int peer, const std::string& reason) override;
  /// Forwarded to `inner`.
  std::string survive_peer_loss(uint32_t key_prefix) override;
  /// Probes go to `inner` unshaped: they ask whether the peer is there, not how fast.
  bool can_probe() const override;
  void probe(int peer, Callback done) override;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with the timer thread
};

}  // namespace troupe::comm
