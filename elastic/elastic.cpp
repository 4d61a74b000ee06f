#include "elastic/elastic.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <iostream>
#include <random>
#include <sstream>
#include <tuple>
#include <utility>

#include "algorithms/gossip/decentralized.h"
#include "algorithms/local_update/diloco.h"
#include "algorithms/local_update/sparseloco.h"
#include "algorithms/local_update/streaming_diloco.h"
#include "rank/fault.h"
#include "rank/runtime_internal.h"

namespace troupe {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Loads into `module` `own` (this rank's state; empty on a fresh rank), then `shared` (the
// source's part every member holds equal; empty before the first module).
template <typename Module>
void load_states(Module& module, const std::string& own, const std::string& shared) {
  if (!own.empty()) {
    comm::StateReader in(own, "ElasticTrainer's own algorithm state");
    module.load_state(in, StatePart::all);
    in.expect_end();
  }
  if (!shared.empty()) {
    comm::StateReader in(shared, "the algorithm state shared by the generation's source");
    module.load_state(in, StatePart::shared);
    in.expect_end();
  }
}

}  // namespace

/// What ElasticTrainer builds for each world and steps: its three cases are the bucket algorithms
/// (BucketDriver), the local-update ones (LocalUpdateDriver) and the gossip ones (GossipDriver).
struct ElasticTrainer::Driver {
  virtual ~Driver() = default;
  /// The module for the runtime's current world (a collective), with `own` (this rank's state
  /// at the step the job goes on from; empty on a fresh rank), then `shared` (the source's)
  /// loaded, numbered from `step`.
  virtual void build(const std::string& own, const std::string& shared, int64_t step) = 0;
  virtual void destroy() = 0;
  /// After the caller's backward: the step, which runs `optimizer`. Calls `completed` once the
  /// step counts as completed (the job may go on from after it) and `snapshot` where the state
  /// is the one a re-form goes back to.
  virtual void step(torch::optim::Optimizer& optimizer, const std::function<void()>& completed,
                    const std::function<void()>& snapshot) = 0;
  /// The module's algorithm state (StatePart::all: a survivor's own; shared: the source's).
  virtual std::string save(StatePart part) const = 0;
  /// Whether a re-form rolls each rank's caller state (parameters, buffers, optimizer) back to
  /// the last snapshot, where it differs between ranks (the local-update inner optimizers).
  virtual bool rolls_back() const = 0;
  /// Whether each rank's parameters and optimizer are its own (gossip): a survivor keeps them
  /// across a re-form whatever the source's step, and only a rank without state (restarted)
  /// takes the source's.
  virtual bool own_replicas() const { return false; }
  /// A driver that rolls back, before its module goes at a failure: the module's live state
  /// (StatePart::all; empty where it cannot be saved) and its steps, from which a member behind
  /// the source lands the synchronisation it missed (land()).
  virtual std::pair<std::string, int64_t> live() const { return {{}, -1}; }
  /// Lands in the caller's weights the synchronisation that completed on the source only, with
  /// the source's shared state loaded (LocalUpdateModule::land_missed_sync).
  virtual void land() {}
  /// Once the module built is in place and its state kept: what its schedule starts at the
  /// point it was loaded at, before the caller's next forward (LocalUpdateModule::start_due).
  virtual void resume() {}
  virtual std::string algorithm_name() const = 0;
  /// The module, of the driver's kind; null for the other kind, or between worlds.
  virtual DistributedModule* bucket_module() { return nullptr; }
  virtual LocalUpdateModule* local_update_module() { return nullptr; }
  /// The module of the gossip and asynchronous kinds (their statistics); null for the others.
  virtual const DataParallel* data_parallel() const { return nullptr; }
};

ElasticState module_state(std::shared_ptr<torch::nn::Module> module,
                          torch::optim::Optimizer& optimizer) {
  ElasticState state;
  torch::optim::Optimizer* opt = &optimizer;
  state.save = [module, opt] {
    torch::serialize::OutputArchive archive, optimizer_archive;
    module->save(archive);
    opt->save(optimizer_archive);
    archive.write("troupe.optimizer", optimizer_archive);
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  };
  state.load = [module, opt](const std::string& bytes) {
    torch::serialize::InputArchive archive, optimizer_archive;
    archive.load_from(bytes.data(), bytes.size());
    module->load(archive);
    archive.read("troupe.optimizer", optimizer_archive);
    opt->load(optimizer_archive);
  };
  return state;
}

/// The bucket algorithms: a DistributedModule per world, whose state is kept after every step.
/// The caller's state is the same on every member after each step, so nothing rolls back.
struct BucketDriver : ElasticTrainer::Driver {
  BucketDriver(Runtime& rt, std::shared_ptr<torch::nn::Module> module, Algorithm algorithm,
               DdpOptions options)
      : rt(rt),
        module(std::move(module)),
        algorithm(std::move(algorithm)),
        options(std::move(options)) {
    // The shared-memory path maps segments named per job and rank; a re-formed world renumbers
    // its ranks, so elastic buckets reduce through the transport.
    this->options.shared_memory = false;
  }

