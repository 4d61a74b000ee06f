// DdpOptions::overlap_next_forward: a step's reductions run on into the next forward, whose
// layers each await their parameters (troupe::await_parameters). Compared bit for bit with the
// ordinary step() on the same data: the optimizer steps each parameter with the same reduced
// gradient, only later. Thread ranks over the inproc transport and over shared memory.
#include <ATen/CPUGeneratorImpl.h>

#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "elastic/elastic.h"
#include "tests/support/ddp_reference.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

using test::run_threads;

constexpr int kWorld = 2;

// Three layers whose forward awaits each before using it; `skip` names a layer it does not await
// (a forward written without the overlap in mind).
struct Net : torch::nn::Module {
  explicit Net(int64_t hidden = 8) {
    fc1 = register_module("fc1", torch::nn::Linear(6, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, const std::string& skip = "") {
    if (skip != "fc1") await_parameters(fc1);
    auto h = torch::relu(fc1(x));
    if (skip != "fc2") await_parameters(fc2);
    h = torch::relu(fc2(h));
    if (skip != "fc3") await_parameters(fc3);
    return fc3(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

torch::Tensor draw(uint64_t seed, int64_t rows, int64_t cols) {
  return torch::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(seed));
}

struct Variant {
  bool adam = false;
  bool view = true;          // DdpOptions::gradient_as_bucket_view
  int zero = 0;              // 0: zero_grad() (to none), 1: zeroed in place, 2: no zero_grad
  bool denominator = false;  // set_denominator(world * 2) after backward
  bool two_passes = false;   // two backward passes per step
  bool outside = false;      // the optimizer also holds a parameter outside the module
  bool shared_memory = true;
  Algorithm algorithm = GradientAllReduce{};
  // The layers' width: at 160, fc2's weight gradient (100 KiB) comes from the gradient arena and
  // is reduced in place, where autograd put it (DdpOptions::gradients_in_shared_memory).
  int64_t hidden = 8;
  bool arena = true;  // DdpOptions::gradients_in_shared_memory
};

std::vector<torch::Tensor> train(const Variant& v, bool overlap, int steps,
                                 std::vector<std::string>* seen = nullptr) {
  torch::manual_seed(11);
  auto init = std::make_shared<Net>(v.hidden);
  std::vector<std::vector<torch::Tensor>> got(kWorld);
  auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Net>(v.hidden);
    if (r == 0) {
      torch::NoGradGuard no_grad;
      auto a = init->parameters(), b = model->parameters();
      for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
    }
    auto scale = torch::full({1}, 1.5, torch::requires_grad());
    std::vector<torch::Tensor> held = model->parameters();
    if (v.outside) held.push_back(scale);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (v.adam)
      opt = std::make_unique<torch::optim::Adam>(held, torch::optim::AdamOptions(0.01));
    else
      opt = std::make_unique<torch::optim::SGD>(
          held, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
    DdpOptions o;
    o.gradient_as_bucket_view = v.view;
    o.shared_memory = v.shared_memory;
    o.gradients_in_shared_memory = v.arena;
    o.bucket_bytes = 160;  // fc3 | fc2 | fc1: three buckets, one per layer
    o.first_bucket_bytes = 160;
    o.bucket_split_gap = std::chrono::microseconds(0);
    o.overlap_next_forward = overlap;
    DistributedModule ddp(rt, model, v.algorithm, o);
    for (int s = 0; s < steps; ++s) {
      if (v.zero == 0) opt->zero_grad();
      if (v.zero == 1)
        for (auto& p : held)
          if (p.grad().defined()) p.mutable_grad().zero_();
      for (int k = 0; k < (v.two_passes ? 2 : 1); ++k) {
        auto x = draw(100 + s * 10 + k * 5 + r, 4, 6), y = draw(500 + s * 10 + k * 5 + r, 4, 3);
        auto out = model->forward(x);
        if (v.outside) out = out * scale;
        torch::mse_loss(out, y).backward();
      }
      if (v.denominator) ddp.set_denominator(kWorld * 2);
      const auto before = model->fc3->weight.clone();
      ddp.step(*opt);
      // After the rebuild (step 0) the overlap defers the step: fc3 moves only once awaited.
      if (overlap && s >= 1 && seen && r == 0) {
        if (torch::equal(model->fc3->weight, before)) seen->push_back("deferred");
        await_parameters(model->fc3);
        if (!torch::equal(model->fc3->weight, before)) seen->push_back("applied");
      }
    }
    ddp.await_parameters();
    for (auto& p : held) got[static_cast<size_t>(r)].push_back(p.detach().clone());
  });
  for (auto& e : errors) CHECK(e == "");
  REQUIRE(!got[0].empty());
  // The module's parameters are every rank's; one outside it (v.outside) is each rank's own.
  for (size_t i = 0; i < got[0].size() - (v.outside ? 1 : 0); ++i)
    CHECK(torch::equal(got[0][i], got[1][i]));
  return got[0];
}

void check_same(const Variant& v) {
  torch::set_num_threads(1);
  const int steps = 5;
  Variant plain = v;
  plain.zero = 0;       // the ordinary loop zeroes the gradients (without it they would accumulate)
  plain.arena = false;  // and reduces every gradient in its bucket slot
  const auto want = train(plain, false, steps);
  if (v.hidden > 8) {  // the gradients reduced in place, without the overlap: the same bits
    Variant in_place = plain;
    in_place.arena = v.arena;
    const auto direct = train(in_place, false, steps);
    REQUIRE(direct.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("without the overlap, parameter " << i);
      CHECK(torch::equal(direct[i], want[i]));
    }
  }
  std::vector<std::string> seen;
  const auto got = train(v, true, steps, &seen);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::equal(got[i], want[i]));
  }
  // Steps 1..4 were deferred and applied by the await.
  CHECK(seen == std::vector<std::string>{"deferred", "applied", "deferred", "applied", "deferred",
                                         "applied", "deferred", "applied"});
}

}  // namespace

