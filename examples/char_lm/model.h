#pragma once
/// Character-level language models for examples/char_lm: a small decoder-only transformer (the
/// kind DiLoCo and its successors are judged on, scaled down to a CPU) and an LSTM. Both take
/// symbol ids int64 [batch, length] and return log-probabilities [batch, length, vocab] of the
/// next symbol at every position, seeing only the positions up to it.
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace troupe::examples {

struct CharModelShape {
  int64_t vocab = 0;
  int64_t context = 64;  // the longest input the transformer's position table covers
  int64_t dim = 128;
  int64_t layers = 2;
  int64_t heads = 4;  // transformer only; divides dim
};

/// One pre-norm transformer block: causal multi-head self-attention, then a 4x MLP with GELU, each
/// added to the residual stream.
class CharBlockImpl : public torch::nn::Module {
 public:
  CharBlockImpl(int64_t dim, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);

 private:
  int64_t heads_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(CharBlock);

/// Token and learned position embeddings, `layers` blocks, a final LayerNorm and a linear head.
/// Throws std::invalid_argument for a shape it cannot build (vocab < 2, heads not dividing dim)
/// and for inputs longer than `context`.
class CharTransformerImpl : public torch::nn::Module {
 public:
  explicit CharTransformerImpl(const CharModelShape& shape);
  torch::Tensor forward(const torch::Tensor& ids);

 private:
  CharModelShape shape_;
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
  std::vector<CharBlock> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};
  torch::Tensor mask_;  // additive causal mask [context, context]; not a buffer (nothing to sync)
};
TORCH_MODULE(CharTransformer);

/// Embedding, a `layers`-deep LSTM of width `dim`, and a linear head.
class CharLstmImpl : public torch::nn::Module {
 public:
  explicit CharLstmImpl(const CharModelShape& shape);
  torch::Tensor forward(const torch::Tensor& ids);

 private:
  torch::nn::Embedding tokens_{nullptr};
  torch::nn::LSTM lstm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(CharLstm);

}  // namespace troupe::examples