  void build(const std::string& own, const std::string& shared, int64_t step) override {
    ddp = std::make_unique<DistributedModule>(rt, module, algorithm, options);
    // A survivor keeps its own algorithm state (error feedback, momentum correction) as it was at
    // the end of its last completed step; the bucket layout does not depend on the world size, so
    // it fits the new module. Then the source's shared part (the step, the layout, PowerSGD's Qs)
    // makes every member agree; a restarted rank has only that, and zero error feedback.
    load_states(*ddp, own, {});
    const auto before = ddp->bucket_parameters();
    load_states(*ddp, {}, shared);
    if (!own.empty() && !shared.empty() && ddp->bucket_parameters() != before)
      std::cerr << "troupe: elastic: rank " << rt.rank() << ": the source's bucket layout "
                << "differs from this rank's; its error feedback starts from zero\n";
    ddp->resume_at(static_cast<uint64_t>(step));
  }
  void destroy() override { ddp.reset(); }
  void step(torch::optim::Optimizer& optimizer, const std::function<void()>& completed,
            const std::function<void()>& snapshot) override {
    ddp->step([&] {
      optimizer.step();
      // An error after the optimizer ran (the buffers' broadcast) leaves this step's update in
      // the state: it counts as completed. The reductions are done: with agg_grad the algorithm
      // state is the end of this step's, the one to keep.
      completed();
      if (options.agg_grad) snapshot();
    });
    if (!options.agg_grad) snapshot();
  }
  std::string save(StatePart part) const override {
    std::string bytes;
    comm::StateWriter out(bytes);
    ddp->save_state(out, part);
    return bytes;
  }
  bool rolls_back() const override { return false; }
  std::string algorithm_name() const override { return ddp->algorithm_name(); }
  DistributedModule* bucket_module() override { return ddp.get(); }

  Runtime& rt;
  std::shared_ptr<torch::nn::Module> module;
  Algorithm algorithm;
  DdpOptions options;
  std::unique_ptr<DistributedModule> ddp;
};

/// DiLoCo, Streaming DiLoCo and SparseLoCo: a LocalUpdateModule per world, whose state is kept
/// each time a synchronisation lands; a re-form rolls the caller's state back to that point.
struct LocalUpdateDriver : ElasticTrainer::Driver {
  LocalUpdateDriver(Runtime& rt, std::shared_ptr<torch::nn::Module> module, JobAlgorithm algorithm)
      : rt(rt), module(std::move(module)), algorithm(std::move(algorithm)) {}

