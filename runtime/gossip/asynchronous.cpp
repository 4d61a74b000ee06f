#include <caf/all.hpp>

#include <torch/optim/optimizer.h>

#include <iostream>
#include <variant>

#include "actors/atoms.h"
#include "actors/background.h"
#include "runtime/gossip/decentralized.h"
#include "runtime/gossip/flat_model.h"

namespace troupe {

struct AsynchronousModule::Impl {
  Runtime& rt;
  std::variant<AsyncModelAverage, AsyncGossip> algorithm;
  GossipOptions options;
  gossip::FlatModel flat;
  uint32_t key_prefix;
  std::shared_ptr<actors::BackgroundStats> background = std::make_shared<actors::BackgroundStats>();
  caf::actor actor;
  int listener = -1;
  std::string topology_text;

  uint64_t steps = 0;
  bool running = false;   // the background actor has been started and not stopped
  bool aborted = false;   // abort() called and not resumed
  bool finished = false;
  std::vector<float> gradients;
  mutable std::mutex stats_mutex;
  CommStats totals;

  Impl(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
       std::variant<AsyncModelAverage, AsyncGossip> algo, GossipOptions opts, std::string what)
      : rt(runtime),
        algorithm(std::move(algo)),
        options(opts),
        flat(runtime, std::move(module), std::move(what), opts.broadcast_parameters),
        key_prefix(static_cast<uint32_t>(runtime.next_module_id()) << 28) {}

  actors::ModelAccess access() {
    actors::ModelAccess a;
    a.count = flat.count();
    gossip::FlatModel* model = &flat;
    // A CUDA model is staged through its host mirror (FlatModel::pull and push).
    a.snapshot = [model](float* dst) {
      std::lock_guard<std::mutex> lock(model->mutex());
      model->pull();
      std::memcpy(dst, model->host(), model->count() * sizeof(float));
    };
    a.apply = [model](const float* target, const float* snapshot, float weight) {
      std::lock_guard<std::mutex> lock(model->mutex());
      model->pull();
      float* x = model->host();
      const size_t n = model->count();
      for (size_t i = 0; i < n; ++i) x[i] += weight * (target[i] - snapshot[i]);
      model->push();
    };
    return a;
  }

  int warmup_steps() const {
    if (auto* a = std::get_if<AsyncModelAverage>(&algorithm)) return a->warmup_steps;
    return 0;
  }

  void start_background() {
    if (running || aborted || finished) return;
    if (steps < static_cast<uint64_t>(warmup_steps())) return;
    running = true;
    caf::anon_send(actor, actors::start_atom::value);
  }

  void stop_background() {
    if (!running) return;
    running = false;
    caf::scoped_actor self{rt.system()};
    bool ok = false;
    std::string error;
    self->request(actor, options.timeout, actors::stop_atom::value)
        .receive([&](bool k, const std::string& e) {
                   ok = k;
                   error = e;
                 },
                 [&](caf::error& e) {
                   error = "no answer from the background actor within " +
                           std::to_string(options.timeout.count()) +
                           " ms: " + rt.system().render(e);
                 });
    if (!ok) throw comm::Error(name() + ": stopping: " + error);
  }

  std::string name() const {
    if (auto* a = std::get_if<AsyncModelAverage>(&algorithm))
      return "async_model_average(every " + std::to_string(a->sync_interval_ms) + " ms, warm-up " +
             std::to_string(a->warmup_steps) + " steps)";
    return "async_gossip(" + topology_text + ")";
  }
};

AsynchronousModule::AsynchronousModule(Runtime& runtime,
                                       std::shared_ptr<torch::nn::Module> module,
                                       AsyncModelAverage algorithm, GossipOptions options) {
  if (algorithm.warmup_steps < 0)
    throw comm::Error("AsyncModelAverage.warmup_steps = " + std::to_string(algorithm.warmup_steps) +
                      ": expected an integer >= 0");
  if (algorithm.sync_interval_ms < 1)
    throw comm::Error("AsyncModelAverage.sync_interval_ms = " +
                      std::to_string(algorithm.sync_interval_ms) + ": expected an integer >= 1");
  impl_ = std::make_unique<Impl>(runtime, std::move(module), algorithm, options,
                                 "async_model_average");
  auto& m = *impl_;
  actors::AveragerSettings settings;
  settings.interval = std::chrono::milliseconds(algorithm.sync_interval_ms);
  settings.key_prefix = m.key_prefix;
  m.actor = actors::spawn_averager(runtime.system(), m.access(), settings, runtime.transport(),
                                   m.background);
  // Every rank takes part in every average: a dead rank ends the rounds, naming it.
  caf::actor actor = m.actor;
  m.listener = runtime.add_failure_listener([actor](int rank, const std::string& reason) {
    caf::anon_send(actor, actors::abort_atom::value, reason, rank);
  });
  m.gradients.resize(m.flat.count());
  m.start_background();
}

AsynchronousModule::AsynchronousModule(Runtime& runtime,
                                       std::shared_ptr<torch::nn::Module> module,
                                       AsyncGossip algorithm, GossipOptions options) {
  if (algorithm.min_interval_ms < 0)
    throw comm::Error("AsyncGossip.min_interval_ms = " + std::to_string(algorithm.min_interval_ms) +
                      ": expected an integer >= 0");
  comm::Topology topology(algorithm.topology, runtime.world_size());
  if (!topology.undirected() || topology.time_varying())
    throw comm::Error("asynchronous gossip averages pairwise with fixed neighbours: it needs a "
                      "static undirected topology, not " + topology.describe());
  impl_ = std::make_unique<Impl>(runtime, std::move(module), algorithm, options, "async_gossip");
  auto& m = *impl_;
  m.topology_text = topology.describe();
  actors::GossiperSettings settings;
  settings.neighbours = topology.round(runtime.rank(), 0).recv_from;
  settings.min_interval = std::chrono::milliseconds(algorithm.min_interval_ms);
  settings.key_prefix = m.key_prefix;
  settings.seed = algorithm.topology.seed;
  m.actor = actors::spawn_gossiper(runtime.system(), m.access(), settings, runtime.transport(),
                                   m.background);
  caf::actor actor = m.actor;
  m.listener = runtime.add_failure_listener([actor](int rank, const std::string& reason) {
    caf::anon_send(actor, actors::drop_atom::value, rank, reason);
  });
  m.start_background();
}

AsynchronousModule::~AsynchronousModule() {
  try {
    finish();
  } catch (const std::exception& e) {
    std::cerr << "troupe: " << impl_->name() << ": " << e.what() << "\n";
  }
  if (impl_->listener >= 0) impl_->rt.remove_failure_listener(impl_->listener);
  caf::anon_send_exit(impl_->actor, caf::exit_reason::user_shutdown);
}

void AsynchronousModule::step(torch::optim::Optimizer& optimizer) {
  auto& m = *impl_;
  {
    // The averages cannot go on without a dead rank: say so now rather than train on alone.
    std::lock_guard<std::mutex> lock(m.background->mutex);
    if (!m.background->error.empty()) throw comm::Error(m.name() + ": " + m.background->error);
  }
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
  }
  ++m.steps;
  m.start_background();
}

void AsynchronousModule::abort() {
  auto& m = *impl_;
  m.stop_background();
  m.aborted = true;
}

void AsynchronousModule::resume() {
  auto& m = *impl_;
  if (m.finished) throw comm::Error(m.name() + ": resume() after finish()");
  m.aborted = false;
  m.start_background();
}

void AsynchronousModule::finish() {
  auto& m = *impl_;
  if (m.finished) return;
  m.finished = true;
  m.stop_background();
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
