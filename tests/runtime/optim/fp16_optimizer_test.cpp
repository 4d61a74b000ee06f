// FP16Optimizer against references written here: the masters stepped by hand on one rank, an
// fp32 SGD on the concatenated batch on several, the loss-scale sequence over planted overflows
// written out by hand; bf16 mode; and its argument checks. Ranks are threads over inproc.
#include "algorithms/optim/fp16_optimizer.h"

#include <functional>
#include <limits>
#include <memory>
#include <set>
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

// Two linear layers written with element-wise ops (LibTorch 1.13, which this test was written for,
// had no float16 matrix product on the CPU). Built in float32.
struct Net : torch::nn::Module {
  Net() {
    w1 = register_parameter("w1", torch::randn({5, 6}) * 0.4);
    b1 = register_parameter("b1", torch::randn({5}) * 0.1);
    w2 = register_parameter("w2", torch::randn({3, 5}) * 0.4);
    b2 = register_parameter("b2", torch::randn({3}) * 0.1);
  }
  static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& b) {
    return (x.unsqueeze(1) * w).sum(-1) + b;
  }
  torch::Tensor forward(const torch::Tensor& x) { return linear(linear(x, w1, b1), w2, b2); }
  torch::Tensor w1, b1, w2, b2;
};

torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  auto out = net.forward(x.to(net.w1.scalar_type()));
  return (out - y.to(out.scalar_type())).pow(2).mean();
}

using Data = test::StepData;
Data make_data(int world, int steps, int64_t batch) {
  return test::make_step_data(world, steps, batch, 6, 3);
}

// fp32 SGD on the concatenated batch, skipping the steps in `skip`.
std::vector<torch::Tensor> fp32_reference(Net& start, const Data& data, int steps,
                                          torch::optim::SGDOptions sgd,
                                          const std::set<int>& skip = {}) {
  Net reference;
  copy_params(start, reference);
  torch::optim::SGD opt(reference.parameters(), sgd);
  for (int s = 0; s < steps; ++s) {
    if (skip.count(s)) continue;
    opt.zero_grad();
    loss_of(reference, data.xs[s], data.ys[s]).backward();
    opt.step();
  }
  return clones(reference.parameters());
}

const double inf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE(
    "FP16Optimizer keeps float32 masters in one flat buffer and, on one rank, steps them as by "
    "hand") {
  torch::set_num_threads(1);
  const int steps = 5;
  const double lr = 0.05, scale = 1024;
  torch::manual_seed(21);
  auto net = std::make_shared<Net>();
  auto data = make_data(1, steps, 4);
  // By hand: the model is the masters rounded to half; G = float32(grad of scale * loss) / scale;
  // masters -= lr * G.
  auto masters = clones(net->parameters());
  Net half;
  half.to(torch::kHalf);
  for (int s = 0; s < steps; ++s) {
    {
      torch::NoGradGuard no_grad;
      auto ps = half.parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(masters[i]);
    }
    half.zero_grad();
    (loss_of(half, data.xs[s], data.ys[s]).to(torch::kFloat) * scale).backward();
    auto ps = half.parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      masters[i] = masters[i] - lr * (ps[i].grad().to(torch::kFloat) / scale);
  }

  auto errors = run_threads(1, [&](int, Runtime& rt) {
    optim::FP16Optimizer opt(rt, net, torch::optim::SGDOptions(lr));
    auto params = net->parameters();
    int64_t offset = 0;
    const auto* base = static_cast<const char*>(opt.master_buffer().data_ptr());
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK((params[i].scalar_type() == torch::kHalf));
      const auto& m = opt.master_weights()[i];
      CHECK((m.scalar_type() == torch::kFloat));
      CHECK((m.sizes() == params[i].sizes()));
      CHECK(static_cast<const char*>(m.data_ptr()) == base + offset * 4);
      offset += m.numel();
    }
    CHECK(opt.master_buffer().numel() == offset);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      opt.backward(loss_of(*net, data.xs[s], data.ys[s]));
      CHECK(opt.step());
      // The model is the masters in half precision.
      for (size_t i = 0; i < params.size(); ++i)
        CHECK(torch::equal(params[i], opt.master_weights()[i].to(torch::kHalf)));
    }
    CHECK(opt.loss_scale() == scale);
    CHECK(opt.skipped_steps() == 0);
    CHECK(max_diff(opt.master_weights(), masters) < 1e-6);
    // The masters hold what the half model cannot.
    CHECK(max_diff(opt.master_weights(), params) > 0);
  });
  CHECK(errors == std::vector<std::string>{""});
}

