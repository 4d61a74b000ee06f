#include "runtime/local_update/local_update_module.h"

#include <mutex>

#include "comm/state.h"
#include "runtime/local_update/outer_step.h"

namespace troupe {

LocalUpdateModule::LocalUpdateModule(std::unique_ptr<Algorithm> algorithm)
    : algorithm_(std::move(algorithm)) {}

LocalUpdateModule::~LocalUpdateModule() = default;

void LocalUpdateModule::step(torch::optim::Optimizer& inner) {
  algorithm_->after_step(algorithm_->outer_step().inner_step(inner));
}

std::string LocalUpdateModule::algorithm_name() const { return algorithm_->name(); }

CommStats LocalUpdateModule::stats() const { return algorithm_->outer_step().totals; }

int64_t LocalUpdateModule::outer_steps() const { return algorithm_->outer_step().outer; }

void LocalUpdateModule::save_state(comm::StateWriter& out) const {
  algorithm_->before_save();
  auto& core = algorithm_->outer_step();
  std::lock_guard<std::mutex> lock(core.flat.mutex());
  core.save(out, algorithm_->name());
  algorithm_->save_rest(out);
}

void LocalUpdateModule::load_state(comm::StateReader& in) {
  algorithm_->before_load(in);
  auto& core = algorithm_->outer_step();
  const auto saved = core.read(in, algorithm_->name());
  const auto apply = algorithm_->read_rest(in);
  std::lock_guard<std::mutex> lock(core.flat.mutex());
  apply(in);
  core.restore(saved);
}

}  // namespace troupe
