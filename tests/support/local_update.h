#pragma once
// Test support for the local-update algorithms' tests (tests/runtime/local_update/): a small net
// (flat_params.h gives its parameters as one flat tensor), the inner optimizers and each rank's
// batches, so a test can run a module on thread ranks and a simulation of W replicas from the same
// start; the checkpoint harness (straight, resumed, state lost) and the catchers of the errors a
// test expects.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "algorithms/registry.h"
#include "comm/state.h"
#include "tests/support/flat_params.h"
#include "tests/support/thread_ranks.h"
#include "tools/job_config.h"

namespace troupe::test {

/// Linear(6, width), Tanh, Linear(width, 3): 83 parameters at width 8.
inline torch::nn::Sequential make_net(int width = 8) {
  return torch::nn::Sequential(torch::nn::Linear(6, width), torch::nn::Tanh(),
                               torch::nn::Linear(width, 3));
}

using Inner = std::unique_ptr<torch::optim::Optimizer>;

/// The inner optimizer: AdamW(0.01, weight decay 0.01), or SGD(0.05, momentum 0.5).
inline Inner make_inner(torch::nn::Module& m, bool adamw) {
  if (adamw)
    return std::make_unique<torch::optim::AdamW>(
        m.parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.01));
  return std::make_unique<torch::optim::SGD>(m.parameters(),
                                             torch::optim::SGDOptions(0.05).momentum(0.5));
}

/// SGD(0.05) without momentum: an inner optimizer without state, so that all a checkpoint needs
/// is the module's.
inline Inner make_plain_sgd(torch::nn::Module& m) {
  return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05));
}

/// How a rank makes its inner optimizer.
using InnerFactory = std::function<Inner(torch::nn::Module&)>;

/// make_inner(m, adamw) as a factory.
inline InnerFactory inner_of(bool adamw) {
  return [adamw](torch::nn::Module& m) { return make_inner(m, adamw); };
}

using Batch = std::pair<torch::Tensor, torch::Tensor>;

/// Random regression batches of 4 rows, the same for a given seed: data[rank][step].
struct Batches {
  std::vector<std::vector<Batch>> data;
  Batches(int world, int steps, uint64_t seed = 17) {
    torch::manual_seed(seed);
    data.resize(static_cast<size_t>(world));
    for (auto& rank : data)
      for (int s = 0; s < steps; ++s) rank.emplace_back(torch::randn({4, 6}), torch::randn({4, 3}));
  }
  const Batch& at(int rank, int step) const {
    return data[static_cast<size_t>(rank)][static_cast<size_t>(step)];
  }
};

/// The gradients of one batch's MSE loss (the caller's module steps the optimizer).
inline void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt,
                       const Batch& batch) {
  opt.zero_grad();
  torch::mse_loss(net->forward(batch.first), batch.second).backward();
}

/// The gradients of a loss whose input depends on the rank (ones times rank + 1), so that the
/// ranks' local steps differ.
inline void rank_gradients(torch::nn::Sequential& net, torch::optim::Optimizer& opt, int rank) {
  opt.zero_grad();
  torch::mse_loss(net->forward(torch::ones({2, 6}) * (rank + 1)), torch::zeros({2, 3})).backward();
}

/// Rank 0's copy of `t` (a collective: every rank calls it with a tensor of the same size).
inline torch::Tensor rank0_copy(Runtime& rt, const torch::Tensor& t) {
  auto copy = t.clone();
  rt.comm().broadcast(copy.data_ptr<float>(), static_cast<size_t>(copy.numel()),
                      comm::DataType::float32, 0);
  return copy;
}

/// What each thread rank of a run ended with.
struct RankRuns {
  std::vector<torch::Tensor> weights;
  std::vector<CommStats> stats;
  std::vector<int64_t> outer_steps;
};

/// Module(rt, net, config) on `world` thread ranks, each net from `init` (when defined; else
/// rank 0's own start, which the module broadcasts) and `steps` steps of its rank's batches;
/// `after(rank, module)` then reads what else the test needs.
template <class Module, class Config>
RankRuns run_on_ranks(const torch::Tensor& init, const Batches& b, int world, int steps,
                      const Config& c, const InnerFactory& inner, int width = 8,
                      const std::function<void(int, Module&)>& after = nullptr) {
  const auto W = static_cast<size_t>(world);
  RankRuns out;
  out.weights.resize(W);
  out.stats.resize(W);
  out.outer_steps.resize(W);
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = make_net(width);
    if (init.defined()) load_flat(*net, init);
    Module dp(rt, net.ptr(), c);
    auto opt = inner(*net);
    for (int s = 0; s < steps; ++s) {
      train_step(net, *opt, b.at(rank, s));
      dp.step(*opt);
    }
    const auto r = static_cast<size_t>(rank);
    out.weights[r] = flat_of(*net).clone();
    out.stats[r] = dp.stats();
    out.outer_steps[r] = dp.outer_steps();
    if (after) after(rank, dp);
  });
  for (auto& e : errors) REQUIRE(e.empty());
  return out;
}