  void build(const std::string& own, const std::string& shared, int64_t step) override {
    if (const auto* diloco = std::get_if<DiLoCo>(&algorithm))
      lu = std::make_unique<DiLoCoModule>(rt, module, *diloco);
    else if (const auto* streaming = std::get_if<StreamingDiLoCo>(&algorithm))
      lu = std::make_unique<StreamingDiLoCoModule>(rt, module, *streaming);
    else
      lu = std::make_unique<SparseLoCoModule>(rt, module, std::get<SparseLoCo>(algorithm));
    // The own state (residual or error-feedback memory) as of this rank's last landed sync,
    // then the source's shared part (global weights, outer momentum, the counters); a restarted
    // rank has only that.
    load_states(*lu, own, shared);
    if (lu->inner_steps() != step)
      throw comm::Error("ElasticTrainer: the algorithm state loaded is at inner step " +
                        std::to_string(lu->inner_steps()) + ", expected the job's step " +
                        std::to_string(step));
  }
  void destroy() override { lu.reset(); }
  void step(torch::optim::Optimizer& optimizer, const std::function<void()>& completed,
            const std::function<void()>& snapshot) override {
    lu->step(optimizer, [&] {
      completed();
      snapshot();
    });
  }
  std::pair<std::string, int64_t> live() const override {
    if (!lu) return {{}, -1};
    try {
      // Streaming DiLoCo's fragment whose reduction failed here is saved as such: what landing
      // it needs (with eager updates, this rank's outer gradient and provisional step).
      return {save(StatePart::all), lu->inner_steps()};
    } catch (const comm::Error&) {
      // A reduction still running past its deadline: no live state. Without eager updates the
      // state of the last landing point lands the sync as well; with them this rank cannot
      // land it (its provisional step is lost) and takes the source's state, as a restarted
      // rank does.
      const auto* streaming = std::get_if<StreamingDiLoCo>(&algorithm);
      return {{}, streaming && streaming->eager ? -1 : lu->inner_steps()};
    }
  }
  void land() override { lu->land_missed_sync(); }
  void resume() override { lu->start_due(); }
  std::string save(StatePart part) const override {
    std::string bytes;
    comm::StateWriter out(bytes);
    lu->save_state(out, part);
    return bytes;
  }
  bool rolls_back() const override { return true; }
  std::string algorithm_name() const override { return lu->algorithm_name(); }
  LocalUpdateModule* local_update_module() override { return lu.get(); }

  Runtime& rt;
  std::shared_ptr<torch::nn::Module> module;
  JobAlgorithm algorithm;
  std::unique_ptr<LocalUpdateModule> lu;
};

/// What the gossip and the asynchronous drivers share: a module per world whose replicas differ by
/// design, so each member keeps its own; the deadline of a round (or of ending a world's rounds)
/// is the step's (unset: the Runtime's collective timeout), and the module never replaces the
/// members' weights with rank 0's after a re-form (the first generation's members took the
/// source's in heal()).
template <typename Module>
struct OwnReplicaDriver : ElasticTrainer::Driver {
  OwnReplicaDriver(Runtime& rt, std::shared_ptr<torch::nn::Module> module, JobAlgorithm algorithm,
                   const DdpOptions& ddp)
      : rt(rt), module(std::move(module)), algorithm(std::move(algorithm)) {
    options.timeout = ddp.stall_timeout.value_or(detail::RuntimeAccess::collective_timeout(rt));
    options.broadcast_parameters = !rt.elastic();
  }
  void destroy() override { dp.reset(); }
  // Throws when the world this module runs over is ending: a change announced by the
  // membership service, or a neighbour the module dropped.
  void check_world(const char* when) const {
    if (detail::RuntimeAccess::reform_announced(rt))
      throw comm::Error(dp->algorithm_name() + " step " + std::to_string(step_) + " (" + when +
                        "): the membership service announced a new generation");
    const auto dropped = dp->stats().dropped_peers;
    if (!dropped.empty())
      throw comm::Error(dp->algorithm_name() + " step " + std::to_string(step_) + " (" + when +
                        "): neighbour rank " + std::to_string(dropped.front()) + " was dropped");
  }
  std::string save(StatePart) const override { return {}; }
  bool own_replicas() const override { return true; }
  std::string algorithm_name() const override { return dp->algorithm_name(); }
  const DataParallel* data_parallel() const override { return dp.get(); }

