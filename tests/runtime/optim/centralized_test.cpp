// CentralizedSGD, CentralizedAdam and CustomCentralizedOptimizer against one process written here
// with plain torch::optim: the concatenated batch (agg_grad), per-rank optimizers with averaged
// weights (!agg_grad), a clip and a denominator done by hand; and their argument checks. Ranks
// are threads over inproc.
#include "algorithms/optim/centralized.h"

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "comm/status.h"
#include "elastic/launch.h"
#include "tests/support/tensors.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

using test::clones;
using test::copy_params;
using test::max_diff;
using test::run_threads;

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.grad().detach().clone());
  return out;
}

// Inputs and targets whose gradients shrink over time (Adam's amsgrad then keeps older, larger
// second moments).
using Data = test::StepData;
Data make_data(int world, int steps, int64_t batch) {
  return test::make_step_data(world, steps, batch, 6, 3, /*shrinking=*/true);
}

}  // namespace

TEST_CASE(
    "CentralizedSGD and CentralizedAdam (amsgrad) on 1, 2 and 3 ranks match one process on the "
    "concatenated batch") {
  torch::set_num_threads(1);
  const int steps = 4;
  const int64_t batch = 3;
  for (int world : {1, 2, 3}) {
    for (bool adam : {false, true}) {
      CAPTURE(world);
      CAPTURE(adam);
      torch::manual_seed(11);
      std::vector<std::shared_ptr<Mlp>> replicas;
      for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
      auto reference = std::make_shared<Mlp>();
      copy_params(*replicas[0], *reference);  // rank 0's weights are broadcast to everyone
      const auto initial = clones(reference->parameters());
      auto data = make_data(world, steps, batch);

      auto train_reference = [&](bool amsgrad) {
        copy_params(*replicas[0], *reference);
        std::unique_ptr<torch::optim::Optimizer> opt;
        if (adam)
          opt = std::make_unique<torch::optim::Adam>(reference->parameters(),
                                                     torch::optim::AdamOptions(0.05)
                                                         .betas({0.8, 0.9})
                                                         .weight_decay(0.01)
                                                         .amsgrad(amsgrad));
        else
          opt = std::make_unique<torch::optim::SGD>(
              reference->parameters(),
              torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01).nesterov(true));
        for (int s = 0; s < steps; ++s) {
          opt->zero_grad();
          torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
          opt->step();
        }
        return clones(reference->parameters());
      };
      const auto want = train_reference(true);
      if (adam) CHECK(max_diff(want, train_reference(false)) > 1e-4);  // amsgrad matters here

      std::vector<std::vector<torch::Tensor>> finals(world);
      auto errors = run_threads(world, [&](int r, Runtime& rt) {
        auto model = replicas[static_cast<size_t>(r)];
        std::unique_ptr<optim::CentralizedOptimizer> opt;
        if (adam)
          opt = std::make_unique<optim::CentralizedAdam>(rt, model,
                                                         optim::CentralizedAdamOptions(0.05)
                                                             .betas({0.8, 0.9})
                                                             .weight_decay(0.01)
                                                             .amsgrad(true));
        else
          opt = std::make_unique<optim::CentralizedSGD>(
              rt, model,
              optim::CentralizedSgdOptions(0.05).momentum(0.9).weight_decay(0.01).nesterov(true));
        CHECK(opt->module().algorithm_name() == "allreduce");
        for (int s = 0; s < steps; ++s) {
          opt->zero_grad();
          torch::mse_loss(model->forward(data.x(s, r)), data.y(s, r)).backward();
          opt->step();
        }
        finals[r] = clones(model->parameters());
      });
      for (auto& e : errors) CHECK(e == "");
      CHECK(max_diff(finals[0], want) < 1e-5);
      CHECK(max_diff(finals[0], initial) > 1e-2);
      for (int r = 1; r < world; ++r) CHECK(max_diff(finals[r], finals[0]) == 0);
    }
  }
}

