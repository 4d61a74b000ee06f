#include <torch/optim/optimizer.h>

#include <iostream>
#include <variant>

#include "actors/background.h"
#include "actors/node.h"
#include "algorithms/gossip/decentralized.h"
#include "algorithms/gossip/flat_model.h"
#include "ddp/wrapped_modules.h"
#include "rank/module_id.h"
#include "rank/runtime_internal.h"

namespace troupe {

struct AsynchronousModule::Impl {
  Runtime& rt;
  ModuleId id;  // given back last, once the actor that uses its keys is gone
  std::variant<AsyncModelAverage, AsyncGossip> algorithm;
  GossipOptions options;
  WrappedModule wrapped;  // refuses a second wrapper of the module while this one lives
  gossip::FlatModel flat;
  uint32_t key_prefix;
  std::shared_ptr<actors::BackgroundStats> background = std::make_shared<actors::BackgroundStats>();
  actors::Background actor;
  int listener = -1;
  std::string topology_text;

  uint64_t steps = 0;
  bool running = false;  // the background actor has been started and not stopped
  bool aborted = false;  // abort() called and not resumed
  bool finished = false;
  bool ended = false;      // end_world() called
  std::vector<int> peers;  // the ranks the background actor talks to
  std::vector<float> gradients;
  mutable std::mutex stats_mutex;
  CommStats totals;

  Impl(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
       std::variant<AsyncModelAverage, AsyncGossip> algo, GossipOptions opts, std::string what)
      : rt(runtime),
        id(runtime),
        algorithm(std::move(algo)),
        options(opts),
        wrapped(module.get(), "AsynchronousModule"),
        flat(runtime, std::move(module), what, opts.broadcast_parameters),
        key_prefix(id.key_prefix()),
        pending(flat.count(), 0.0f) {
    gossip::survive_peer_loss(runtime, key_prefix, what);
  }

  // The background rounds' results waiting to land in the weights (see land()), whether there
  // are any, and the generation of the weights (a new one when reattach() replaced them); all
  // under flat.mutex().
  std::vector<float> pending;
  bool has_pending = false;
  uint64_t generation = 0;

  // The actors see the model as it will be once what they handed over has landed: x + pending.
  // A CUDA model is staged through its host mirror (FlatModel::pull and push).
  actors::ModelAccess access() {
    actors::ModelAccess a;
    a.count = flat.count();
    a.snapshot = [this](float* dst) {
      std::lock_guard<std::mutex> lock(flat.mutex());
      flat.pull();
      const float* x = flat.host();
      const size_t n = flat.count();
      if (has_pending) {
        for (size_t i = 0; i < n; ++i) dst[i] = x[i] + pending[i];
      } else {
        std::memcpy(dst, x, n * sizeof(float));
      }
      return generation;
    };
    a.apply = [this](const float* target, const float* snapshot, float weight, uint64_t from) {
      std::lock_guard<std::mutex> lock(flat.mutex());
      if (from != generation) return;  // computed from weights that have since been replaced
      const size_t n = flat.count();
      for (size_t i = 0; i < n; ++i) pending[i] += weight * (target[i] - snapshot[i]);
      has_pending = true;
    };
    return a;
  }

  // x += pending: the rounds that completed since the last call land in the weights. On the
  // trainer's thread, holding flat.mutex().
  void land() {
    if (!has_pending) return;
    flat.pull();
    float* x = flat.host();
    const size_t n = flat.count();
    for (size_t i = 0; i < n; ++i) x[i] += pending[i];
    flat.push();
    std::fill(pending.begin(), pending.end(), 0.0f);
    has_pending = false;
  }

  // Parameters the user replaced (torch::load, set_data) go back into the flat buffer with their
  // new values; what the rounds computed from the old weights is dropped. On the trainer's thread.
  void reattach() {
    std::lock_guard<std::mutex> lock(flat.mutex());
    if (!flat.reattach()) return;
    ++generation;
    std::fill(pending.begin(), pending.end(), 0.0f);
    has_pending = false;
  }

  int warmup_steps() const {
    if (auto* a = std::get_if<AsyncModelAverage>(&algorithm)) return a->warmup_steps;
    return 0;
  }

  void start_background() {
    if (running || aborted || finished) return;
    if (steps < static_cast<uint64_t>(warmup_steps())) return;
    running = true;
    actor.start();
  }

  // Stops the background actor (its last round lands too) and lands what the rounds computed.
  void stop_background() {
    bool ok = true;
    std::string error;
    if (running) {
      running = false;
      const auto stopped = actor.stop(options.timeout);
      ok = stopped.answered && stopped.ok;
      error = stopped.error;
    }
    {
      std::lock_guard<std::mutex> lock(flat.mutex());
      land();
    }
    if (!ok) throw comm::Error(name() + ": stopping: " + error);
  }

