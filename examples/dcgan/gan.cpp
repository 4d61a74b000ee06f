#include "dcgan/gan.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <troupe/distributed_module.h>

namespace troupe::examples::dcgan {

GeneratorImpl::GeneratorImpl(int64_t noise_size, int64_t channels) : channels_(channels) {
  fc_ = register_module("fc", torch::nn::Linear(noise_size, 2 * channels * 7 * 7));
  bn0_ = register_module("bn0", torch::nn::BatchNorm1d(2 * channels * 7 * 7));
  up1_ = register_module(
      "up1", torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(2 * channels, channels, 4)
                                            .stride(2)
                                            .padding(1)
                                            .bias(false)));
  bn1_ = register_module("bn1", torch::nn::BatchNorm2d(channels));
  up2_ = register_module(
      "up2", torch::nn::ConvTranspose2d(
                 torch::nn::ConvTranspose2dOptions(channels, 1, 4).stride(2).padding(1)));
}

torch::Tensor GeneratorImpl::forward(const torch::Tensor& noise) {
  auto x = torch::relu(bn0_(fc_(noise))).view({-1, 2 * channels_, 7, 7});
  x = torch::relu(bn1_(up1_(x)));
  return torch::tanh(up2_(x));
}

DiscriminatorImpl::DiscriminatorImpl(int64_t channels) {
  conv1_ = register_module(
      "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, channels, 4).stride(2).padding(1)));
  conv2_ = register_module(
      "conv2",
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(channels, 2 * channels, 4).stride(2).padding(1).bias(false)));
  bn2_ = register_module("bn2", torch::nn::BatchNorm2d(2 * channels));
  fc_ = register_module("fc", torch::nn::Linear(2 * channels * 7 * 7, 1));
}

torch::Tensor DiscriminatorImpl::forward(const torch::Tensor& images) {
  auto x = torch::leaky_relu(conv1_(images), 0.2);
  x = torch::leaky_relu(bn2_(conv2_(x)), 0.2);
  return torch::sigmoid(fc_(x.flatten(1))).squeeze(1);
}

torch::Tensor noise_batch(const GanOptions& options, int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      options.seed * 1000003 + static_cast<uint64_t>(step) * 1009 + static_cast<uint64_t>(rank));
  return torch::randn({options.batch, options.noise_size}, gen);
}

torch::Tensor real_batch(const torch::Tensor& images, const GanOptions& options, int step, int rank,
                         int world) {
  const int64_t n = images.size(0);
  const int64_t first = ((static_cast<int64_t>(step) * world + rank) * options.batch) % n;
  auto rows = torch::arange(first, first + options.batch, torch::kInt64).remainder(n);
  return images.index_select(0, rows);
}

std::vector<StepLosses> train(Runtime& rt, Generator& generator, Discriminator& discriminator,
                              const torch::Tensor& images, const GanOptions& options) {
  // What the wrapping adds to pytorch/examples' loop: these lines and the two step() calls. The
  // names are what errors call the modules.
  DdpOptions g_options, d_options;
  g_options.name = "generator";
  d_options.name = "discriminator";
  DistributedModule ddp_g(rt, generator, GradientAllReduce{}, g_options);
  DistributedModule ddp_d(rt, discriminator, GradientAllReduce{}, d_options);
  const auto adam = torch::optim::AdamOptions(options.lr).betas({options.beta1, 0.999});
  torch::optim::Adam g_optimizer(generator->parameters(), adam);
  torch::optim::Adam d_optimizer(discriminator->parameters(), adam);
  const auto real_labels = torch::full({options.batch}, 0.9);  // one-sided label smoothing
  const auto fake_labels = torch::zeros({options.batch});
  std::vector<StepLosses> losses;
  for (int step = 0; step < options.steps; ++step) {
    auto real = real_batch(images, options, step, rt.rank(), rt.world_size());
    auto noise = noise_batch(options, step, rt.rank());

    // The discriminator: one backward pass on real images, one on fake ones, then its step.
    discriminator->zero_grad();
    auto d_loss_real = torch::binary_cross_entropy(discriminator->forward(real), real_labels);
    d_loss_real.backward();
    auto fake = generator->forward(noise);
    auto d_loss_fake =
        torch::binary_cross_entropy(discriminator->forward(fake.detach()), fake_labels);
    d_loss_fake.backward();
    ddp_d.step(d_optimizer);

    // The generator: its backward passes through the discriminator (whose gradients are
    // zeroed before they are used).
    generator->zero_grad();
    auto g_loss =
        torch::binary_cross_entropy(discriminator->forward(fake), torch::ones({options.batch}));
    g_loss.backward();
    ddp_g.step(g_optimizer);
    losses.push_back(
        {d_loss_real.item<double>() + d_loss_fake.item<double>(), g_loss.item<double>()});
  }
  return losses;
}

}  // namespace troupe::examples::dcgan
