// Checkpoint cost: seconds to write (file, fsync, rename) and to read (read, SHA-256, checks,
// apply) one rank's checkpoint of the Fashion-MNIST example's models, and the file's size.
// The state: parameters, SGD's momentum buffers, torch's generator, and, in the "+ top-k EF" rows,
// a DistributedModule running top-k with error feedback and momentum correction (its residual
// and velocity: twice the parameters). One rank, no communication.
//   build/bin/bench_checkpoint [DIR] [REPEATS]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/one_rank.h"
#include "ddp/distributed_module.h"
#include "examples/fashion_mnist/models.h"
#include "rank/checkpoint.h"
#include "rank/runtime.h"

using namespace troupe;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void measure(Runtime& rt, const std::string& name, std::shared_ptr<torch::nn::Module> module,
             bool with_algorithm, const std::string& dir, int repeats) {
  std::unique_ptr<DistributedModule> ddp;
  if (with_algorithm) {
    comm::Sparsification topk;
    topk.ratio = 0.01;
    topk.momentum = 0.9;
    ddp = std::make_unique<DistributedModule>(rt, module, topk);
  }
  torch::optim::SGD sgd(module->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  // One step, so that the momentum buffers (and the algorithm's memories) exist.
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  sgd.zero_grad();
  auto forward = [&](const torch::Tensor& in) {
    if (auto* mlp = module->as<examples::MlpNetImpl>()) return mlp->forward(in);
    return module->as<examples::CnnNetImpl>()->forward(in);
  };
  torch::nll_loss(forward(x), y).backward();
  if (ddp) {
    ddp->step(sgd);
  } else {
    sgd.step();
  }
  Checkpoint checkpoint(rt);
  checkpoint.module(*module).optimizer(sgd).rng();
  if (ddp) checkpoint.algorithm(*ddp);
  std::vector<double> write, read;
  for (int i = 0; i < repeats; ++i) {
    write.push_back(seconds([&] { checkpoint.save(dir); }));
    read.push_back(seconds([&] { checkpoint.load(dir); }));
  }
  int64_t params = 0;
  for (auto& p : module->parameters()) params += p.numel();
  const auto bytes = std::filesystem::file_size(Checkpoint::file_of(dir, rt.rank()));
  std::printf("| %s%s | %lld | %.2f | %.4f | %.4f |\n", name.c_str(),
              with_algorithm ? " + top-k EF" : "", static_cast<long long>(params),
              static_cast<double>(bytes) / 1e6, median(write), median(read));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp/troupe-bench-checkpoint";
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  torch::set_num_threads(1);
  torch::manual_seed(1);
  Runtime rt(bench::one_rank_options());
  std::printf(
      "checkpoint of one rank in %s, median of %d (write: file + fsync + rename; read: "
      "read + SHA-256 + checks + apply)\n\n",
      dir.c_str(), repeats);
  std::printf("| model | parameters | file MB | write s | read s |\n|---|---|---|---|---|\n");
  for (bool algorithm : {false, true}) {
    measure(rt, "MLP 784-256-10", examples::MlpNet({784, 256, 10}).ptr(), algorithm, dir, repeats);
    measure(rt, "CNN", examples::CnnNet().ptr(), algorithm, dir, repeats);
    measure(rt, "MLP 784-2048-2048-1024-10", examples::MlpNet({784, 2048, 2048, 1024, 10}).ptr(),
            algorithm, dir, repeats);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