TEST_CASE("FP16Optimizer on 2 ranks keeps identical masters that track an fp32 SGD") {
  torch::set_num_threads(1);
  const int world = 2, steps = 4;
  torch::manual_seed(22);
  std::vector<std::shared_ptr<Net>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>());
  auto data = make_data(world, steps, 4);
  auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  auto want = fp32_reference(*replicas[0], data, steps, sgd);
  auto start = clones(replicas[0]->parameters());
  std::vector<std::vector<torch::Tensor>> masters(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto net = replicas[static_cast<size_t>(r)];
    optim::FP16Optimizer opt(rt, net, sgd);
    CHECK(max_diff(opt.master_weights(), start) == 0);  // rank 0's float32 weights, exactly
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      opt.backward(loss_of(*net, data.x(s, r), data.y(s, r)));
      CHECK(opt.step());
    }
    masters[r] = clones(opt.master_weights());
  });
  for (auto& e : errors) CHECK(e == "");
  CHECK(max_diff(masters[1], masters[0]) == 0);
  CHECK(max_diff(masters[0], want) < 5e-4);  // half forward and backward, half sums
  CHECK(max_diff(masters[0], start) > 5e-2);
}

TEST_CASE(
    "an overflow on one rank makes every rank skip the step, and the loss scale follows the "
    "planted overflows") {
  torch::set_num_threads(1);
  const int world = 3, steps = 13;
  // Which ranks plant an inf in their loss, by step.
  const std::vector<std::set<int>> planted = {{}, {2}, {}, {}, {}, {0}, {1, 2},
                                              {}, {},  {}, {}, {}, {}};
  // scale_window 3, factor 2: halve at an overflow, double after 3 clean steps in a row.
  const std::vector<double> want_scale = {1024, 512, 512, 512, 1024, 512, 256,
                                          256,  256, 512, 512, 512,  1024};
  const std::vector<bool> want_stepped = {true, false, true, true, true, false, false,
                                          true, true,  true, true, true, true};
  torch::manual_seed(23);
  std::vector<std::shared_ptr<Net>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>());
  auto data = make_data(world, steps, 2);
  std::vector<std::vector<double>> scales(world);
  std::vector<std::vector<bool>> stepped(world), moved(world);
  std::vector<int64_t> skipped(world, -1);
  std::vector<std::vector<torch::Tensor>> finals(world);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto net = replicas[static_cast<size_t>(r)];
    optim::FP16Optimizer opt(rt, net, torch::optim::SGDOptions(0.01),
                             optim::Fp16OptimizerOptions().scale_window(3));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto loss = loss_of(*net, data.x(s, r), data.y(s, r));
      if (planted[s].count(r)) loss = loss * inf;
      opt.backward(loss);
      auto before = opt.master_buffer().clone();
      stepped[r].push_back(opt.step());
      moved[r].push_back(!torch::equal(before, opt.master_buffer()));
      scales[r].push_back(opt.loss_scale());
    }
    skipped[r] = opt.skipped_steps();
    finals[r] = clones(opt.master_weights());
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(scales[r] == want_scale);
    CHECK(stepped[r] == want_stepped);
    CHECK(moved[r] == want_stepped);  // a skipped step leaves the masters alone
    CHECK(skipped[r] == 3);
    CHECK(max_diff(finals[r], finals[0]) == 0);
  }
}

TEST_CASE("the loss scale grows no higher than max_scale") {
  torch::set_num_threads(1);
  torch::manual_seed(24);
  auto net = std::make_shared<Net>();
  auto data = make_data(1, 6, 2);
  std::vector<double> scales;
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    optim::FP16Optimizer opt(
        rt, net, torch::optim::SGDOptions(0.01),
        optim::Fp16OptimizerOptions().init_scale(256).max_scale(512.0).scale_window(2));
    for (int s = 0; s < 6; ++s) {
      opt.zero_grad();
      opt.backward(loss_of(*net, data.xs[s], data.ys[s]));
      opt.step();
      scales.push_back(opt.loss_scale());
    }
  });
  CHECK(errors == std::vector<std::string>{""});
  CHECK(scales == std::vector<double>{256, 512, 512, 512, 512, 512});
}

TEST_CASE(
    "the loss scale stops at min_scale, and an overflow there throws the same error on every "
    "rank") {
  torch::set_num_threads(1);
  torch::manual_seed(25);
  std::vector<std::shared_ptr<Net>> replicas = {std::make_shared<Net>(), std::make_shared<Net>()};
  auto data = make_data(2, 3, 2);
  std::vector<std::vector<double>> scales(2);
  std::vector<int64_t> skipped(2, -1);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto net = replicas[static_cast<size_t>(r)];
    optim::FP16Optimizer opt(rt, net, torch::optim::SGDOptions(0.01),
                             optim::Fp16OptimizerOptions().init_scale(3).min_scale(2));
    // Step 0: rank 1 overflows, 3 / 2 is clamped to 2. Step 1: rank 0 overflows at min_scale.
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      auto loss = loss_of(*net, data.x(s, r), data.y(s, r));
      opt.backward(r == 1 - s ? loss * inf : loss);
      bool stepped = true;
      try {
        stepped = opt.step();
      } catch (...) {
        skipped[r] = opt.skipped_steps();
        throw;
      }
      CHECK_FALSE(stepped);
      scales[r].push_back(opt.loss_scale());
    }
  });
  const std::string want =
      "FP16Optimizer: step 1: the gradients overflow (inf or NaN) with the loss scale already at "
      "min_scale=2 (the step was skipped; expected finite gradients at this scale: lower "
      "min_scale, or look for the source of the inf/NaN)";
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(errors[r] == want);
    CHECK(scales[r] == std::vector<double>{2});
    CHECK(skipped[r] == 2);
  }
}