  Runtime& rt;
  std::shared_ptr<torch::nn::Module> module;
  JobAlgorithm algorithm;
  GossipOptions options;
  std::unique_ptr<Module> dp;
  int64_t step_ = 0;
};

/// D-PSGD and Choco-SGD: a DecentralizedModule per world, over that world's topology. Replicas
/// differ by design, so each survivor keeps its own: the trainer keeps its caller state
/// (parameters, buffers, optimizer) after each completed step, and a re-form rolls a survivor
/// back to it only when its step was half-done (the optimizer ran, the round did not complete
/// with every neighbour). A step completes when its round brought every neighbour's message and
/// no change of the membership was announced by its end; the module drops a dead neighbour and
/// mixes with the others, which elastic training counts as a failed step instead. So each
/// survivor goes on from its own last completed step, which may differ between survivors by the
/// few rounds a death takes to reach them; the job's step count goes on from the source's.
struct GossipDriver : OwnReplicaDriver<DecentralizedModule> {
  using OwnReplicaDriver::OwnReplicaDriver;

  void build(const std::string&, const std::string&, int64_t step) override {
    // A fresh module per world: the topology, the peer links and Choco's copies are the new
    // world's; its own step and round counts (a communication interval's phase, a time-varying
    // topology's round) start again from the re-form, the same on every member.
    if (const auto* d = std::get_if<Decentralized>(&algorithm))
      dp = std::make_unique<DecentralizedModule>(rt, module, *d, options);
    else
      dp = std::make_unique<DecentralizedModule>(
          rt, module, std::get<LowPrecisionDecentralized>(algorithm), options);
    step_ = step;
  }
  void step(torch::optim::Optimizer& optimizer, const std::function<void()>& completed,
            const std::function<void()>& snapshot) override {
    // The caller's backward is done; the optimizer and the round have not run.
    fault::at(FaultPhase::backward, step_);
    check_world("before its round");
    dp->step(optimizer);
    // A round that lost a neighbour mixed without it: the step is half-done, and the trainer
    // rolls this rank back to its last snapshot.
    check_world("after its round");
    ++step_;
    completed();
    snapshot();
  }
  bool rolls_back() const override { return true; }
};

/// AsyncModelAverage and AsyncGossip: an AsynchronousModule per world. Replicas differ (the
/// rounds run on their own schedule), so each member keeps its own live one across a re-form:
/// a step either throws before its optimizer runs (a failed background average, the warm-up's
/// allreduce, a change announced) or completes, and what the completed rounds computed has
/// landed by the time the old world's module is gone (AsynchronousModule::end_world), so
/// nothing rolls back and nothing is serialised per step. A restarted rank takes the source's
/// parameters and optimizer. The new module counts its steps from the job's (the source's):
/// every member agrees on whether the warm-up's synchronous allreduce is still due.
struct AsyncDriver : OwnReplicaDriver<AsynchronousModule> {
  using OwnReplicaDriver::OwnReplicaDriver;

