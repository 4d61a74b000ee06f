// Gradients zeroed by setting them to none (Module::zero_grad(true); LibTorch >= 2.0's
// Optimizer::zero_grad() default), on every path of DistributedModule and of the optimizers built
// on it, against one process trained on the whole batch: backward then allocates fresh gradients,
// which must still be averaged.
#include "tests/support/torch_doctest.h"

#include <memory>
#include <string>
#include <vector>

#include "algorithms/optim/centralized.h"
#include "algorithms/optim/fp16_optimizer.h"
#include "algorithms/optim/power_sgd.h"
#include "ddp/distributed_module.h"
#include "tests/support/ddp_reference.h"
#include "tests/support/tensors.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

using test::Case;
using test::make_job;
using test::max_difference;
using test::Mlp;
using test::parameter_difference;
using test::run_threads;

DdpOptions several_buckets() {
  DdpOptions o;
  o.bucket_bytes = 200;
  o.first_bucket_bytes = 100;
  return o;
}

}  // namespace

TEST_CASE(
    "gradients set to none are averaged on every CPU path like one process on the whole batch") {
  torch::set_num_threads(1);
  std::vector<Case> cases;
  for (auto aggregation : {Aggregation::bucket, Aggregation::model})
    for (bool delay : {false, true}) {
      Case c;
      c.options = several_buckets();
      c.options.aggregation = aggregation;
      c.options.delay_reduce = delay;
      c.name = std::string(aggregation == Aggregation::bucket ? "by bucket" : "by model") +
               (delay ? ", delay_reduce" : ", overlapped");
      cases.push_back(c);
    }
  {
    Case c;
    c.options = several_buckets();
    c.optim = test::Optim::adam;
    c.name = "Adam";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = several_buckets();
    c.options.gradient_as_bucket_view = false;
    c.name = "gradients copied into the buckets";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = several_buckets();
    c.options.agg_grad = false;
    c.options.aggregation = Aggregation::layer;
    c.name = "weights averaged after the local step";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = several_buckets();
    c.micro_batches = 2;
    c.name = "no_sync accumulation, then a synced backward";
    cases.push_back(c);
  }
  for (auto& c : cases)
    for (bool shared : {true, false}) {
      c.set_to_none = true;
      c.options.shared_memory = shared;
      // Thread ranks share this host: the buckets live in shared memory unless it is turned off.
      c.path = shared ? "cpu via shared memory" : "cpu";
      CAPTURE(c.name);
      CAPTURE(shared);
      CHECK(max_difference(c, 3) < 2e-5);
    }
}

TEST_CASE(
    "on one host, gradients set to none are reduced where autograd put them, in shared memory, "
    "not copied into the buckets, with SGD and with Adam") {
  // fc2's gradient (160 x 160 float32: 102400 bytes) is large enough for the arena
  // (GradientArena::kMinBytes); the others are copied. Adam's two moments per parameter, made in
  // the first step, must not take the arena's room (a gradient's size each).
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  const size_t fc2 = 160 * 160 * 4;
  const size_t all = (6 * 160 + 160 + 160 * 160 + 160 + 160 * 3 + 3) * 4;
  for (auto optim : {test::Optim::sgd_momentum, test::Optim::adam})
    for (bool arena : {true, false}) {
      Case c;
      c.options = several_buckets();
      c.options.gradients_in_shared_memory = arena;
      c.optim = optim;
      c.hidden = 160;
      c.set_to_none = true;
      c.path = "cpu via shared memory";
      std::vector<size_t> copied(static_cast<size_t>(world * steps), 0);
      c.after_step = [&](int r, int s, const DistributedModule& ddp) {
        copied[static_cast<size_t>(r * steps + s)] = ddp.last_step().gradient_bytes_copied;
      };
      CAPTURE(arena);
      CAPTURE(optim == test::Optim::adam);
      CHECK(max_difference(c, world, steps) < 2e-5);
      CHECK(copied == std::vector<size_t>(copied.size(), arena ? all - fc2 : all));
    }
}

