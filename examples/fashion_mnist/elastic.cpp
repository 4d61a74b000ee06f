// Elastic training of Fashion-MNIST: the whole training set is cut into global batches by an
// ElasticSampler, so whatever the world size after a rank dies or rejoins, step s trains on the
// same images; a false from ElasticTrainer::step means the world changed and the step is redone.
#include "fashion_mnist/elastic.h"

#include <torch/torch.h>
#include <troupe/checkpoint.h>
#include <troupe/elastic.h>

#include <chrono>
#include <cstdio>

#include "fashion_mnist/dataset.h"
#include "fashion_mnist/models.h"

namespace troupe::examples {

namespace {

long long unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ElasticData load_elastic_data(const std::string& dir, int64_t subset) {
  ElasticData data{load_fashion_mnist(dir, "train"), load_fashion_mnist(dir, "test")};
  if (subset > 0 && subset < size(data.train))
    data.train = {data.train.images.narrow(0, 0, subset), data.train.labels.narrow(0, 0, subset)};
  return data;
}

void train_elastic(Runtime& rt, const ElasticRun& run, const ElasticData& data) {
  const FashionMnist& train = data.train;
  const FashionMnist& test = data.test;
  std::shared_ptr<torch::nn::Module> module;
  Forward forward;
  torch::manual_seed(run.seed);
  if (run.model == "cnn") {
    CnnNet net;
    module = net.ptr();
    forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
  } else {
    MlpNet net({784, 256, 10});
    module = net.ptr();
    forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
  }
  torch::optim::SGD opt(module->parameters(),
                        torch::optim::SGDOptions(run.lr).momentum(run.momentum));
  ElasticTrainer trainer(rt, module, opt, run.algorithm, run.ddp);
  // The global batch is fixed by a whole world of the job (the launch's ranks), which every
  // member knows from its generation: not by the world this process first joined, which for a
  // restarted rank or a spare may be short of ranks (its batches would then differ from the
  // others', and so would its step count).
  const int64_t first_world = rt.elastic()                         ? rt.generation().ranks
                              : rt.rank_info().source == "default" ? 1
                                                                   : rt.rank_info().world_size;
  ElasticSampler sampler(size(train), run.batch * std::max<int64_t>(first_world, 1), run.seed);
  const int64_t steps = run.epochs * sampler.steps_per_epoch();
  if (rt.rank() == 0) {
    std::printf(
        "fashion_mnist: %s, %s, elastic, %d rank(s), %lld training images, global batch "
        "%lld\n",
        run.model.c_str(), trainer.algorithm_name().c_str(), rt.world_size(),
        static_cast<long long>(size(train)),
        static_cast<long long>(run.batch * std::max<int64_t>(first_world, 1)));
    std::fflush(stdout);
  }
  auto start = std::chrono::steady_clock::now();
  // A restarted rank, and every rank after a change of the world, says when it completes its
  // first step (bench/elastic_goodput.sh times recoveries from these lines).
  bool changed = rt.generation().number > 1;
  if (changed)
    std::printf("launch slot %d healed at step %lld\n", rt.slot(),
                static_cast<long long>(trainer.steps()));
  // A member that left would open a generation for those still stepping (the gossip and
  // asynchronous members step at their own pace): finish() waits for the others, re-forming
  // when the world changes meanwhile, and the loop goes on from the steps the job has then.
  for (;;) {
    while (trainer.steps() < steps) {
      const int64_t step = trainer.steps();
      auto mine = sampler.indices(step, rt.rank(), rt.world_size());
      auto index = torch::tensor(mine, torch::kLong);
      torch::Tensor loss;
      const bool done = trainer.step([&] {
        opt.zero_grad();
        loss = torch::nll_loss(forward(train.images.index({index})), train.labels.index({index}));
        loss.backward();
      });
      if (!done) {
        changed = true;
        std::printf(
            "rank %d (launch slot %d): the world changed, now %d ranks; redoing step "
            "%lld\n",
            rt.rank(), rt.slot(), rt.world_size(), static_cast<long long>(trainer.steps()));
        std::fflush(stdout);
        continue;
      }
      if (changed) {
        std::printf("launch slot %d stepping in generation %d at unix ms %lld\n", rt.slot(),
                    rt.generation().number, unix_ms());
        std::fflush(stdout);
        changed = false;
      }
      if (rt.rank() == 0 && trainer.steps() % run.log_every == 0) {
        std::printf("step %lld of %lld, %d ranks, loss %.4f\n",
                    static_cast<long long>(trainer.steps()), static_cast<long long>(steps),
                    rt.world_size(), loss.item<double>());
        std::fflush(stdout);
      }
      if (trainer.steps() % sampler.steps_per_epoch() == 0 && rt.rank() == 0) {
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf("epoch %lld test accuracy %.2f%% (%d ranks, %.1f s)\n",
                    static_cast<long long>(trainer.steps() / sampler.steps_per_epoch()),
                    accuracy(*module, forward, test) * 100, rt.world_size(), sec);
        std::fflush(stdout);
      }
    }
    if (trainer.finish()) break;
    changed = true;
    std::printf(
        "rank %d (launch slot %d): the world changed while it waited for the others' "
        "end, now %d ranks at step %lld\n",
        rt.rank(), rt.slot(), rt.world_size(), static_cast<long long>(trainer.steps()));
    std::fflush(stdout);
  }
  // Every member says it, so that the replicas' checksums can be compared.
  std::printf(
      "launch slot %d finished: %lld steps of %s, %d rank(s) in generation %d, "
      "parameter checksum %s\n",
      rt.slot(), static_cast<long long>(trainer.steps()), trainer.algorithm_name().c_str(),
      rt.world_size(), rt.generation().number, parameter_checksum(*module).c_str());
  std::fflush(stdout);
}

}  // namespace troupe::examples