  void build(const std::string&, const std::string&, int64_t step) override {
    if (const auto* a = std::get_if<AsyncModelAverage>(&algorithm))
      dp = std::make_unique<AsynchronousModule>(rt, module, *a, options);
    else
      dp = std::make_unique<AsynchronousModule>(rt, module, std::get<AsyncGossip>(algorithm),
                                                options);
    dp->resume_at(static_cast<uint64_t>(step));
    step_ = step;
  }
  void destroy() override {
    if (!dp) return;
    // The old world's rounds end here, without waiting on its other members (some are dead,
    // others step on until they hear of the change); an error ending them is reported, and the
    // re-form goes on (the module is gone either way).
    try {
      dp->end_world("rank " + std::to_string(rt.rank()) + "'s world ends (elastic re-form)");
    } catch (const comm::Error& e) {
      std::cerr << "troupe: elastic: rank " << rt.rank() << ": " << e.what() << "\n";
    }
    dp.reset();
  }
  void step(torch::optim::Optimizer& optimizer, const std::function<void()>& completed,
            const std::function<void()>& snapshot) override {
    fault::at(FaultPhase::backward, step_);
    // A change of the membership ends the world: AsyncGossip would otherwise train on alone
    // once its neighbours were dropped, and never join the next generation.
    check_world("before its step");
    dp->step(optimizer);  // throws before the optimizer, or completes
    ++step_;
    completed();
    snapshot();
  }
  bool rolls_back() const override { return false; }
};

ElasticTrainer::ElasticTrainer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                               torch::optim::Optimizer& optimizer, JobAlgorithm algorithm,
                               DdpOptions options, ElasticState state)
    : rt_(runtime), optimizer_(optimizer), state_(std::move(state)) {
  if (!module) throw comm::Error("ElasticTrainer: module is null");
  // Its snapshots and re-forms expect a step's update applied when step() returns.
  if (options.overlap_next_forward)
    throw comm::Error(
        "ElasticTrainer with DdpOptions.overlap_next_forward (expected it off: an "
        "elastic step is applied before it returns)");
  if (!state_.save || !state_.load) state_ = module_state(module, optimizer_);
  if (const auto* bucket = std::get_if<comm::Compression>(&algorithm))
    driver_ = std::make_unique<BucketDriver>(rt_, module, *bucket, std::move(options));
  else if (std::holds_alternative<Decentralized>(algorithm) ||
           std::holds_alternative<LowPrecisionDecentralized>(algorithm))
    driver_ = std::make_unique<GossipDriver>(rt_, module, std::move(algorithm), options);
  else if (std::holds_alternative<AsyncModelAverage>(algorithm) ||
           std::holds_alternative<AsyncGossip>(algorithm))
    driver_ = std::make_unique<AsyncDriver>(rt_, module, std::move(algorithm), options);
  else
    driver_ = std::make_unique<LocalUpdateDriver>(rt_, module, std::move(algorithm));
  try {
    if (rt_.elastic()) heal(rt_.generation());
    build();
  } catch (const comm::Error& e) {
    if (!rt_.elastic()) throw;
    recover(e.what());
  }
}

ElasticTrainer::~ElasticTrainer() = default;

DistributedModule& ElasticTrainer::module() {
  auto* ddp = driver_->bucket_module();
  if (!ddp)
    throw comm::Error("ElasticTrainer::module(): the trainer runs " + algorithm_name() +
                      ", not a bucket algorithm");
  return *ddp;
}

LocalUpdateModule& ElasticTrainer::local_update() {
  auto* lu = driver_->local_update_module();
  if (!lu)
    throw comm::Error("ElasticTrainer::local_update(): the trainer runs " + algorithm_name() +
                      ", not a local-update algorithm");
  return *lu;
}

std::string ElasticTrainer::algorithm_name() const { return driver_->algorithm_name(); }

CommStats ElasticTrainer::stats() const {
  const auto* module = driver_->data_parallel();
  if (!module)
    throw comm::Error("ElasticTrainer::stats(): the trainer runs " + algorithm_name() +
                      ", not a gossip or asynchronous algorithm");
  return module->stats();
}

