#include "runtime/elastic.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <iostream>
#include <random>
#include <sstream>

#include "runtime/fault.h"

namespace troupe {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

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

ElasticTrainer::ElasticTrainer(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                               torch::optim::Optimizer& optimizer, Algorithm algorithm,
                               DdpOptions options, ElasticState state)
    : rt_(runtime),
      module_(std::move(module)),
      optimizer_(optimizer),
      algorithm_(std::move(algorithm)),
      options_(std::move(options)),
      state_(std::move(state)) {
  if (!module_) throw comm::Error("ElasticTrainer: module is null");
  if (!state_.save || !state_.load) state_ = module_state(module_, optimizer_);
  // The shared-memory path maps segments named per job and rank; a re-formed world renumbers
  // its ranks, so elastic buckets reduce through the transport.
  options_.shared_memory = false;
  try {
    if (rt_.elastic()) heal(rt_.generation());
    build();
  } catch (const comm::Error& e) {
    if (!rt_.elastic()) throw;
    recover(e.what());
  }
}

ElasticTrainer::~ElasticTrainer() = default;

void ElasticTrainer::build() {
  ddp_ = std::make_unique<DistributedModule>(rt_, module_, algorithm_, options_);
  // A survivor keeps its own algorithm state (error feedback, momentum correction) as it was at
  // the end of its last completed step; the bucket layout does not depend on the world size, so
  // it fits the new module. Then the source's shared part (the step, the layout, PowerSGD's Qs)
  // makes every member agree; a restarted rank has only that, and zero error feedback.
  if (!own_.empty()) {
    comm::StateReader in(own_, "ElasticTrainer's own algorithm state");
    ddp_->load_state(in, StatePart::all);
    in.expect_end();
  }
  if (!shared_.empty()) {
    const auto before = ddp_->bucket_parameters();
    comm::StateReader in(shared_, "the algorithm state shared by the generation's source");
    ddp_->load_state(in, StatePart::shared);
    in.expect_end();
    if (!own_.empty() && ddp_->bucket_parameters() != before)
      std::cerr << "troupe: elastic: rank " << rt_.rank() << ": the source's bucket layout differs "
                << "from this rank's; its error feedback starts from zero\n";
  }
  ddp_->resume_at(static_cast<uint64_t>(completed_));
  snapshot();
}

void ElasticTrainer::snapshot() {
  own_.clear();
  comm::StateWriter all(own_);
  ddp_->save_state(all, StatePart::all);
  shared_.clear();
  comm::StateWriter shared(shared_);
  ddp_->save_state(shared, StatePart::shared);
}

void ElasticTrainer::heal(const ElasticGeneration& generation) {
  auto& comm = rt_.comm();
  const bool source = rt_.rank() == generation.source;
  std::string bytes;
  int64_t size = 0;
  if (source) {
    // The caller's state (parameters, buffers, optimizer), then the module's shared state (empty
    // before the first module).
    comm::StateWriter out(bytes);
    out.string(state_.save());
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
    const std::string user = in.string();
    std::string shared = in.string();
    in.expect_end();
    state_.load(user);
    // A member behind the source by a step keeps its own residual of the step before (the
    // unsent remainder of the step it missed is dropped, never sent twice).
    shared_ = std::move(shared);
  }
  completed_ = generation.step;
}

void ElasticTrainer::recover(const std::string& why) {
  const auto start = Clock::now();
  ddp_.reset();
  for (int attempt = 1;; ++attempt) {
    const ElasticGeneration generation = rt_.reform(completed_);  // throws when the job stops
    try {
      heal(generation);
      build();
      recoveries_.push_back({generation.number, rt_.world_size(), completed_, since(start), why});
      std::cerr << "troupe: elastic: rank " << rt_.rank() << " of " << rt_.world_size()
                << " (launch slot " << rt_.slot() << ") goes on in generation "
                << generation.number << " from step " << completed_ << " after "
                << since(start) << " s\n";
      return;
    } catch (const comm::Error& e) {
      ddp_.reset();  // the world changed again while healing: re-form once more
      if (attempt >= 32)
        throw comm::Error(std::string("ElasticTrainer: the world did not settle in 32 "
                                      "generations; the last failed with: ") + e.what());
    }
  }
}

bool ElasticTrainer::step(const std::function<void()>& forward_backward) {
  bool applied = false;
  try {
    forward_backward();
    ddp_->step([&] {
      optimizer_.step();
      applied = true;
      // The reductions are done: the algorithm state is the end of this step's, the one to keep
      // if the world changes before the next step completes.
      if (options_.agg_grad) snapshot();
    });
    ++completed_;
    if (!options_.agg_grad) snapshot();
    return true;
  } catch (const comm::Error& e) {
    if (!rt_.elastic()) throw;
    // An error after the optimizer ran (the buffers' broadcast) leaves this step's update in the
    // state: it counts as completed.
    if (applied) ++completed_;
    recover(e.what());
    return false;
  }
}

ElasticSampler::ElasticSampler(int64_t size, int64_t global_batch, uint64_t seed)
    : size_(size), global_batch_(global_batch), seed_(seed) {
  if (size < 1) throw comm::Error("ElasticSampler: size " + std::to_string(size) + " (expected > 0)");
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