TEST_CASE(
    "on one host, a gradient that autograd put in shared memory is reduced in place: after "
    "backward it is still that tensor, not its bucket slot, and holds the ranks' average") {
  // fc2's weight gradient (160 x 160 float32) comes from the arena. Against one process on the
  // whole batch: its gradient before each step, and its parameters after the last.
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  Case c;
  c.options = several_buckets();
  c.hidden = 160;
  const auto job = make_job(c, world, steps);
  auto reference = std::make_shared<Mlp>(6, c.hidden, 3);
  test::copy_params(job.replicas[0], reference);
  auto ref_opt = test::make_optimizer(c.optim, reference);
  std::vector<torch::Tensor> want;  // fc2's weight gradient before each step
  for (int s = 0; s < steps; ++s) {
    ref_opt->zero_grad();
    torch::mse_loss(reference->forward(job.xs[static_cast<size_t>(s)]),
                    job.ys[static_cast<size_t>(s)])
        .backward();
    want.push_back(reference->fc2->weight.grad().clone());
    ref_opt->step();
  }
  std::vector<double> diffs(world, 1e9);
  std::vector<std::vector<double>> grad_diffs(world, std::vector<double>(steps, 1e9));
  std::vector<std::string> failures(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = job.replicas[static_cast<size_t>(r)];
    auto opt = test::make_optimizer(c.optim, model);
    DistributedModule ddp(rt, model, GradientAllReduce{}, c.options);
    auto& failed = failures[static_cast<size_t>(r)];
    if (ddp.gradient_path() != "cpu via shared memory") failed += ddp.gradient_path() + "; ";
    // Before the first step every gradient is its bucket slot.
    const void* slot = model->fc2->weight.grad().data_ptr();
    for (int s = 0; s < steps; ++s) {
      model->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(job.x(s, r)), job.y(s, r)).backward();
      const auto grad = model->fc2->weight.grad();
      const void* where = grad.data_ptr();
      if (s == 0 && where == slot) failed += "step 0: the gradient is its bucket slot; ";
      grad_diffs[static_cast<size_t>(r)][static_cast<size_t>(s)] =
          (grad - want[static_cast<size_t>(s)]).abs().max().item<double>();
      ddp.step(*opt);
      if (model->fc2->weight.grad().data_ptr() != where)
        failed += "step " + std::to_string(s) + ": the step moved the gradient; ";
    }
    diffs[static_cast<size_t>(r)] = parameter_difference(*model, *reference);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<size_t>(r)] == "");
    CHECK(failures[static_cast<size_t>(r)] == "");
    CHECK(diffs[static_cast<size_t>(r)] < 2e-5);
    for (double d : grad_diffs[static_cast<size_t>(r)]) CHECK(d < 1e-5);
  }
}

TEST_CASE(
    "a parameter unused on one rank whose gradient is none receives the other ranks' gradient") {
  // The extra head is used by rank 1 only. Rank 0's head gradient stays none in backward; the
  // step must reduce it as zeros and point it at its bucket slot, which holds the average.
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  Case c;
  c.extra_head = true;
  const auto job = make_job(c, world, steps);
  auto forward = [](Mlp& m, const torch::Tensor& x, bool head) {
    auto h = torch::relu(m.fc2(torch::relu(m.fc1(x))));
    return head ? m.fc3(h) + m.unused(h) : m.fc3(h);
  };
  // The reference: the mean of the two ranks' losses, on one model.
  auto reference = std::make_shared<Mlp>(6, 8, 3, true);
  test::copy_params(job.replicas[0], reference);
  auto ref_opt = test::make_optimizer(c.optim, reference);
  for (int s = 0; s < steps; ++s) {
    ref_opt->zero_grad();
    auto loss = (torch::mse_loss(forward(*reference, job.x(s, 0), false), job.y(s, 0)) +
                 torch::mse_loss(forward(*reference, job.x(s, 1), true), job.y(s, 1))) /
                2;
    loss.backward();
    ref_opt->step();
  }
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    std::vector<double> diffs(world, 1e9);
    auto replicas = make_job(c, world, steps).replicas;  // fresh weights, the same values
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      auto opt = test::make_optimizer(c.optim, model);
      DdpOptions o = several_buckets();
      o.find_unused_parameters = true;
      o.shared_memory = shared;
      DistributedModule ddp(rt, model, GradientAllReduce{}, o);
      for (int s = 0; s < steps; ++s) {
        model->zero_grad(/*set_to_none=*/true);
        torch::mse_loss(forward(*model, job.x(s, r), r == 1), job.y(s, r)).backward();
        // The reductions end with backward (as PyTorch DDP's do): rank 0's gradient of the head
        // it did not use is already its bucket slot, holding rank 1's gradient averaged.
        CHECK(model->unused->weight.grad().defined());
        ddp.step(*opt);
        CHECK(model->unused->weight.grad().defined());
      }
      diffs[static_cast<size_t>(r)] = parameter_difference(*model, *reference);
    });
    for (auto& e : errors) CHECK(e == "");
    for (double d : diffs) CHECK(d < 2e-5);
  }
}

