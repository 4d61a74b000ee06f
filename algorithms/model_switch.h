#pragma once
/// ModelSwitch: a DataParallel whose algorithm can change during training (Bagua's
/// ModelSwitchWrapper), e.g. gradient allreduce for warm-up, then decentralized SGD, then
/// allreduce again to end with one model.
///
/// ```cpp
/// troupe::ModelSwitch dp(rt, net, troupe::comm::GradientAllReduce{});
/// ... dp.step(opt) ...
/// dp.switch_to(troupe::Decentralized{...});     // every rank, at the same step
/// ```
/// switch_to is a collective: the current algorithm finishes (background rounds end together),
/// the weights are averaged over all ranks (so every rank starts the new phase from the same
/// model), and the new algorithm is built as it needs (buckets, a flat buffer, actors). The
/// optimizer and its state are the trainer's and carry over.
#include <memory>
#include <string>

#include "algorithms/registry.h"

namespace troupe {

class ModelSwitch : public DataParallel {
 public:
  /// `module`: a shared_ptr or a ModuleHolder (rank/module_holder.h).
  ModelSwitch(Runtime& runtime, ModelRef module, JobAlgorithm algorithm, DdpOptions options = {});
  ~ModelSwitch() override;

  /// Every rank, at the same step. Each switch gives back the old module's id and takes a new one
  /// (rank/module_id.h), so a Runtime may switch any number of times.
  void switch_to(const JobAlgorithm& algorithm);
  /// How many times switch_to has run.
  int switches() const { return switches_; }

  void step(torch::optim::Optimizer& optimizer) override;
  void finish() override;
  std::string algorithm_name() const override;
  /// Summed over every algorithm run so far (dropped peers of all of them).
  CommStats stats() const override;
  /// The current algorithm's state and the number of switches. load_state needs the ModelSwitch
  /// to run the algorithm the state was saved under (switch_to it first): comm::Error names both.
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;

 private:
  Runtime& runtime_;
  std::shared_ptr<torch::nn::Module> module_;
  DdpOptions options_;
  std::unique_ptr<DataParallel> current_;
  CommStats before_;  // what the algorithms before the current one did
  int switches_ = 0;
};

}  // namespace troupe
