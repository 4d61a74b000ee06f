// dcgan: a GAN trained data-parallel with the training loop of pytorch/examples' cpp/dcgan
// (several backward passes per step, two modules, two optimizers, BatchNorm). Run it under a
// launcher: `troupe launch -n 2 build/bin/dcgan --steps 200`, or torchrun.
#include <torch/torch.h>
#include <troupe/runtime.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>

#include "dcgan/gan.h"
#include "fashion_mnist/dataset.h"

using namespace troupe::examples;

int main(int argc, char** argv) {
  dcgan::GanOptions options;
  std::string data = "/usr/share/datasets/fashion-mnist";
  CLI::App app{"DCGAN on Fashion-MNIST (random images where the set is missing)"};
  app.add_option("--steps", options.steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", options.batch, "images per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--data", data, "directory of Fashion-MNIST's *-ubyte.gz files");
  CLI11_PARSE(app, argc, argv);
  try {
    troupe::Runtime rt;
    torch::manual_seed(0);  // the initial weights: rank 0's become everyone's
    dcgan::Generator generator(options.noise_size, options.channels);
    dcgan::Discriminator discriminator(options.channels);
    torch::Tensor images;
    if (std::filesystem::exists(data + "/train-images-idx3-ubyte.gz")) {
      // The loader normalises to mean 0, std 1; the generator's tanh draws in [-1, 1].
      images = (load_fashion_mnist(data, "train").images * 0.3530 + 0.2860) * 2 - 1;
    } else {
      std::printf("no Fashion-MNIST in %s: random images\n", data.c_str());
      images = torch::rand({1024, 1, 28, 28}) * 2 - 1;
    }
    auto losses = dcgan::train(rt, generator, discriminator, images, options);
    for (size_t s = 0; s < losses.size(); ++s)
      if (rt.rank() == 0 && (s % 10 == 0 || s + 1 == losses.size()))
        std::printf("step %zu: discriminator loss %.4f, generator loss %.4f\n", s,
                    losses[s].discriminator, losses[s].generator);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcgan: %s\n", e.what());
    return 1;
  }
}