TEST_CASE("grad_clip scales the averaged gradient to the clip when its global L2 norm exceeds it") {
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  const int64_t batch = 4;
  const double lr = 0.1, clip = 0.05;
  torch::manual_seed(12);
  std::vector<std::shared_ptr<Mlp>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
  auto reference = std::make_shared<Mlp>();
  copy_params(*replicas[0], *reference);
  auto data = make_data(world, steps, batch);
  // Clip by hand: g * clip / (||g|| + 1e-6) over all gradients of the concatenated batch.
  auto want = clones(reference->parameters());
  std::vector<double> norms;
  for (int s = 0; s < steps; ++s) {
    reference->zero_grad();
    torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
    auto grads = grads_of(*reference);
    double squares = 0;
    for (auto& g : grads) squares += g.pow(2).sum().item<double>();
    const double norm = std::sqrt(squares);
    norms.push_back(norm);
    REQUIRE(norm > clip);  // every step is clipped
    torch::NoGradGuard no_grad;
    auto ps = reference->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      want[i] = want[i] - lr * grads[i] * (clip / (norm + 1e-6));
      ps[i].copy_(want[i]);
    }
  }
  std::vector<std::vector<torch::Tensor>> finals(world);
  std::vector<std::vector<double>> seen(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    optim::CentralizedSGD opt(rt, model, optim::CentralizedSgdOptions(lr).grad_clip(clip));
    CHECK(opt.last_grad_norm() == 0);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(data.x(s, r)), data.y(s, r)).backward();
      opt.step();
      seen[r].push_back(opt.last_grad_norm());
      // The gradients left in the model are the clipped average: norm == clip.
      double squares = 0;
      for (auto& p : model->parameters()) squares += p.grad().pow(2).sum().item<double>();
      CHECK(std::sqrt(squares) == doctest::Approx(clip).epsilon(1e-4));
    }
    finals[r] = clones(model->parameters());
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(max_diff(finals[r], want) < 1e-6);
    for (int s = 0; s < steps; ++s) CHECK(seen[r][s] == doctest::Approx(norms[s]).epsilon(1e-5));
  }
}

TEST_CASE("a denominator set before backward divides the gradient sum, at world size 1 as well") {
  torch::set_num_threads(1);
  const int64_t batch = 4;
  const double denominator = 7;
  for (int world : {1, 2}) {
    CAPTURE(world);
    torch::manual_seed(13);
    std::vector<std::shared_ptr<Mlp>> replicas;
    for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
    auto reference = std::make_shared<Mlp>();
    copy_params(*replicas[0], *reference);
    auto data = make_data(world, 2, batch);
    // Step 0: summed losses over the denominator. Step 1 (no denominator): mean losses over W.
    torch::nn::MSELoss sum_loss(torch::nn::MSELossOptions().reduction(torch::kSum));
    reference->zero_grad();
    sum_loss(reference->forward(data.xs[0]), data.ys[0]).backward();
    std::vector<torch::Tensor> want0;
    for (auto& g : grads_of(*reference)) want0.push_back(g / denominator);
    {
      torch::NoGradGuard no_grad;
      auto ps = reference->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].sub_(0.1 * want0[i]);
    }
    reference->zero_grad();
    torch::mse_loss(reference->forward(data.xs[1]), data.ys[1]).backward();
    auto want1 = grads_of(*reference);

    std::vector<std::vector<torch::Tensor>> got0(world), got1(world);
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      optim::CentralizedSGD opt(rt, model, optim::CentralizedSgdOptions(0.1));
      opt.zero_grad();
      opt.set_denominator(denominator);
      sum_loss(model->forward(data.x(0, r)), data.y(0, r)).backward();
      opt.step();
      got0[r] = grads_of(*model);
      opt.zero_grad();
      torch::mse_loss(model->forward(data.x(1, r)), data.y(1, r)).backward();
      opt.step();
      got1[r] = grads_of(*model);
    });
    for (auto& e : errors) CHECK(e == "");
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(max_diff(got0[r], want0) < 1e-5);
      CHECK(max_diff(got1[r], want1) < 1e-5);
    }
  }
}

