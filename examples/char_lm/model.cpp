#include "char_lm/model.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace troupe::examples {

CharBlockImpl::CharBlockImpl(int64_t dim, int64_t heads) : heads_(heads) {
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  qkv_ = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  proj_ = register_module("proj", torch::nn::Linear(dim, dim));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  up_ = register_module("up", torch::nn::Linear(dim, 4 * dim));
  down_ = register_module("down", torch::nn::Linear(4 * dim, dim));
}

torch::Tensor CharBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  const int64_t batch = x.size(0), length = x.size(1), dim = x.size(2), head_dim = dim / heads_;
  // [batch, length, 3, heads, head_dim] -> three [batch, heads, length, head_dim]
  auto qkv = qkv_->forward(norm1_->forward(x)).view({batch, length, 3, heads_, head_dim});
  auto q = qkv.select(2, 0).transpose(1, 2);
  auto k = qkv.select(2, 1).transpose(1, 2);
  auto v = qkv.select(2, 2).transpose(1, 2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  auto attention = torch::softmax(scores + mask, -1);
  auto mixed = torch::matmul(attention, v).transpose(1, 2).reshape({batch, length, dim});
  auto h = x + proj_->forward(mixed);
  return h + down_->forward(torch::gelu(up_->forward(norm2_->forward(h))));
}

CharTransformerImpl::CharTransformerImpl(const CharModelShape& shape) : shape_(shape) {
  if (shape.vocab < 2 || shape.context < 1 || shape.dim < 1 || shape.layers < 1 ||
      shape.heads < 1 || shape.dim % shape.heads != 0)
    throw std::invalid_argument(
        "char transformer: vocab " + std::to_string(shape.vocab) + ", context " +
        std::to_string(shape.context) + ", dim " + std::to_string(shape.dim) + ", layers " +
        std::to_string(shape.layers) + ", heads " + std::to_string(shape.heads) +
        ": expected vocab >= 2, the others >= 1, and heads dividing dim");
  tokens_ = register_module("tokens", torch::nn::Embedding(shape.vocab, shape.dim));
  positions_ = register_module("positions", torch::nn::Embedding(shape.context, shape.dim));
  for (int64_t l = 0; l < shape.layers; ++l)
    blocks_.push_back(
        register_module("block" + std::to_string(l), CharBlock(shape.dim, shape.heads)));
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.dim})));
  head_ = register_module("head", torch::nn::Linear(shape.dim, shape.vocab));
  mask_ =
      torch::full({shape.context, shape.context}, -std::numeric_limits<float>::infinity()).triu(1);
}

torch::Tensor CharTransformerImpl::forward(const torch::Tensor& ids) {
  const int64_t length = ids.size(1);
  if (length > shape_.context)
    throw std::invalid_argument("char transformer: an input of " + std::to_string(length) +
                                " symbols, expected at most the context, " +
                                std::to_string(shape_.context));
  auto x = tokens_->forward(ids) + positions_->forward(torch::arange(length, ids.options()));
  const auto mask = mask_.narrow(0, 0, length).narrow(1, 0, length);
  for (auto& block : blocks_) x = block->forward(x, mask);
  return torch::log_softmax(head_->forward(norm_->forward(x)), -1);
}

CharLstmImpl::CharLstmImpl(const CharModelShape& shape) {
  if (shape.vocab < 2 || shape.dim < 1 || shape.layers < 1)
    throw std::invalid_argument(
        "char lstm: vocab " + std::to_string(shape.vocab) + ", dim " + std::to_string(shape.dim) +
        ", layers " + std::to_string(shape.layers) + ": expected vocab >= 2 and the others >= 1");
  tokens_ = register_module("tokens", torch::nn::Embedding(shape.vocab, shape.dim));
  lstm_ = register_module(
      "lstm",
      torch::nn::LSTM(
          torch::nn::LSTMOptions(shape.dim, shape.dim).num_layers(shape.layers).batch_first(true)));
  head_ = register_module("head", torch::nn::Linear(shape.dim, shape.vocab));
}

torch::Tensor CharLstmImpl::forward(const torch::Tensor& ids) {
  auto out = std::get<0>(lstm_->forward(tokens_->forward(ids)));
  return torch::log_softmax(head_->forward(out), -1);
}

}  // namespace troupe::examples
