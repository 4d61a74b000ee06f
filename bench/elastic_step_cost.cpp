// What elasticity costs a step: the step time of the Fashion-MNIST example's models through a
// plain DistributedModule and through an ElasticTrainer (which also keeps a copy of the
// algorithm's state at the end of each step, elastic/elastic.h), in alternating blocks of the same
// run, and the ratio. One rank, no communication, so the difference is the trainer's own work;
// batch 64 (one rank's share of the example's global batch of 256 on 4 ranks). Also the time of
// the copy itself as ElasticTrainer takes it each step (DistributedModule::save_state of all the
// state and of its shared part, into strings kept from step to step), median of 200. Then the
// gossip driver's cost: the caller's state serialised after each step (ElasticState::save).
//   build/bin/bench_elastic_step_cost [STEPS PER BLOCK] [ROUNDS] [ONLY: rows whose model or
//   algorithm contains this]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench/one_rank.h"
#include "ddp/distributed_module.h"
#include "elastic/elastic.h"
#include "examples/fashion_mnist/models.h"
#include "rank/runtime.h"

using namespace troupe;

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Case {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> model;
};

// Milliseconds per step over `steps` steps after `warmup` more, through `step` (one whole step).
double block(const std::function<void()>& step, int steps, int warmup) {
  for (int i = 0; i < warmup; ++i) step();
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
}

void measure(Runtime& rt, const Case& c, const std::string& algorithm_name,
             const Algorithm& algorithm, int steps, int rounds) {
  auto module = c.model();
  torch::optim::SGD sgd(module->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  auto forward_backward = [&] {
    sgd.zero_grad();
    torch::Tensor out;
    if (auto* mlp = module->as<examples::MlpNetImpl>())
      out = mlp->forward(x);
    else
      out = module->as<examples::CnnNetImpl>()->forward(x);
    torch::nll_loss(out, y).backward();
  };
  DdpOptions options;
  options.shared_memory = false;  // as ElasticTrainer has it
  std::vector<double> plain, elastic;
  for (int r = 0; r < rounds; ++r) {
    {
      DistributedModule ddp(rt, module, algorithm, options);
      plain.push_back(block([&] { forward_backward(), ddp.step(sgd); }, steps, 5));
    }
    {
      ElasticTrainer trainer(rt, module, sgd, algorithm, options);
      elastic.push_back(block([&] { trainer.step(forward_backward); }, steps, 5));
    }
  }
  // The copy alone, between steps of a module that stepped.
  std::vector<double> copy;
  size_t bytes = 0;
  {
    DistributedModule ddp(rt, module, algorithm, options);
    for (int i = 0; i < 5; ++i) forward_backward(), ddp.step(sgd);
    std::string all, shared;
    for (int i = 0; i < 200; ++i) {
      auto start = Clock::now();
      all.clear();
      shared.clear();
      comm::StateWriter all_out(all), shared_out(shared);
      ddp.save_state(all_out, StatePart::all);
      ddp.save_state(shared_out, StatePart::shared);
      copy.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      bytes = all.size() + shared.size();
    }
  }
  int64_t params = 0;
  for (auto& p : module->parameters()) params += p.numel();
  const double p = median(plain), e = median(elastic);
  std::printf("| %s | %s | %lld | %.3f | %.3f | %+.3f | %.3f | %.2f | %.0f |\n", c.name.c_str(),
              algorithm_name.c_str(), static_cast<long long>(params), p, e, e - p, e / p,
              static_cast<double>(bytes) / 1e6, median(copy));
  std::fflush(stdout);
}

// The gossip and Choco-SGD driver's own cost (elastic/elastic.cpp, GossipDriver): after each
// completed step the trainer serialises the caller's state (ElasticState: parameters, buffers,
// the SGD optimizer's momentum; torch::serialize into a string), median of 200 after 5 steps,
// against the median of 200 local steps (forward, backward, SGD) of the same model and batch.
void measure_caller_state(const Case& c) {
  auto module = c.model();
  torch::optim::SGD sgd(module->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  auto step = [&] {
    sgd.zero_grad();
    torch::Tensor out;
    if (auto* mlp = module->as<examples::MlpNetImpl>())
      out = mlp->forward(x);
    else
      out = module->as<examples::CnnNetImpl>()->forward(x);
    torch::nll_loss(out, y).backward();
    sgd.step();
  };
  const ElasticState state = module_state(module, sgd);
  for (int i = 0; i < 5; ++i) step();
  std::vector<double> steps, saves;
  size_t bytes = 0;
  for (int i = 0; i < 200; ++i) {
    auto start = Clock::now();
    step();
    steps.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    start = Clock::now();
    bytes = state.save().size();
    saves.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  const double s = median(steps), save = median(saves);
  std::printf("| %s | %.2f | %.0f | %.3f | %.1f%% |\n", c.name.c_str(),
              static_cast<double>(bytes) / 1e6, save, s, 100 * save / 1000 / s);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 100;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  const std::string only = argc > 3 ? argv[3] : "";
  torch::set_num_threads(1);
  torch::manual_seed(1);
  Runtime rt(bench::one_rank_options());
  comm::Sparsification topk;
  topk.ratio = 0.01;
  topk.momentum = 0.9;  // error feedback and momentum correction: twice the parameters of state
  comm::PowerSGD power;
  power.rank = 2;
  power.start_iter = 2;
  std::printf("step time, median of %d blocks of %d steps each, plain and elastic alternating\n\n",
              rounds, steps);
  std::printf(
      "| model | algorithm | parameters | plain ms/step | elastic ms/step | difference ms "
      "| elastic/plain | state MB | copy us/step |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const std::vector<Case> cases = {{"MLP 784-256-10",
                                    [] {
                                      return examples::MlpNet({784, 256, 10}).ptr();
                                    }},
                                   {"CNN", [] { return examples::CnnNet().ptr(); }}};
  const std::vector<std::pair<std::string, Algorithm>> algorithms = {
      {"top-k 1% + EF + momentum correction", topk}, {"PowerSGD rank 2 + EF", power}};
  for (const auto& c : cases)
    for (const auto& [name, algorithm] : algorithms)
      if ((c.name + " " + name).find(only) != std::string::npos)
        measure(rt, c, name, algorithm, steps, rounds);
  std::printf(
      "\ngossip (D-PSGD, Choco-SGD): the caller's state serialised after each step, "
      "median of 200, against a local step of batch 64\n\n");
  std::printf(
      "| model | state MB | serialise us/step | local step ms | serialise/step |\n"
      "|---|---:|---:|---:|---:|\n");
  for (const auto& c : cases)
    if ((c.name + " caller state").find(only) != std::string::npos) measure_caller_state(c);
  return 0;
}
