#pragma once
/// Models for the Fashion-MNIST examples: a small CNN that learns the set in one epoch, and an MLP
/// whose size is chosen by the caller (small for demos, large for communication benchmarks).
/// Both take images [N, 1, 28, 28] and return log-probabilities [N, 10].
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

namespace troupe::examples {

/// conv(1->16, 3x3, pad 1)-relu-maxpool2, conv(16->32, 3x3, pad 1)-relu-maxpool2,
/// fc(1568->128)-relu, fc(128->10), log_softmax; 207k parameters named conv1.*, conv2.*, fc1.*,
/// fc2.*. One epoch of SGD (lr 0.05, momentum 0.9, batch 64) reaches 86-88% test accuracy
/// (6 seeds); the unpadded 5x5 variant (16, 32 channels) reached only 85-87%.
class CnnNetImpl : public torch::nn::Module {
 public:
  CnnNetImpl();
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};
TORCH_MODULE(CnnNet);

/// Fully connected layers of `sizes` (input flattened, ReLU between layers, log_softmax at the
/// end), named fc1, fc2, ...: {784, 256, 10} (the default, 204k parameters) for demos,
/// {784, 2048, 2048, 1024, 10} (7.9M parameters) for benchmarks. Throws std::invalid_argument
/// for fewer than two sizes or a size below 1.
class MlpNetImpl : public torch::nn::Module {
 public:
  explicit MlpNetImpl(std::vector<int64_t> sizes = {784, 256, 10});
  torch::Tensor forward(const torch::Tensor& x);

 private:
  std::vector<torch::nn::Linear> layers_;
};

/// MlpNetImpl behind torch's module holder, constructible from a list: MlpNet({784, 256, 10}).
class MlpNet : public torch::nn::ModuleHolder<MlpNetImpl> {
 public:
  using torch::nn::ModuleHolder<MlpNetImpl>::ModuleHolder;
  explicit MlpNet(std::vector<int64_t> sizes)
      : ModuleHolder(std::make_shared<MlpNetImpl>(std::move(sizes))) {}
  // Without it, MlpNet({784, 256, 10}) is ambiguous with the holder's forwarding constructor.
  MlpNet(std::initializer_list<int64_t> sizes) : MlpNet(std::vector<int64_t>(sizes)) {}
};

}  // namespace troupe::examples
