#pragma once
/// FlatModel (internal to runtime/gossip): a module's float32 parameters moved into one flat
/// buffer, each parameter a view of its slice, so that weights are sent, snapshotted and mixed as
/// one array; plus the lock that orders the optimizer's step against background averaging.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/runtime.h"

namespace troupe::gossip {

class FlatModel {
 public:
  /// A collective: checks that every rank has the same parameters (names, shapes; all float32,
  /// else an error naming the parameter and its dtype), flattens them and copies rank 0's values
  /// to every rank (unless `broadcast` is false). `what` names the algorithm in error messages.
  FlatModel(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, std::string what,
            bool broadcast = true);

  float* data() { return flat_.data_ptr<float>(); }
  size_t count() const { return static_cast<size_t>(flat_.numel()); }
  const torch::Tensor& tensor() const { return flat_; }
  /// Held by whoever changes the weights: the optimizer step and the background actors.
  std::mutex& mutex() { return mutex_; }
  /// The gradients of the parameters, copied into `out` (count() floats; zeros where none).
  void gradients(float* out) const;
  /// Copies `in` into the gradients (allocating those that are undefined).
  void set_gradients(const float* in);
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<torch::Tensor> params_;
  std::vector<int64_t> offsets_;
  torch::Tensor flat_;
  std::mutex mutex_;
};

}  // namespace troupe::gossip
