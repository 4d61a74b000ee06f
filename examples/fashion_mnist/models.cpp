#include "fashion_mnist/models.h"

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>

#include <stdexcept>
#include <string>

#include <troupe/distributed_module.h>

namespace troupe::examples {

CnnNetImpl::CnnNetImpl()
    : conv1_(register_module("conv1",
                             torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
      conv2_(register_module("conv2",
                             torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
      fc1_(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128))),
      fc2_(register_module("fc2", torch::nn::Linear(128, 10))) {}

// Each layer waits for its parameters' update of the last step (DdpOptions::
// overlap_next_forward: the last step's reductions may still be on the wire; without that
// option, or without troupe, await_parameters returns at once).
torch::Tensor CnnNetImpl::forward(const torch::Tensor& x) {
  await_parameters(conv1_);
  torch::Tensor h = torch::max_pool2d(torch::relu(conv1_->forward(x)), 2);  // 16 x 14 x 14
  await_parameters(conv2_);
  h = torch::max_pool2d(torch::relu(conv2_->forward(h)), 2);  // 32 x 7 x 7
  await_parameters(fc1_);
  h = torch::relu(fc1_->forward(h.flatten(1)));
  await_parameters(fc2_);
  return torch::log_softmax(fc2_->forward(h), 1);
}

MlpNetImpl::MlpNetImpl(std::vector<int64_t> sizes) {
  if (sizes.size() < 2) {
    throw std::invalid_argument("MlpNet: " + std::to_string(sizes.size()) +
                                " sizes, expected at least 2 (input and output)");
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 1) {
      throw std::invalid_argument("MlpNet: size " + std::to_string(i) + " is " +
                                  std::to_string(sizes[i]) + ", expected at least 1");
    }
  }
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    layers_.push_back(
        register_module("fc" + std::to_string(i + 1), torch::nn::Linear(sizes[i], sizes[i + 1])));
  }
}

torch::Tensor MlpNetImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x.flatten(1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    await_parameters(layers_[i]);  // as in CnnNetImpl::forward
    h = layers_[i]->forward(h);
    if (i + 1 < layers_.size()) h = torch::relu(h);
  }
  return torch::log_softmax(h, 1);
}

}  // namespace troupe::examples
