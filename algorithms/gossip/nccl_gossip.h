#pragma once
/// NcclGossip (internal to algorithms/gossip): D-PSGD's gossip rounds for a model on a CUDA device,
/// each round one group of NCCL sends and receives (comm::NcclCommunicator::exchange) on the
/// module's own communicator, split from the Runtime's so that two modules' rounds never
/// interleave differently on different ranks.
///
/// start() copies the weights into a device send buffer on torch's current stream and records a
/// CUDA event there: the exchange's stream waits on that event, never on the whole device, so the
/// round overlaps whatever torch enqueues next (the optimizer step, the next forward). wait()
/// blocks until the round's completion event has fired; the received weights are then in device
/// memory, visible to torch's stream, for the mix.
///
/// Unlike the transport's rounds (actors/peer_link.h), NCCL cannot drop one peer from a group:
/// a peer that dies or stays silent fails the round — and the communicator, so every later round
/// too — with an error naming the round. Deadlines: each round's NCCL operation has the module's
/// timeout from the moment it was queued, and wait() gives up at its own deadline.
///
/// In a troupe built without NCCL the constructor throws; DecentralizedModule takes this path only
/// when Runtime::nccl_available().
#include <torch/types.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "rank/runtime.h"

namespace troupe::gossip {

class NcclGossip {
 public:
  /// Collective (every rank at the same point, e.g. constructing the module): takes this rank's
  /// member of the Runtime's NCCL communicator on `device` and splits the module's own from it.
  /// `timeout`: of the split and of each round.
  NcclGossip(Runtime& runtime, int device, std::chrono::milliseconds timeout);
  ~NcclGossip();
  NcclGossip(const NcclGossip&) = delete;
  NcclGossip& operator=(const NcclGossip&) = delete;

  /// Posts a round: `weights` (a float32 tensor on the device) to every rank of send_to, and
  /// from each rank of recv_from as many floats into received(i). `what` names the round in
  /// errors. Throws comm::Error when a round is already in flight or NCCL refuses the arguments.
  void start(const torch::Tensor& weights, const std::vector<int>& send_to,
             const std::vector<int>& recv_from, const std::string& what);
  bool in_flight() const;

  struct Outcome {
    size_t bytes_sent = 0;
    size_t bytes_received = 0;
  };
  /// Waits for the round in flight until `deadline`; throws comm::Error naming the round when it
  /// failed or did not complete (the communicator is aborted then).
  Outcome wait(std::chrono::steady_clock::time_point deadline);

  /// The last round's send buffer (this rank's weights as sent) and what came from recv_from[i].
  const torch::Tensor& sent() const;
  const torch::Tensor& received(size_t i) const;

  /// Fails the round in flight and every later one (any thread): a neighbour died.
  void abort(const std::string& reason);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace troupe::gossip
