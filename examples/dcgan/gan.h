#pragma once
/// DCGAN on troupe: pytorch/examples' cpp/dcgan training loop (generator and discriminator, each
/// with BatchNorm and its own Adam) with only the data-parallel wrapping added. The
/// discriminator takes two backward passes per step (real images, then fake ones) and the
/// generator's backward passes through the discriminator: each backward pass is averaged over
/// the ranks as PyTorch DDP averages it, no no_sync() needed. Sized for seconds on a CPU:
/// 28x28 images (Fashion-MNIST's), small channel counts.
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <troupe/runtime.h>

#include <cstdint>
#include <vector>

namespace troupe::examples::dcgan {

/// noise [N, noise_size] -> images [N, 1, 28, 28] in (-1, 1): a linear layer to 7x7 maps, then
/// two transposed convolutions (7 -> 14 -> 28), BatchNorm after each layer but the last.
class GeneratorImpl : public torch::nn::Module {
 public:
  GeneratorImpl(int64_t noise_size, int64_t channels);
  torch::Tensor forward(const torch::Tensor& noise);

 private:
  int64_t channels_;
  torch::nn::Linear fc_{nullptr};
  torch::nn::BatchNorm1d bn0_{nullptr};
  torch::nn::ConvTranspose2d up1_{nullptr}, up2_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr};
};
TORCH_MODULE(Generator);

/// images [N, 1, 28, 28] -> probability that each is real [N]: two strided convolutions
/// (28 -> 14 -> 7), BatchNorm after the second, a linear layer and a sigmoid.
class DiscriminatorImpl : public torch::nn::Module {
 public:
  explicit DiscriminatorImpl(int64_t channels);
  torch::Tensor forward(const torch::Tensor& images);

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::BatchNorm2d bn2_{nullptr};
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(Discriminator);

struct GanOptions {
  int64_t noise_size = 16;
  int64_t channels = 8;
  int64_t batch = 16;  // per rank
  int steps = 50;
  double lr = 2e-4;
  double beta1 = 0.5;
  uint64_t seed = 1;  // of the noise
};

/// Rank `rank`'s noise at step `step`: from a private generator seeded by (seed, step, rank), so a
/// reference can draw the same without touching torch's global generator.
torch::Tensor noise_batch(const GanOptions& options, int step, int rank);
/// Rank `rank`'s real images at step `step` out of `images` [N, 1, 28, 28] (in [-1, 1]): the
/// `batch` rows after those of the ranks before it, wrapping around the set.
torch::Tensor real_batch(const torch::Tensor& images, const GanOptions& options, int step, int rank,
                         int world);

struct StepLosses {
  double discriminator = 0;
  double generator = 0;
};

/// Trains `generator` and `discriminator` (rank 0's weights become everyone's) for
/// options.steps steps on this rank's batches of `images`; returns this rank's losses.
std::vector<StepLosses> train(Runtime& rt, Generator& generator, Discriminator& discriminator,
                              const torch::Tensor& images, const GanOptions& options);

}  // namespace troupe::examples::dcgan