TEST_CASE("divide_before divides each rank's gradient before the sum, which then cannot overflow") {
  // Each of 2 ranks has a gradient of 3e38 per element: their sum overflows float32, their
  // halves do not.
  struct Scale : torch::nn::Module {
    Scale() { w = register_parameter("w", torch::ones({3})); }
    torch::Tensor w;
  };
  const float big = 3e38f;
  for (bool before : {false, true}) {
    CAPTURE(before);
    std::vector<torch::Tensor> grads(2);
    auto errors = run_threads(2, [&](int r, Runtime& rt) {
      auto model = std::make_shared<Scale>();
      optim::CentralizedSGD opt(rt, model,
                                optim::CentralizedSgdOptions(1e-40).divide_before(before));
      opt.zero_grad();
      (model->w * torch::full({3}, big)).sum().backward();
      opt.step();
      grads[r] = model->w.grad().clone();
    });
    for (auto& e : errors) CHECK(e == "");
    for (auto& g : grads) {
      if (before)
        CHECK((g == big).all().item<bool>());
      else
        CHECK(torch::isinf(g).all().item<bool>());
    }
  }
}

TEST_CASE(
    "agg_grad=false steps every rank's own optimizer, then averages the weights, and the momentum "
    "stays local") {
  torch::set_num_threads(1);
  const int world = 3, steps = 3;
  const int64_t batch = 2;
  const double lr = 0.05, momentum = 0.9;
  torch::manual_seed(14);
  std::vector<std::shared_ptr<Mlp>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
  auto data = make_data(world, steps, batch);
  // One reference model and SGD per rank, all from rank 0's weights; after each local step every
  // model gets the average of the weights.
  std::vector<std::shared_ptr<Mlp>> refs;
  std::vector<std::unique_ptr<torch::optim::SGD>> ref_opts;
  for (int r = 0; r < world; ++r) {
    refs.push_back(std::make_shared<Mlp>());
    copy_params(*replicas[0], *refs[r]);
    ref_opts.push_back(std::make_unique<torch::optim::SGD>(
        refs[r]->parameters(), torch::optim::SGDOptions(lr).momentum(momentum)));
  }
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      ref_opts[r]->zero_grad();
      torch::mse_loss(refs[r]->forward(data.x(s, r)), data.y(s, r)).backward();
      ref_opts[r]->step();
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < refs[0]->parameters().size(); ++i) {
      auto sum = torch::zeros_like(refs[0]->parameters()[i]);
      for (int r = 0; r < world; ++r) sum += refs[r]->parameters()[i];
      for (int r = 0; r < world; ++r) refs[r]->parameters()[i].copy_(sum / world);
    }
  }
  auto buffer_of = [](torch::optim::Optimizer& opt, const torch::Tensor& p) {
    auto& state = opt.state().at(p.unsafeGetTensorImpl());
    return static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer().clone();
  };
  std::vector<torch::Tensor> want_buffers;
  for (int r = 0; r < world; ++r)
    want_buffers.push_back(buffer_of(*ref_opts[r], refs[r]->parameters()[0]));
  CHECK((want_buffers[0] - want_buffers[1]).abs().max().item<double>() > 1e-3);

  std::vector<std::vector<torch::Tensor>> finals(world);
  std::vector<torch::Tensor> buffers(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    optim::CentralizedSGD opt(rt, model,
                              optim::CentralizedSgdOptions(lr).momentum(momentum).agg_grad(false));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(data.x(s, r)), data.y(s, r)).backward();
      opt.step();
    }
    finals[r] = clones(model->parameters());
    buffers[r] = buffer_of(opt.optimizer(), model->parameters()[0]);
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(max_diff(finals[r], refs[0]->parameters()) < 1e-6);
    CHECK((buffers[r] - want_buffers[r]).abs().max().item<double>() < 1e-6);
  }
}

TEST_CASE("CustomCentralizedOptimizer steps a user's RMSprop on 2 ranks like one process") {
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  const int64_t batch = 3;
  torch::manual_seed(15);
  std::vector<std::shared_ptr<Mlp>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
  auto reference = std::make_shared<Mlp>();
  copy_params(*replicas[0], *reference);
  auto data = make_data(world, steps, batch);
  auto rmsprop = torch::optim::RMSpropOptions(0.01).momentum(0.5);
  torch::optim::RMSprop ref_opt(reference->parameters(), rmsprop);
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(data.xs[s]), data.ys[s]).backward();
    ref_opt.step();
  }
  std::vector<std::vector<torch::Tensor>> finals(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    optim::CustomCentralizedOptimizer opt(
        rt, model, std::make_unique<torch::optim::RMSprop>(model->parameters(), rmsprop));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(data.x(s, r)), data.y(s, r)).backward();
      opt.step();
    }
    finals[r] = clones(model->parameters());
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) CHECK(max_diff(finals[r], reference->parameters()) < 1e-5);
}

