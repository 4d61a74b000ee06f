// Data-parallel training of Fashion-MNIST with troupe::DistributedModule, one rank per process:
//   build/bin/troupe launch -n 4 -- build/bin/fashion_mnist --epochs 1
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "examples/fashion_mnist/dataset.h"
#include "examples/fashion_mnist/models.h"
#include "runtime/distributed_module.h"

using namespace troupe;

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST, data parallel over troupe"};
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string model_name = "cnn";
  int epochs = 1, batch = 64, log_every = 100, threads = 1;
  double lr = 0.05, momentum = 0.9;
  uint64_t seed = 42;
  DdpOptions ddp_options;
  std::string algorithm = "allreduce";
  app.add_option("--data", data_dir, "Folder with the four *-ubyte.gz files");
  app.add_option("--model", model_name, "cnn or mlp")->check(CLI::IsMember({"cnn", "mlp"}));
  app.add_option("--epochs", epochs, "Epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "Batch per rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "SGD learning rate")->check(CLI::PositiveNumber);
  app.add_option("--momentum", momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  app.add_option("--log-every", log_every, "Steps between progress lines")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "Seed of the shards and the batch order");
  app.add_option("--algorithm", algorithm,
                 "allreduce, fp16, bf16, bytegrad, sign, sign-vote, topk, randomk, blockk or "
                 "powersgd, with settings: powersgd:rank=2,start_iter=10 or topk:ratio=0.01");
  app.add_flag("--delay-reduce", ddp_options.delay_reduce, "Reduce after backward (no overlap)");
  app.add_option("--trace", ddp_options.trace_path,
                 "Write a Chrome trace per rank here ({rank} is replaced)");
  CLI11_PARSE(app, argc, argv);

  try {
    torch::set_num_threads(threads);
    torch::manual_seed(static_cast<uint64_t>(seed));
    Runtime rt;
    const int rank = rt.rank(), world = rt.world_size();
    auto train = examples::shard(examples::load_fashion_mnist(data_dir, "train"), rank, world, seed);
    auto test = examples::load_fashion_mnist(data_dir, "test");

    std::shared_ptr<torch::nn::Module> module;
    examples::Forward forward;
    if (model_name == "cnn") {
      examples::CnnNet net;
      module = net.ptr();
      forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
    } else {
      examples::MlpNet net({784, 256, 10});
      module = net.ptr();
      forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
    }
    torch::optim::SGD opt(module->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
    DistributedModule ddp(rt, module, comm::parse_compression(algorithm), ddp_options);
    if (rank == 0)
      std::printf("fashion_mnist: %s, %s, %d rank(s), %lld training images per rank, batch %d "
                  "per rank, %zu bucket(s)\n",
                  model_name.c_str(), ddp.algorithm_name().c_str(), world,
                  static_cast<long long>(examples::size(train)), batch, ddp.bucket_count());

    examples::BatchIterator batches(train, batch, seed);
    int64_t step = 0;
    size_t sent = 0;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      batches.begin(epoch);
      torch::Tensor x, y;
      auto window_start = std::chrono::steady_clock::now();
      int64_t window_images = 0;
      double window_loss = 0;
      while (batches.next(x, y)) {
        opt.zero_grad();
        auto loss = torch::nll_loss(forward(x), y);
        loss.backward();
        ddp.step(opt);
        sent += ddp.last_step().bytes_sent;
        window_images += batch;
        window_loss += loss.item<double>();
        if (++step % log_every == 0 && rank == 0) {
          double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                     window_start)
                           .count();
          std::printf("epoch %d step %lld loss %.4f images/s %.0f MB sent %.1f\n", epoch + 1,
                      static_cast<long long>(step), window_loss / log_every,
                      window_images * world / sec, static_cast<double>(sent) / 1e6);
          std::fflush(stdout);
          window_start = std::chrono::steady_clock::now();
          window_images = 0;
          window_loss = 0;
        }
      }
      if (rank == 0) {
        double acc = examples::accuracy(*module, forward, test);
        std::printf("epoch %d test accuracy %.2f%% bytes sent per step %.0f (last step %zu)\n",
                    epoch + 1, acc * 100,
                    step ? static_cast<double>(sent) / static_cast<double>(step) : 0.0,
                    ddp.last_step().bytes_sent);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "fashion_mnist: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