TEST_CASE(
    "a parameter no rank uses, whose gradient is none, ends with a zero gradient in its bucket") {
  torch::set_num_threads(1);
  Case c;
  c.options = several_buckets();
  c.options.find_unused_parameters = true;
  c.extra_head = true;
  c.set_to_none = true;
  CHECK(max_difference(c, 2) < 2e-5);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3, true);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DistributedModule ddp(rt, model, GradientAllReduce{}, c.options);
    for (int s = 0; s < 2; ++s) {
      model->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(torch::ones({2, 6}) * (r + 1)), torch::zeros({2, 3}))
          .backward();
      ddp.step(opt);
      REQUIRE(model->unused->weight.grad().defined());
      CHECK(model->unused->weight.grad().abs().max().item<double>() == 0);
    }
    // The gradient is the bucket slot again: it stays where it is from one step to the next.
    const void* slot = model->unused->weight.grad().data_ptr();
    opt.zero_grad();
    torch::mse_loss(model->forward(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
    ddp.step(opt);
    CHECK(model->unused->weight.grad().data_ptr() == slot);
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("CentralizedSGD averages gradients the user set to none like one process") {
  torch::set_num_threads(1);
  const int world = 3, steps = 3;
  Case c;  // SGD(0.1, momentum 0.9), the reference's optimizer
  const auto job = make_job(c, world, steps);
  std::vector<double> diffs(world, 1e9);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = job.replicas[static_cast<size_t>(r)];
    optim::CentralizedSGD opt(rt, model, optim::CentralizedSgdOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      model->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(job.x(s, r)), job.y(s, r)).backward();
      opt.step();
    }
    diffs[static_cast<size_t>(r)] = parameter_difference(*model, *job.reference);
  });
  for (auto& e : errors) CHECK(e == "");
  for (double d : diffs) CHECK(d < 2e-5);
}

TEST_CASE(
    "optim::PowerSGD averages gradients set to none, and its zero_grad keeps them in the buckets") {
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  Case c;
  const auto job = make_job(c, world, steps);
  std::vector<double> diffs(world, 1e9);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = job.replicas[static_cast<size_t>(r)];
    comm::PowerSGD algorithm;
    algorithm.start_iter = 100;  // exact allreduce before start_iter: comparable with SGD
    optim::PowerSGD opt(rt, model,
                        optim::PowerSgdOptimizerOptions(0.1).momentum(0.9).algorithm(algorithm));
    for (int s = 0; s < steps; ++s) {
      model->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(job.x(s, r)), job.y(s, r)).backward();
      opt.step();
    }
    diffs[static_cast<size_t>(r)] = parameter_difference(*model, *job.reference);
    const void* slot = model->fc1->weight.grad().data_ptr();
    opt.zero_grad();
    REQUIRE(model->fc1->weight.grad().defined());
    CHECK(model->fc1->weight.grad().data_ptr() == slot);
    CHECK(model->fc1->weight.grad().abs().max().item<double>() == 0);
  });
  for (auto& e : errors) CHECK(e == "");
  for (double d : diffs) CHECK(d < 2e-5);
}

TEST_CASE("FP16Optimizer with gradients set to none steps as with gradients zeroed in place") {
  // bfloat16 (LibTorch 1.13 had bfloat16 matrix products on the CPU, not float16 ones); the
  // in-place run is the one fp16_optimizer_test.cpp checks against an fp32 SGD.
  torch::set_num_threads(1);
  const int world = 2, steps = 3;
  Case c;
  const auto job = make_job(c, world, steps);
  std::vector<std::vector<std::vector<torch::Tensor>>> masters(2);
  for (bool to_none : {false, true}) {
    auto replicas = make_job(c, world, steps).replicas;
    masters[to_none].assign(world, {});
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      optim::FP16Optimizer opt(rt, model, torch::optim::SGDOptions(0.1).momentum(0.9),
                               optim::Fp16OptimizerOptions().dtype(torch::kBFloat16));
      for (int s = 0; s < steps; ++s) {
        if (to_none)
          model->zero_grad(/*set_to_none=*/true);
        else
          opt.zero_grad();
        auto out = model->forward(job.x(s, r).to(torch::kBFloat16)).to(torch::kFloat);
        opt.backward(torch::mse_loss(out, job.y(s, r)));  // 1.13 had no bfloat16 mse_loss
        opt.step();
      }
      masters[to_none][static_cast<size_t>(r)] = test::clones(opt.master_weights());
    });
    for (auto& e : errors) CHECK(e == "");
  }
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(test::max_diff(masters[1][static_cast<size_t>(r)], masters[0][0]) == 0);
  }
  CHECK(test::max_diff(masters[0][0], test::clones(job.reference->parameters())) < 0.05);
}
