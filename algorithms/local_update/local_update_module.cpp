#include "algorithms/local_update/local_update_module.h"

#include <mutex>

#include "algorithms/local_update/outer_step.h"
#include "comm/state.h"
#include "comm/status.h"

namespace troupe {

LocalUpdateModule::LocalUpdateModule(std::unique_ptr<Algorithm> algorithm)
    : algorithm_(std::move(algorithm)) {}

LocalUpdateModule::~LocalUpdateModule() = default;

void LocalUpdateModule::step(torch::optim::Optimizer& inner) { step(inner, {}); }

void LocalUpdateModule::step(torch::optim::Optimizer& inner, const std::function<void()>& landed) {
  struct Listening {  // the listener is this call's only, whatever it throws
    Algorithm& a;
    ~Listening() { a.on_landed = nullptr; }
  } listening{*algorithm_};
  algorithm_->on_landed = &landed;
  auto& core = algorithm_->outer_step();
  algorithm_->before_step(core.inner);
  algorithm_->after_step(core.inner_step(inner));
}

void LocalUpdateModule::start_due() { algorithm_->before_step(algorithm_->outer_step().inner); }

int64_t LocalUpdateModule::inner_steps() const { return algorithm_->outer_step().inner; }

void LocalUpdateModule::land_missed_sync() { algorithm_->land_missed(inner_steps()); }

void LocalUpdateModule::Algorithm::land_missed(int64_t) {
  auto& core = outer_step();
  std::lock_guard<std::mutex> lock(core.flat.mutex());
  auto local = core.local();
  local.copy_(core.global);
  core.flat.push();
}

void LocalUpdateModule::PeriodicAlgorithm::after_step(int64_t t) {
  if (t % period() == 0) {
    synchronise();
    landed();
  }
}

void LocalUpdateModule::PeriodicAlgorithm::land_missed(int64_t t) {
  if (t % period() != 0)
    throw comm::Error(outer_step().what + ": no synchronisation lands after inner step " +
                      std::to_string(t) +
                      " (expected a multiple of h = " + std::to_string(period()) + ")");
  Algorithm::land_missed(t);
}

std::string LocalUpdateModule::algorithm_name() const { return algorithm_->name(); }

CommStats LocalUpdateModule::stats() const { return algorithm_->outer_step().totals; }

int64_t LocalUpdateModule::outer_steps() const { return algorithm_->outer_step().outer; }

void LocalUpdateModule::save_state(comm::StateWriter& out) const {
  save_state(out, StatePart::all);
}

void LocalUpdateModule::load_state(comm::StateReader& in) { load_state(in, StatePart::all); }

void LocalUpdateModule::save_state(comm::StateWriter& out, StatePart part) const {
  algorithm_->before_save();
  auto& core = algorithm_->outer_step();
  std::lock_guard<std::mutex> lock(core.flat.mutex());
  core.save(out, algorithm_->name());
  if (part == StatePart::all)
    algorithm_->save_rest(out);
  else
    algorithm_->save_shared_rest(out);
}

void LocalUpdateModule::load_state(comm::StateReader& in, StatePart part) {
  algorithm_->before_load(in);
  auto& core = algorithm_->outer_step();
  const auto saved = core.read(in, algorithm_->name());
  const auto apply =
      part == StatePart::all ? algorithm_->read_rest(in) : algorithm_->read_shared_rest(in);
  std::lock_guard<std::mutex> lock(core.flat.mutex());
  apply(in);
  core.restore(saved);
}

void LocalUpdateModule::Algorithm::save_shared_rest(comm::StateWriter&) {
  throw comm::Error(name() +
                    ": its state has no part shared by every rank (elastic training "
                    "runs diloco and sparseloco)");
}

std::function<void(comm::StateReader&)> LocalUpdateModule::Algorithm::read_shared_rest(
    comm::StateReader&) {
  throw comm::Error(name() +
                    ": its state has no part shared by every rank (elastic training "
                    "runs diloco and sparseloco)");
}

}  // namespace troupe