TEST_CASE("bad centralized optimizer arguments are rejected with a message naming them") {
  using optim::CentralizedAdamOptions;
  using optim::CentralizedOptions;
  using optim::CentralizedSgdOptions;
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    auto net = std::make_shared<Mlp>();
    CHECK_THROWS_WITH_AS(optim::CentralizedSGD(rt, net, CentralizedSgdOptions(0.1).grad_clip(-1)),
                         "CentralizedSgdOptions.grad_clip=-1 (expected a finite value >= 0; 0 "
                         "turns clipping off)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::CentralizedAdam(rt, net, CentralizedAdamOptions(0.1).grad_clip(-0.5)),
        "CentralizedAdamOptions.grad_clip=-0.5 (expected a finite value >= 0; 0 turns clipping "
        "off)",
        comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::CustomCentralizedOptimizer(
            rt, net, std::make_unique<torch::optim::SGD>(net->parameters(), 0.1),
            CentralizedOptions().grad_clip(-2)),
        "CentralizedOptions.grad_clip=-2 (expected a finite value >= 0; 0 turns clipping off)",
        comm::Error);
    CHECK_THROWS_WITH_AS(optim::CentralizedSGD(rt, net, CentralizedSgdOptions(0)),
                         "CentralizedSgdOptions.lr=0 (expected > 0)", comm::Error);
    CHECK_THROWS_WITH_AS(optim::CentralizedSGD(rt, net, CentralizedSgdOptions(0.1).nesterov(true)),
                         "CentralizedSgdOptions.nesterov=true with momentum=0 and dampening=0 "
                         "(expected momentum > 0 and dampening = 0)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::CentralizedAdam(rt, net, CentralizedAdamOptions(0.1).betas({0.9, 1.0})),
        "CentralizedAdamOptions.betas=(0.9, 1) (expected each in [0, 1))", comm::Error);
    CHECK_THROWS_WITH_AS(optim::CentralizedAdam(rt, net, CentralizedAdamOptions(0.1).eps(-1)),
                         "CentralizedAdamOptions.eps=-1 (expected >= 0)", comm::Error);
    torch::nn::Linear stranger(2, 2);
    CHECK_THROWS_WITH_AS(
        optim::CustomCentralizedOptimizer(
            rt, net, std::make_unique<torch::optim::SGD>(stranger->parameters(), 0.1)),
        "CustomCentralizedOptimizer: parameter 0 of the optimizer is not a parameter of the "
        "module (expected an optimizer over module->parameters())",
        comm::Error);

    optim::CentralizedSGD opt(rt, net, CentralizedSgdOptions(0.1));
    CHECK_THROWS_WITH_AS(opt.set_denominator(0),
                         "CentralizedSGD.set_denominator(0) (expected a finite denominator > 0, "
                         "e.g. the step's number of samples over all ranks)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(opt.set_denominator(-4),
                         "CentralizedSGD.set_denominator(-4) (expected a finite denominator > 0, "
                         "e.g. the step's number of samples over all ranks)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(opt.set_denominator(std::numeric_limits<double>::quiet_NaN()),
                         "CentralizedSGD.set_denominator(nan) (expected a finite denominator > "
                         "0, e.g. the step's number of samples over all ranks)",
                         comm::Error);
    // Fresh models: a module wrapped by a live optimizer cannot be wrapped again.
    optim::CentralizedAdam local(rt, std::make_shared<Mlp>(),
                                 CentralizedAdamOptions(0.1).agg_grad(false));
    CHECK_THROWS_WITH_AS(local.set_denominator(8),
                         "CentralizedAdam.set_denominator(8) with agg_grad=false (expected "
                         "agg_grad=true: the denominator divides gradients, and weights are "
                         "averaged by the world size)",
                         comm::Error);
    optim::CentralizedSGD summing(rt, std::make_shared<Mlp>(),
                                  CentralizedSgdOptions(0.1).average(false));
    CHECK_THROWS_WITH_AS(summing.set_denominator(8),
                         "CentralizedSGD.set_denominator(8) with average=false (expected "
                         "average=true: without it the gradients are summed)",
                         comm::Error);
  });
  CHECK(errors == std::vector<std::string>{""});
}
