#pragma once
/// The decentralized and asynchronous algorithms' settings (algorithms/gossip/ runs them).
///
/// - Decentralized: D-PSGD. Every rank mixes its weights with its neighbours' (topology.h) each
///   communication_interval steps. `overlap` (Bagua's decentralized): the weights x_t leave for the
///   neighbours right after step t-1 and travel while forward and backward run; step t sets
///   x_{t+1} = sum_j W_ij x_j,t - lr g_i(x_i,t). `after_step` (adapt-then-combine, mlbench-core's
///   DecentralizedSGD): local step first, then x_{t+1} = sum_j W_ij (x_j,t - lr g_j).
/// - LowPrecisionDecentralized: Choco-SGD with 8-bit min-max compressed differences: each rank
///   keeps public copies x_hat of itself and its neighbours; after the local step it sends
///   q = Q(x - x_hat_i), every copy is moved by the q it belongs to, and
///   x += gamma * sum_j W_ij (x_hat_j - x_hat_i). Undirected, static topologies only.
/// - AsyncModelAverage (Bagua's async_model_average): warmup_steps of gradient allreduce, then a
///   background averager every sync_interval_ms: snapshot s, average the snapshots of all ranks,
///   x += avg - s (local progress made meanwhile is kept). Training never waits for it.
/// - AsyncGossip (AD-PSGD): a background thread repeatedly averages the model with one random
///   neighbour (x_i, x_j <- (x_i + x_j) / 2 as deltas); no global step; at least min_interval_ms
///   between two exchanges it starts.
#include <cstdint>

#include "comm/gossip/topology.h"

namespace troupe {

struct Decentralized {
  enum class Exchange { overlap, after_step };
  comm::TopologySpec topology;
  Exchange exchange = Exchange::overlap;
  /// Mix every this many steps; the steps between are local.
  int communication_interval = 1;
};

struct LowPrecisionDecentralized {
  comm::TopologySpec topology;
  /// Consensus step size, in (0, 1].
  double gamma = 1.0;
  /// Elements per 8-bit min-max block.
  int block = 4096;
};

struct AsyncModelAverage {
  /// Steps of synchronous gradient allreduce before averaging goes asynchronous.
  int warmup_steps = 0;
  /// Milliseconds between the starts of two background averages (> 0).
  int sync_interval_ms = 100;
};

struct AsyncGossip {
  comm::TopologySpec topology;
  /// Milliseconds between the starts of two exchanges a rank initiates (>= 0).
  int min_interval_ms = 10;
};

}  // namespace troupe