  std::string name() const {
    if (auto* a = std::get_if<AsyncModelAverage>(&algorithm))
      return "async_model_average(every " + std::to_string(a->sync_interval_ms) + " ms, warm-up " +
             std::to_string(a->warmup_steps) + " steps)";
    return "async_gossip(" + topology_text + ")";
  }
};

AsynchronousModule::AsynchronousModule(Runtime& runtime, ModelRef model,
                                       AsyncModelAverage algorithm, GossipOptions options) {
  if (algorithm.warmup_steps < 0)
    throw comm::Error("AsyncModelAverage.warmup_steps = " + std::to_string(algorithm.warmup_steps) +
                      ": expected an integer >= 0");
  if (algorithm.sync_interval_ms < 1)
    throw comm::Error("AsyncModelAverage.sync_interval_ms = " +
                      std::to_string(algorithm.sync_interval_ms) + ": expected an integer >= 1");
  impl_ = std::make_unique<Impl>(runtime, model.get("AsynchronousModule"), algorithm, options,
                                 "async_model_average");
  auto& m = *impl_;
  actors::AveragerSettings settings;
  settings.interval = std::chrono::milliseconds(algorithm.sync_interval_ms);
  settings.key_prefix = m.key_prefix;
  m.actor = actors::Background::averager(detail::node(runtime).system(), m.access(), settings,
                                         runtime.transport(), m.background);
  for (int r = 0; r < runtime.world_size(); ++r)
    if (r != runtime.rank()) m.peers.push_back(r);
  // Every rank takes part in every average: a dead rank ends the rounds, naming it.
  m.listener = runtime.add_failure_listener(
      [actor = m.actor](int rank, const std::string& reason) { actor.lost(rank, reason); });
  m.gradients.resize(m.flat.count());
  m.start_background();
}

AsynchronousModule::AsynchronousModule(Runtime& runtime, ModelRef model, AsyncGossip algorithm,
                                       GossipOptions options) {
  if (algorithm.min_interval_ms < 0)
    throw comm::Error("AsyncGossip.min_interval_ms = " + std::to_string(algorithm.min_interval_ms) +
                      ": expected an integer >= 0");
  comm::Topology topology(algorithm.topology, runtime.world_size());
  if (!topology.undirected() || topology.time_varying())
    throw comm::Error(
        "asynchronous gossip averages pairwise with fixed neighbours: it needs a "
        "static undirected topology, not " +
        topology.describe());
  impl_ = std::make_unique<Impl>(runtime, model.get("AsynchronousModule"), algorithm, options,
                                 "async_gossip");
  auto& m = *impl_;
  m.topology_text = topology.describe();
  actors::GossiperSettings settings;
  settings.neighbours = topology.round(runtime.rank(), 0).recv_from;
  settings.min_interval = std::chrono::milliseconds(algorithm.min_interval_ms);
  settings.key_prefix = m.key_prefix;
  settings.seed = algorithm.topology.seed;
  m.peers = settings.neighbours;
  m.actor = actors::Background::gossiper(detail::node(runtime).system(), m.access(), settings,
                                         runtime.transport(), m.background);
  m.listener = runtime.add_failure_listener(
      [actor = m.actor](int rank, const std::string& reason) { actor.lost(rank, reason); });
  m.start_background();
}

AsynchronousModule::~AsynchronousModule() {
  try {
    finish();
  } catch (const std::exception& e) {
    std::cerr << "troupe: " << impl_->name() << ": " << e.what() << "\n";
  }
  if (impl_->listener >= 0) impl_->rt.remove_failure_listener(impl_->listener);
  impl_->actor.exit();
}

void AsynchronousModule::step(torch::optim::Optimizer& optimizer) {
  auto& m = *impl_;
  if (m.ended) throw comm::Error(m.name() + ": step() after end_world()");
  {
    // The averages cannot go on without a dead rank: say so now rather than train on alone.
    std::lock_guard<std::mutex> lock(m.background->mutex);
    if (!m.background->error.empty()) throw comm::Error(m.name() + ": " + m.background->error);
  }
  m.reattach();
  if (m.steps < static_cast<uint64_t>(m.warmup_steps())) {
    // Warm-up: synchronous gradient allreduce, one flat buffer.
    auto started = std::chrono::steady_clock::now();
    m.flat.gradients(m.gradients.data());
    m.rt.comm().allreduce(m.gradients.data(), m.gradients.size(), comm::DataType::float32,
                          comm::ReduceOp::avg);
    m.flat.set_gradients(m.gradients.data());
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    m.totals.comm_wait_sec +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    // Ring allreduce: each rank sends and receives 2 (W - 1) / W of the buffer.
    const double w = m.rt.world_size();
    const auto bytes = static_cast<uint64_t>(2 * (w - 1) / w * m.gradients.size() * sizeof(float));
    m.totals.bytes_sent += bytes;
    m.totals.last_step_bytes_sent = bytes;
    m.totals.bytes_received += bytes;
  } else {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    m.totals.last_step_bytes_sent = 0;
  }
  {
    std::lock_guard<std::mutex> lock(m.flat.mutex());
    optimizer.step();
    m.land();
  }
  ++m.steps;
  m.start_background();
}

void AsynchronousModule::abort() {
  auto& m = *impl_;
  m.reattach();
  m.stop_background();
  m.aborted = true;
}

void AsynchronousModule::resume() {
  auto& m = *impl_;
  if (m.finished)
    throw comm::Error(m.name() + ": resume() after " + (m.ended ? "end_world()" : "finish()"));
  m.aborted = false;
  m.reattach();
  m.start_background();
}

void AsynchronousModule::finish() {
  auto& m = *impl_;
  if (m.finished) return;
  m.finished = true;
  m.reattach();
  m.stop_background();
}

void AsynchronousModule::end_world(const std::string& reason) {
  auto& m = *impl_;
  if (m.ended) return;
  m.ended = true;
  m.finished = true;
  m.reattach();
  // A round in flight waits on peers that may never answer (dead, or stepping on in the old world
  // until they hear of the change): its operations fail now, and no neighbour is waited for.
  if (auto transport = m.rt.transport())
    for (int peer : m.peers) transport->fail_peer(peer, reason);
  const bool averager = std::holds_alternative<AsyncModelAverage>(m.algorithm);
  if (averager)
    m.actor.lost(-1, reason);
  else
    for (int peer : m.peers) m.actor.lost(peer, reason);
  const std::string deadline = std::to_string(m.options.timeout.count()) + " ms";
  std::string failed;
  if (m.running) {
    // The averager answers once the round in flight has failed (or at once between rounds); the
    // gossiper once the sends to its dropped neighbours have ended.
    m.running = false;
    const auto stopped = m.actor.stop(m.options.timeout);
    if (!stopped.answered) failed = "its background rounds did not end: " + stopped.error;
  }
  {
    std::lock_guard<std::mutex> lock(m.flat.mutex());
    m.land();
  }
  // The actor's model access points into this module: it must be gone before the module is.
  if (!m.actor.exit_and_wait(m.options.timeout) && failed.empty())
    failed = "its background actor did not exit within " + deadline;
  if (!failed.empty())
    throw comm::Error(m.name() + ": ending the world (" + reason + "): " + failed);
}

void AsynchronousModule::resume_at(uint64_t steps) {
  auto& m = *impl_;
  if (m.ended) throw comm::Error(m.name() + ": resume_at() after end_world()");
  m.steps = steps;
  {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    m.totals.steps = steps;
  }
  m.start_background();
}

void AsynchronousModule::save_state(comm::StateWriter& out) const {
  auto& m = *impl_;
  out.string(m.name());
  std::lock_guard<std::mutex> lock(m.flat.mutex());
  out.value(m.steps);
  out.value<uint8_t>(m.has_pending ? 1 : 0);
  out.vector(m.pending);
}

void AsynchronousModule::load_state(comm::StateReader& in) {
  auto& m = *impl_;
  const auto saved = in.string();
  if (saved != m.name()) in.fail("saved under " + saved + ", this module runs " + m.name());
  const auto steps = in.value<uint64_t>();
  const bool has_pending = in.value<uint8_t>() != 0;
  auto pending = in.vector<float>(m.pending.size(), "the pending round results");
  {
    std::lock_guard<std::mutex> lock(m.flat.mutex());
    m.steps = steps;
    // Rounds this module started before the load computed from other weights: dropped.
    ++m.generation;
    m.pending = std::move(pending);
    m.has_pending = has_pending;
  }
  {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    m.totals.steps = steps;
  }
  m.start_background();  // past the warm-up now, if the saved run was
}

std::string AsynchronousModule::algorithm_name() const { return impl_->name(); }

std::string AsynchronousModule::gossip_path() const {
  return impl_->flat.on_cuda() ? "cuda via host staging" : "cpu";
}

CommStats AsynchronousModule::stats() const {
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.stats_mutex);
  CommStats s = m.totals;
  s.steps = m.steps;
  s.bytes_sent += m.background->bytes_sent;
  s.bytes_received += m.background->bytes_received;
  s.background_rounds = m.background->rounds;
  std::lock_guard<std::mutex> lock2(m.background->mutex);
  s.dropped_peers = m.background->dropped;
  return s;
}

}  // namespace troupe