TEST_CASE(
    "with overlap_next_forward every step is applied in the next forward, bit for bit as step()") {
  SUBCASE("SGD with momentum and weight decay, zero_grad() to none") { check_same({}); }
  SUBCASE("Adam") { check_same({.adam = true}); }
  SUBCASE("gradients zeroed in place by the loop") { check_same({.zero = 1}); }
  SUBCASE("no zero_grad() in the loop") { check_same({.zero = 2}); }
  SUBCASE("gradients copied in and out of the buckets") { check_same({.view = false}); }
  SUBCASE("set_denominator after backward") { check_same({.denominator = true}); }
  SUBCASE("two backward passes per step") { check_same({.two_passes = true}); }
  SUBCASE("an optimizer that also holds a parameter outside the module") {
    check_same({.outside = true});
  }
  SUBCASE("through the transport instead of shared memory") {
    check_same({.shared_memory = false});
  }
  SUBCASE("PowerSGD rank 1 with error feedback, compressing from step 1") {
    check_same({.algorithm = PowerSGD{.rank = 1, .min_compression_rate = 0, .start_iter = 1}});
  }
  SUBCASE("top-k with error feedback") { check_same({.algorithm = Sparsification{}}); }
  SUBCASE("wide layers: a gradient in shared memory, reduced where autograd put it") {
    check_same({.hidden = 160});
  }
  SUBCASE("wide layers, Adam") { check_same({.adam = true, .hidden = 160}); }
  SUBCASE("wide layers, gradients zeroed in place") { check_same({.zero = 1, .hidden = 160}); }
  SUBCASE("wide layers, no zero_grad()") { check_same({.zero = 2, .hidden = 160}); }
  SUBCASE("wide layers, set_denominator after backward") {
    check_same({.denominator = true, .hidden = 160});
  }
  SUBCASE("wide layers, two backward passes per step") {
    check_same({.two_passes = true, .hidden = 160});
  }
}

