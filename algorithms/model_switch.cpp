#include "algorithms/model_switch.h"

#include <torch/torch.h>

namespace troupe {

namespace {

// The totals of two algorithms run one after the other (the last step's bytes are the later's).
CommStats add(const CommStats& earlier, const CommStats& later) {
  CommStats s = later;
  s.steps += earlier.steps;
  s.bytes_sent += earlier.bytes_sent;
  s.bytes_received += earlier.bytes_received;
  s.comm_wait_sec += earlier.comm_wait_sec;
  s.background_rounds += earlier.background_rounds;
  s.dropped_peers.insert(s.dropped_peers.begin(), earlier.dropped_peers.begin(),
                         earlier.dropped_peers.end());
  return s;
}

}  // namespace

ModelSwitch::ModelSwitch(Runtime& runtime, ModelRef module, JobAlgorithm algorithm,
                         DdpOptions options)
    : runtime_(runtime), module_(module.get("ModelSwitch")), options_(std::move(options)) {
  current_ = make_data_parallel(runtime_, module_, algorithm, options_);
}

ModelSwitch::~ModelSwitch() = default;

void ModelSwitch::switch_to(const JobAlgorithm& algorithm) {
  current_->finish();
  before_ = add(before_, current_->stats());
  current_.reset();
  average_module(runtime_, *module_);
  current_ = make_data_parallel(runtime_, module_, algorithm, options_);
  ++switches_;
}

void ModelSwitch::step(torch::optim::Optimizer& optimizer) { current_->step(optimizer); }

void ModelSwitch::finish() { current_->finish(); }

std::string ModelSwitch::algorithm_name() const { return current_->algorithm_name(); }

void ModelSwitch::save_state(comm::StateWriter& out) const {
  out.string(current_->algorithm_name());
  out.value<int32_t>(switches_);
  current_->save_state(out);
}

void ModelSwitch::load_state(comm::StateReader& in) {
  const auto saved = in.string();
  const auto switches = in.value<int32_t>();
  if (saved != current_->algorithm_name())
    in.fail("saved while running " + saved + " (after " + std::to_string(switches) +
            " switches); this ModelSwitch runs " + current_->algorithm_name() +
            " (expected switch_to the saved algorithm before loading)");
  current_->load_state(in);
  switches_ = switches;
}

CommStats ModelSwitch::stats() const { return add(before_, current_->stats()); }

}  // namespace troupe
