// Misuse that used to train silently wrong: a module wrapped by two live data-parallel wrappers
// (two sets of gradient hooks, or gossip moving the weights under the buckets), and, with join,
// two backward passes before one step (the second gradient would land in buckets already
// reduced). Both are refused with an error naming the module or the parameter.
#include "tests/support/torch_doctest.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algorithms/gossip/decentralized.h"
#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "tests/support/ddp_reference.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

using test::Mlp;
using test::run_threads;

void train_step(DistributedModule& ddp, Mlp& model, torch::optim::Optimizer& opt, int rank) {
  opt.zero_grad();
  torch::mse_loss(model.forward(torch::ones({2, 6}) * (rank + 1)), torch::zeros({2, 3})).backward();
  ddp.step(opt);
}

}  // namespace

TEST_CASE(
    "a second DistributedModule over a live one's module is refused, naming the module and a "
    "parameter") {
  torch::set_num_threads(1);
  std::vector<torch::Tensor> after(2);
  // Two thread ranks, each with its own model object: those never collide.
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    std::optional<DistributedModule> first;
    first.emplace(rt, model);
    CHECK_THROWS_WITH_AS(DistributedModule(rt, model),
                         doctest::Contains("DistributedModule: module troupe::test::Mlp (parameter "
                                           "'fc1.weight') is already wrapped by a live "
                                           "DistributedModule"),
                         comm::Error);
    // A submodule shares its parameters with the wrapped module.
    CHECK_THROWS_WITH_AS(DistributedModule(rt, model->fc2.ptr()),
                         doctest::Contains("(parameter 'weight') is already wrapped by a live "
                                           "DistributedModule of module troupe::test::Mlp"),
                         comm::Error);
    train_step(*first, *model, opt, r);  // the refused wrappers left the first one working
    first.reset();
    DistributedModule again(rt, model);  // the module is free once its wrapper is gone
    train_step(again, *model, opt, r);
    after[static_cast<size_t>(r)] = model->fc1->weight.clone();
  });
  for (auto& e : errors) CHECK(e == "");
  CHECK(torch::equal(after[0], after[1]));
}

TEST_CASE("gossip wrappers and DistributedModule refuse a module another of them wraps") {
  torch::set_num_threads(1);
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    {
      DistributedModule ddp(rt, model);
      CHECK_THROWS_WITH_AS(
          DecentralizedModule(rt, model, Decentralized{}),
          doctest::Contains("DecentralizedModule: module troupe::test::Mlp (parameter "
                            "'fc1.weight') is already wrapped by a live "
                            "DistributedModule"),
          comm::Error);
      CHECK_THROWS_WITH_AS(
          AsynchronousModule(rt, model, AsyncModelAverage{}),
          doctest::Contains("AsynchronousModule: module troupe::test::Mlp (parameter "
                            "'fc1.weight') is already wrapped by a live "
                            "DistributedModule"),
          comm::Error);
    }
    {
      DecentralizedModule gossip(rt, model, Decentralized{});
      CHECK_THROWS_WITH_AS(DistributedModule(rt, model),
                           doctest::Contains("is already wrapped by a live DecentralizedModule"),
                           comm::Error);
    }
    {
      AsynchronousModule averaging(rt, model, AsyncModelAverage{});
      CHECK_THROWS_WITH_AS(DecentralizedModule(rt, model, Decentralized{}),
                           doctest::Contains("is already wrapped by a live AsynchronousModule"),
                           comm::Error);
    }
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE(
    "with join, two backward passes before a step throw from backward naming the parameter and the "
    "remedy") {
  // Without join each backward pass is reduced when it ends
  // (tests/runtime/several_backward_test.cpp); with join the ranks meet in step(), which a joined
  // rank shadows once per step.
  torch::set_num_threads(1);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.join = true;
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    train_step(ddp, *model, opt, r);
    opt.zero_grad();
    auto x = torch::ones({2, 6}) * (r + 1);
    torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
    auto second = torch::mse_loss(model->forward(x), torch::zeros({2, 3}));
    CHECK_THROWS_WITH_AS(second.backward(),
                         doctest::Contains("step 1: the gradient of parameter 'fc3."), comm::Error);
    CHECK_THROWS_WITH_AS(
        torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward(),
        doctest::Contains("of module 'troupe::test::Mlp' became ready twice before step(): with "
                          "DdpOptions.join a step takes one backward pass (expected step() after "
                          "each backward, or the earlier backward passes inside no_sync() to "
                          "accumulate gradients)"),
        comm::Error);
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE(
    "backward passes inside no_sync, or before a local step with agg_grad off, are not refused") {
  torch::set_num_threads(1);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto x = torch::ones({2, 6}) * (r + 1);
    {
      auto model = std::make_shared<Mlp>(6, 8, 3);
      torch::optim::SGD opt(model->parameters(), 0.1);
      DistributedModule ddp(rt, model);
      {
        auto guard = ddp.no_sync();
        torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
        torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
      }
      torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
      ddp.step(opt);
    }
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.agg_grad = false;  // gradients stay local: accumulating them is the user's business
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
    torch::mse_loss(model->forward(x), torch::zeros({2, 3})).backward();
    ddp.step(opt);
  });
  for (auto& e : errors) CHECK(e == "");
}