TEST_CASE("a forward that uses a layer without awaiting it is an error naming the parameter") {
  torch::set_num_threads(1);
  for (const std::string skip : {"fc3", "fc1"}) {
    CAPTURE(skip);
    auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
      auto model = std::make_shared<Net>();
      torch::optim::SGD opt(model->parameters(), 0.1);
      DdpOptions o;
      o.name = "net";
      o.bucket_bytes = 160;
      o.first_bucket_bytes = 160;
      o.bucket_split_gap = std::chrono::microseconds(0);
      o.overlap_next_forward = true;
      DistributedModule ddp(rt, model, GradientAllReduce{}, o);
      for (int s = 0; s < 2; ++s) {
        torch::mse_loss(model->forward(draw(s + r, 4, 6)), draw(50 + s, 4, 3)).backward();
        ddp.step(opt);
      }
      // Step 1 is deferred: the forward of step 2 uses `skip` before its update. backward says
      // so at that layer's first gradient (fc3's is the first; fc1's comes after fc3's and
      // fc2's gradients have stepped what was left).
      auto loss = torch::mse_loss(model->forward(draw(9 + r, 4, 6), skip), draw(59, 4, 3));
      std::string what;
      try {
        loss.backward();
      } catch (const comm::Error& e) {
        what = e.what();
      }
      CHECK(what.rfind("step 2: the forward used parameter '" + skip + ".", 0) == 0);
      CHECK(what.find("' of module 'net' before its update from step 1 "
                      "(DdpOptions.overlap_next_forward: expected the model's forward to call "
                      "troupe::await_parameters(layer) before each layer)") != std::string::npos);
    });
    for (auto& e : errors) CHECK(e == "");
  }
}

TEST_CASE(
    "a module destroyed with its last step deferred awaits the reductions and leaves the step "
    "unapplied") {
  torch::set_num_threads(1);
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    // Rank 1 runs its last backward only once rank 0 has returned from its last step(): rank 0's
    // module is then destroyed while that step's reductions wait for rank 1.
    std::promise<void> stepped;
    auto last_step_done = stepped.get_future().share();
    auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
      auto model = std::make_shared<Net>();
      torch::optim::SGD opt(model->parameters(), 0.1);
      DdpOptions o;
      o.overlap_next_forward = true;
      o.shared_memory = shared;
      o.stall_timeout = std::chrono::seconds(5);
      std::optional<DistributedModule> ddp;
      ddp.emplace(rt, model, GradientAllReduce{}, o);
      for (int s = 0; s < 3; ++s) {
        if (r == 1 && s == 2) last_step_done.wait();
        torch::mse_loss(model->forward(draw(s + r, 4, 6)), draw(50 + s, 4, 3)).backward();
        ddp->step(opt);
      }
      if (r == 0) {
        const auto after = model->fc1->weight.clone();
        stepped.set_value();
        ddp.reset();
        CHECK(torch::equal(model->fc1->weight, after));  // the step was not applied
      } else {
        ddp->await_parameters();  // its reductions completed with rank 0's
        ddp.reset();
      }
      // The module is released: a new one wraps it, and trains.
      DistributedModule again(rt, model);
      torch::mse_loss(model->forward(draw(7 + r, 4, 6)), draw(57, 4, 3)).backward();
      again.step(opt);
    });
    for (auto& e : errors) CHECK(e == "");
  }
}

TEST_CASE(
    "overlap_next_forward with join, weight averaging or an elastic trainer is refused naming the "
    "option") {
  torch::set_num_threads(1);
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    auto model = std::make_shared<Net>();
    DdpOptions o;
    o.overlap_next_forward = true;
    o.join = true;
    CHECK_THROWS_WITH_AS(DistributedModule(rt, model, GradientAllReduce{}, o),
                         "DdpOptions.overlap_next_forward with join (expected agg_grad = true and "
                         "no join: the optimizer steps each bucket's reduced gradients during the "
                         "next forward)",
                         comm::Error);
    o.join = false;
    o.agg_grad = false;
    CHECK_THROWS_WITH_AS(DistributedModule(rt, model, GradientAllReduce{}, o),
                         doctest::Contains("DdpOptions.overlap_next_forward with agg_grad = false"),
                         comm::Error);
    o.agg_grad = true;
    torch::optim::SGD opt(model->parameters(), 0.1);
    CHECK_THROWS_WITH_AS(ElasticTrainer(rt, model, opt, GradientAllReduce{}, o),
                         "ElasticTrainer with DdpOptions.overlap_next_forward (expected it off: an "
                         "elastic step is applied before it returns)",
                         comm::Error);
    // Without a module that defers, await_parameters returns at once.
    await_parameters(model->fc1);
  });
  for (auto& e : errors) CHECK(e == "");
}