void ElasticTrainer::build() {
  // A gossip member's caller state (its own replica, or the source's on a restarted rank) goes
  // in before its module, which takes the weights into its flat buffer; a local-update one's
  // after, since the module's construction may broadcast rank 0's weights. Either is the state
  // at the step the job goes on from (heal() chose it).
  const bool before = driver_->own_replicas();
  if (before && !caller_.empty()) state_.load(caller_);
  // Without rollback the live state is a survivor's own from here on (asynchronous algorithms):
  // the source's bytes a restarted rank loaded are not loaded again at a later re-form.
  if (before && !driver_->rolls_back()) caller_.clear();
  driver_->build(own_, shared_, completed_);
  if (!before && driver_->rolls_back() && !caller_.empty()) state_.load(caller_);
  if (land_) driver_->land();
  built_ = true;
  steps_ = completed_;
  snapshot();
  // Streaming DiLoCo's fragment due at this landing point starts now, in this world, so that
  // the caller's next backward runs on the weights it leaves (eager updates move them).
  driver_->resume();
}

void ElasticTrainer::snapshot() {
  own_ = driver_->save(StatePart::all);
  shared_ = driver_->save(StatePart::shared);
  if (driver_->rolls_back()) caller_ = state_.save();
  land_ = false;
}

void ElasticTrainer::heal(const ElasticGeneration& generation) {
  auto& comm = rt_.comm();
  const bool source = rt_.rank() == generation.source;
  std::string bytes;
  int64_t size = 0;
  if (source) {
    // The caller's state (parameters, buffers, optimizer) at the step the job goes on from, and
    // whether the sync of that step is still to land in it; then the module's shared state
    // (empty before the first module).
    comm::StateWriter out(bytes);
    out.string(driver_->rolls_back() && !caller_.empty() ? caller_ : state_.save());
    out.value(static_cast<uint8_t>(land_));
    out.string(shared_);
    size = static_cast<int64_t>(bytes.size());
  }
  comm.broadcast(&size, 1, comm::DataType::int64, generation.source);
  if (!source) fault::at_any(FaultPhase::heal, generation.step);
  // The transport moves elements: the bytes travel as 32-bit words.
  bytes.resize(static_cast<size_t>((size + 3) / 4 * 4));
  comm.broadcast(bytes.data(), bytes.size() / 4, comm::DataType::int32, generation.source);
  bytes.resize(static_cast<size_t>(size));
  if (!source) {
    comm::StateReader in(bytes, "the state of generation " + std::to_string(generation.number) +
                                    "'s source (rank " + std::to_string(generation.source) + ")");
    std::string caller = in.string();
    const bool caller_lands = in.value<uint8_t>() != 0;
    std::string shared = in.string();
    in.expect_end();
    if (driver_->own_replicas()) {
      // Gossip and asynchronous: a survivor keeps its own replica (gossip: caller_, its last
      // completed step; asynchronous: its live state) whatever the source's step, since the
      // replicas differ by design; a restarted member takes the source's.
      if (!built_) caller_ = std::move(caller);
    } else if (!driver_->rolls_back()) {
      // The bucket algorithms: every member takes the source's. A member behind it by a step
      // keeps its own residual of the step before (the unsent remainder of the step it missed
      // is dropped, never sent twice).
      state_.load(caller);
    } else if (own_.empty() || (completed_ != generation.step && live_step_ != generation.step)) {
      // A restarted member takes the source's parameters, buffers and inner optimizer (and
      // zero residual). One behind by more than the sync it was in cannot be: it would too.
      if (!own_.empty())
        std::cerr << "troupe: elastic: rank " << rt_.rank() << " at step " << completed_
                  << " (live " << live_step_ << ") is behind the source's step " << generation.step
                  << " by more than a sync: it takes the source's state\n";
      caller_ = std::move(caller);
      land_ = caller_lands;
    } else if (completed_ != generation.step) {
      // Behind the source: its sync after step generation.step failed here and completed there.
      // It goes on from its live state of that step (its own inner optimizer and weights, and
      // own algorithm state where it could be saved), and lands the sync with the source's
      // shared state (build()), as the sync would have.
      caller_ = std::move(live_caller_);
      if (!live_own_.empty()) own_ = std::move(live_own_);
      land_ = true;
    }
    // Else at the source's step: its own state of that step (rolled back to it).
    shared_ = std::move(shared);
  }
  completed_ = generation.step;
}

