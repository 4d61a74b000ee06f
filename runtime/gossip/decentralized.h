#pragma once
/// The decentralized and asynchronous algorithms (runtime/gossip/algorithms.h says what each does)
/// as DataParallel objects a training loop steps like a DistributedModule:
///
/// ```cpp
/// troupe::DecentralizedModule dp(rt, net, troupe::Decentralized{.topology = {.kind =
///                                    troupe::comm::TopologyKind::ring}});
/// for (...) { opt.zero_grad(); loss.backward(); dp.step(opt); }
/// dp.finish();
/// ```
/// Construction is a collective: every rank must wrap the same model (names, shapes; float32 on
/// the CPU), whose parameters are then moved into one flat buffer (each parameter a view of it)
/// and set to rank 0's values. When a neighbour dies, gossip goes on with the neighbours left
/// (their weights renormalised); the rank is logged and listed in stats().dropped_peers.
#include <chrono>
#include <memory>
#include <string>

#include "runtime/data_parallel.h"
#include "runtime/gossip/algorithms.h"

namespace troupe {

struct GossipOptions {
  /// Deadline of each synchronous gossip round, of finish(), abort() and resume(). A neighbour
  /// silent for this long is declared dead.
  std::chrono::milliseconds timeout{60000};
  /// Start every rank from rank 0's weights (true), or from its own.
  bool broadcast_parameters = true;
};

/// Decentralized SGD (D-PSGD) and its low-precision variant (Choco-SGD, 8-bit differences).
class DecentralizedModule : public DataParallel {
 public:
  DecentralizedModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                      Decentralized algorithm, GossipOptions options = {});
  DecentralizedModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                      LowPrecisionDecentralized algorithm, GossipOptions options = {});
  ~DecentralizedModule() override;

  void step(torch::optim::Optimizer& optimizer) override;
  /// Waits for the exchange in flight (overlap mode: the weights sent after the last step).
  void finish() override;
  std::string algorithm_name() const override;
  CommStats stats() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Asynchronous model averaging and asynchronous pairwise gossip (AD-PSGD): background actors
/// (actors/background.h) average the model while training goes on; step() only takes the model
/// lock for the optimizer's step (and, during AsyncModelAverage's warm-up, allreduces gradients).
class AsynchronousModule : public DataParallel {
 public:
  AsynchronousModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                     AsyncModelAverage algorithm, GossipOptions options = {});
  AsynchronousModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                     AsyncGossip algorithm, GossipOptions options = {});
  ~AsynchronousModule() override;

  void step(torch::optim::Optimizer& optimizer) override;
  /// Every rank: background averaging stops after one last round that all ranks take together
  /// (AsyncModelAverage), or once every neighbour has said goodbye (AsyncGossip). Steps go on
  /// locally until resume().
  void abort();
  /// Every rank: background averaging starts again (after warm-up, if that has not ended).
  void resume();
  /// abort(), for good.
  void finish() override;
  std::string algorithm_name() const override;
  CommStats stats() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