/// The checkpoint harness: Module on `world` thread ranks from `init`, with a stateless inner
/// SGD, run three ways: straight through `steps`; stopped after `stop`, saved, rebuilt fresh (new
/// weights, new module, only what was saved carries over) and resumed from the state; rebuilt
/// the same way without the state. Checks on every rank that the resumed run ends bit-identical
/// to the straight one and that the run without the state does not (the state mattered).
template <class Module, class Config>
void check_resume(const torch::Tensor& init, const Batches& b, int world, int steps, int stop,
                  const Config& c) {
  const auto W = static_cast<size_t>(world);
  std::vector<torch::Tensor> straight(W), resumed(W), dropped(W);
  for (int mode = 0; mode < 3; ++mode) {  // 0: straight through; 1: resumed; 2: state lost
    auto errors = run_threads(world, [&](int rank, Runtime& rt) {
      auto net = make_net();
      load_flat(*net, init);
      auto dp = std::make_unique<Module>(rt, net.ptr(), c);
      auto opt = make_plain_sgd(*net);
      int s = 0;
      for (; s < (mode == 0 ? steps : stop); ++s) {
        train_step(net, *opt, b.at(rank, s));
        dp->step(*opt);
      }
      if (mode > 0) {
        std::string state;
        comm::StateWriter out(state);
        dp->save_state(out);
        const auto weights = flat_of(*net).clone();
        dp.reset();
        net = make_net();
        dp = std::make_unique<Module>(rt, net.ptr(), c);
        opt = make_plain_sgd(*net);
        load_flat(*net, weights);
        if (mode == 1) {
          comm::StateReader in(state, dp->algorithm_name() + "'s state");
          dp->load_state(in);
        }
        for (; s < steps; ++s) {
          train_step(net, *opt, b.at(rank, s));
          dp->step(*opt);
        }
      }
      auto& out = mode == 0 ? straight : mode == 1 ? resumed : dropped;
      out[static_cast<size_t>(rank)] = flat_of(*net).clone();
    });
    for (auto& e : errors) REQUIRE(e.empty());
  }
  for (size_t r = 0; r < W; ++r) {
    CAPTURE(r);
    CHECK(torch::equal(resumed[r], straight[r]));
    CHECK(!torch::equal(dropped[r], straight[r]));
  }
}

/// What Module(rt, net, config) throws (comm::Error's message), or "" when it is built.
template <class Module, class Config>
std::string settings_error(Runtime& rt, torch::nn::Sequential& net, const Config& c) {
  try {
    Module dp(rt, net.ptr(), c);
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

/// What loading a state saved by Module under `saved` into one built with `loaded` throws, or ""
/// when it is taken.
template <class Module, class Config>
std::string load_error(Runtime& rt, torch::nn::Sequential& net, const Config& saved,
                       const Config& loaded) {
  Module saver(rt, net.ptr(), saved);
  std::string state;
  comm::StateWriter out(state);
  saver.save_state(out);
  Module loader(rt, net.ptr(), loaded);
  comm::StateReader in(state, "the state");
  try {
    loader.load_state(in);
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

/// What parse_algorithm_argument(text) throws, or "".
inline std::string algorithm_error(const std::string& text) {
  try {
    parse_algorithm_argument(text);
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

/// A job file `file` of 2 ranks whose [algorithm] is `name` with `settings` (TOML lines), parsed.
inline JobConfig job_of(const std::string& name, const std::string& settings,
                        const std::string& file = "job.toml") {
  return parse_job_config(
      "[job]\nworld_size = 2\n[algorithm]\nname = \"" + name + "\"\n" + settings, file);
}

/// What job_of throws for the job file "bad.toml", or "".
inline std::string job_error(const std::string& name, const std::string& settings) {
  try {
    job_of(name, settings, "bad.toml");
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "";
}

/// make_data_parallel(config) on 2 thread ranks, each taking two steps of SGD(0.1) on
/// rank_gradients; then check(runtime, net, module) asserts what the test expects.
template <class Config>
void run_two_steps(
    const Config& c,
    const std::function<void(Runtime&, torch::nn::Sequential&, DataParallel&)>& check) {
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    auto net = make_net();
    auto dp = make_data_parallel(rt, net.ptr(), c);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      rank_gradients(net, opt, rt.rank());
      dp->step(opt);
    }
    check(rt, net, *dp);
  });
  for (auto& e : errors) CHECK(e.empty());
}

}  // namespace troupe::test