void ElasticTrainer::recover(const std::string& why) {
  const auto start = Clock::now();
  // A local-update algorithm goes back to the last point where a sync landed (build() loads the
  // caller state of that point); a member behind the source goes on from its live state.
  if (driver_->rolls_back() && !driver_->own_replicas()) {
    std::tie(live_own_, live_step_) = driver_->live();
    live_caller_ = state_.save();
  }
  driver_->destroy();
  for (int attempt = 1;; ++attempt) {
    const ElasticGeneration generation = rt_.reform(completed_);  // throws when the job stops
    try {
      heal(generation);
      build();
      recoveries_.push_back(
          {generation.number, rt_.world_size(), completed_, generation.source, since(start), why});
      std::cerr << "troupe: elastic: rank " << rt_.rank() << " of " << rt_.world_size()
                << " (launch slot " << rt_.slot() << ") goes on in generation " << generation.number
                << " from step " << completed_ << " after " << since(start) << " s\n";
      return;
    } catch (const comm::Error& e) {
      driver_->destroy();  // the world changed again while healing: re-form once more
      if (attempt >= 32)
        throw comm::Error(std::string("ElasticTrainer: the world did not settle in 32 "
                                      "generations; the last failed with: ") +
                          e.what());
    }
  }
}

bool ElasticTrainer::step(const std::function<void()>& forward_backward) {
  try {
    forward_backward();
    driver_->step(
        optimizer_, [this] { completed_ = steps_ + 1; }, [this] { snapshot(); });
    ++steps_;
    return true;
  } catch (const comm::Error& e) {
    if (!rt_.elastic()) throw;
    recover(e.what());
    return false;
  }
}

bool ElasticTrainer::finish() {
  try {
    rt_.comm().barrier();
    return true;
  } catch (const comm::Error& e) {
    if (!rt_.elastic()) throw;
    recover(e.what());
    return false;
  }
}

ElasticSampler::ElasticSampler(int64_t size, int64_t global_batch, uint64_t seed)
    : size_(size), global_batch_(global_batch), seed_(seed) {
  if (size < 1)
    throw comm::Error("ElasticSampler: size " + std::to_string(size) + " (expected > 0)");
  if (global_batch < 1 || global_batch > size)
    throw comm::Error("ElasticSampler: global_batch " + std::to_string(global_batch) +
                      " (expected 1.." + std::to_string(size) + ", the dataset size)");
}

std::vector<int64_t> ElasticSampler::indices(int64_t step, int rank, int world) {
  if (step < 0 || world < 1 || rank < 0 || rank >= world)
    throw comm::Error("ElasticSampler::indices(step " + std::to_string(step) + ", rank " +
                      std::to_string(rank) + ", world " + std::to_string(world) +
                      ") (expected step >= 0 and 0 <= rank < world)");
  const int64_t epoch = step / steps_per_epoch();
  if (epoch != epoch_) {
    // Fisher-Yates with a fixed generator: the same permutation on every rank and platform.
    order_.resize(static_cast<size_t>(size_));
    for (int64_t i = 0; i < size_; ++i) order_[static_cast<size_t>(i)] = i;
    std::mt19937_64 random(seed_ + static_cast<uint64_t>(epoch));
    for (int64_t i = size_ - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(random() % static_cast<uint64_t>(i + 1));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
    }
    epoch_ = epoch;
  }
  const int64_t first = (step % steps_per_epoch()) * global_batch_;
  const int64_t begin = first + global_batch_ * rank / world;
  const int64_t end = first + global_batch_ * (rank + 1) / world;
  return std::vector<int64_t>(order_.begin() + begin, order_.begin() + end);
}

}  // namespace troupe