TEST_CASE(
    "bf16 mode: no loss scaling by default, masters track an fp32 SGD, an overflow skips the "
    "step") {
  torch::set_num_threads(1);
  const int world = 2, steps = 5;
  torch::manual_seed(26);
  std::vector<std::shared_ptr<Net>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>());
  auto data = make_data(world, steps, 4);
  auto sgd = torch::optim::SGDOptions(0.05);
  auto want = fp32_reference(*replicas[0], data, steps, sgd, {2});
  auto start = clones(replicas[0]->parameters());
  std::vector<std::vector<torch::Tensor>> masters(world);
  std::vector<std::vector<bool>> stepped(world);
  std::vector<int64_t> skipped(world, -1);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto net = replicas[static_cast<size_t>(r)];
    optim::FP16Optimizer opt(rt, net, sgd, optim::Fp16OptimizerOptions().dtype(torch::kBFloat16));
    CHECK((net->w1.scalar_type() == torch::kBFloat16));
    CHECK(opt.loss_scale() == 1);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto loss = loss_of(*net, data.x(s, r), data.y(s, r));
      if (s == 2 && r == 1) loss = loss * inf;
      opt.backward(loss);
      stepped[r].push_back(opt.step());
      CHECK(opt.loss_scale() == 1);
    }
    skipped[r] = opt.skipped_steps();
    masters[r] = clones(opt.master_weights());
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(stepped[r] == std::vector<bool>{true, true, false, true, true});
    CHECK(skipped[r] == 1);
    CHECK(max_diff(masters[r], masters[0]) == 0);
  }
  CHECK(max_diff(masters[0], want) < 2e-3);  // bfloat16 keeps 8 bits of mantissa
  CHECK(max_diff(masters[0], start) > 5e-2);
}

TEST_CASE("bad FP16Optimizer options are rejected naming the option, its value and the range") {
  using optim::Fp16OptimizerOptions;
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    auto make = [&](Fp16OptimizerOptions o) {
      optim::FP16Optimizer made(rt, std::make_shared<Net>(), torch::optim::SGDOptions(0.1), o);
    };
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().scale_factor(1)),
                         "Fp16OptimizerOptions.scale_factor=1 (expected a finite value > 1)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().scale_factor(0.5)),
                         "Fp16OptimizerOptions.scale_factor=0.5 (expected a finite value > 1)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().scale_window(0)),
                         "Fp16OptimizerOptions.scale_window=0 (expected >= 1)", comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().min_scale(0)),
                         "Fp16OptimizerOptions.min_scale=0 (expected > 0)", comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().min_scale(-1)),
                         "Fp16OptimizerOptions.min_scale=-1 (expected > 0)", comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().min_scale(4096)),
                         "Fp16OptimizerOptions.min_scale=4096 with init_scale=1024 (expected 0 < "
                         "min_scale <= init_scale)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().max_scale(512.0)),
                         "Fp16OptimizerOptions.max_scale=512 with init_scale=1024 (expected "
                         "max_scale >= init_scale)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().init_scale(0)),
                         "Fp16OptimizerOptions.init_scale=0 (expected a finite value > 0)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().init_scale(-8)),
                         "Fp16OptimizerOptions.init_scale=-8 (expected a finite value > 0)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().dtype(torch::kFloat)),
                         "Fp16OptimizerOptions.dtype=Float (expected Half or BFloat16)",
                         comm::Error);
    DdpOptions local;
    local.agg_grad = false;
    CHECK_THROWS_WITH_AS(make(Fp16OptimizerOptions().ddp(local)),
                         "Fp16OptimizerOptions.ddp.agg_grad=false (expected true: FP16Optimizer "
                         "averages the gradients, then steps the float32 masters)",
                         comm::Error);
    auto wide = std::make_shared<Net>();
    wide->to(torch::kDouble);
    CHECK_THROWS_WITH_AS(optim::FP16Optimizer(rt, wide, torch::optim::SGDOptions(0.1)),
                         "FP16Optimizer: parameter 'w1' is a Double tensor (expected Float, or "
                         "Half as Fp16OptimizerOptions.dtype)",
                         comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::FP16Optimizer(
            rt, std::make_shared<Net>(),
            optim::MasterOptimizerFactory([](std::vector<torch::Tensor>) { return nullptr; })),
        "FP16Optimizer: the optimizer factory returned null (expected an optimizer over the "
        "master weights)",
        comm::Error);
  });
  CHECK(errors == std::vector<std::string>{""});
}
