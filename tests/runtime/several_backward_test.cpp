// Several backward passes before one step() (a GAN's discriminator on real, then on fake images):
// each is averaged over the ranks as PyTorch DDP averages it, and the gradients accumulate onto
// the averages. Compared bit for bit with one process that plays both ranks and averages every
// replica's gradient after each backward pass (two ranks: a two-term sum has one order).
#include <memory>
#include <string>
#include <vector>

#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "tests/support/ddp_reference.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

#include <ATen/CPUGeneratorImpl.h>

using namespace troupe;

namespace {

using test::copy_params;
using test::Mlp;
using test::run_threads;

constexpr int kWorld = 2;
constexpr int kSteps = 3;

struct Variant {
  bool view = true;         // DdpOptions::gradient_as_bucket_view
  bool set_to_none = true;  // zero_grad sets gradients to none (else zeroes them in place)
  bool partial = false;     // the second backward pass reaches fc2 and fc3 only
};

// Rank r's inputs and targets of backward pass k of step s, each from a private generator: the
// thread ranks draw them at once, and torch's global generator is one for all threads.
torch::Tensor draw(uint64_t seed, int64_t rows, int64_t cols) {
  return torch::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(seed));
}
torch::Tensor input(int s, int k, int r, int64_t width) {
  return draw(1000 + s * 100 + k * 10 + r, 4, width);
}
torch::Tensor target(int s, int k, int r) { return draw(5000 + s * 100 + k * 10 + r, 4, 3); }

torch::Tensor loss_of(Mlp& m, int s, int k, int r, bool partial) {
  if (k == 1 && partial)
    return torch::mse_loss(m.fc3(torch::relu(m.fc2(input(s, k, r, 8)))), target(s, k, r));
  return torch::mse_loss(m.forward(input(s, k, r, 6)), target(s, k, r));
}

void zero(Mlp& m, torch::optim::Optimizer& opt, bool set_to_none) {
  if (set_to_none) {
    m.zero_grad(/*set_to_none=*/true);
  } else {
    for (auto& p : m.parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  (void)opt;
}

// What PyTorch DDP computes, in one process: after each backward pass every replica's gradient
// becomes the mean of the replicas' gradients (parameters a pass did not reach keep theirs).
std::vector<torch::Tensor> reference(const std::shared_ptr<Mlp>& init, const Variant& v) {
  std::vector<std::shared_ptr<Mlp>> replicas;
  std::vector<std::unique_ptr<torch::optim::Adam>> opts;
  for (int r = 0; r < kWorld; ++r) {
    replicas.push_back(std::make_shared<Mlp>(6, 8, 3));
    copy_params(init, replicas.back());
    opts.push_back(std::make_unique<torch::optim::Adam>(replicas.back()->parameters(),
                                                        torch::optim::AdamOptions(0.01)));
  }
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < kWorld; ++r) zero(*replicas[r], *opts[r], v.set_to_none);
    for (int k = 0; k < 2; ++k) {
      for (int r = 0; r < kWorld; ++r) loss_of(*replicas[r], s, k, r, v.partial).backward();
      torch::NoGradGuard no_grad;
      auto p0 = replicas[0]->parameters(), p1 = replicas[1]->parameters();
      for (size_t i = 0; i < p0.size(); ++i) {
        if (!p0[i].grad().defined()) continue;
        auto mean = (p0[i].grad() + p1[i].grad()) * 0.5;
        p0[i].mutable_grad().copy_(mean);
        p1[i].mutable_grad().copy_(mean);
      }
    }
    for (int r = 0; r < kWorld; ++r) opts[r]->step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : replicas[0]->parameters()) out.push_back(p.detach().clone());
  return out;
}

void check_variant(const Variant& v) {
  torch::set_num_threads(1);
  torch::manual_seed(3);
  auto init = std::make_shared<Mlp>(6, 8, 3);
  const auto want = reference(init, v);
  std::vector<std::vector<torch::Tensor>> got(kWorld);
  auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    if (r == 0) copy_params(init, model);  // rank 0's weights become everyone's
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    DdpOptions o;
    o.gradient_as_bucket_view = v.view;
    o.find_unused_parameters = v.partial;
    o.bucket_bytes = 256;  // several buckets, some reducing while backward runs
    o.first_bucket_bytes = 128;
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    for (int s = 0; s < kSteps; ++s) {
      zero(*model, opt, v.set_to_none);
      loss_of(*model, s, 0, r, v.partial).backward();
      loss_of(*model, s, 1, r, v.partial).backward();
      ddp.step(opt);
    }
    for (auto& p : model->parameters()) got[static_cast<size_t>(r)].push_back(p.detach().clone());
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < kWorld; ++r) {
    REQUIRE(got[r].size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("rank " << r << ", parameter " << i);
      CHECK(torch::equal(got[r][i], want[i]));
    }
  }
}

}  // namespace

TEST_CASE(
    "several backward passes per step are each averaged, as PyTorch DDP averages them, bit for "
    "bit") {
  SUBCASE("gradients set to none, gradient_as_bucket_view") { check_variant({true, true, false}); }
  SUBCASE("gradients zeroed in place, gradient_as_bucket_view") {
    check_variant({true, false, false});
  }
  SUBCASE("gradients set to none, copied in and out of the buckets") {
    check_variant({false, true, false});
  }
  SUBCASE("gradients zeroed in place, copied in and out of the buckets") {
    check_variant({false, false, false});
  }
  SUBCASE("a second pass that reaches part of the model (find_unused_parameters)") {
    check_variant({true, true, true});
  }
}

TEST_CASE(
    "a backward pass that leaves parameters without a gradient is named at step(), with the "
    "module") {
  torch::set_num_threads(1);
  auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.name = "critic";
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    loss_of(*model, 0, 0, r, false).backward();
    loss_of(*model, 0, 1, r, /*partial=*/true).backward();
    CHECK_THROWS_WITH_AS(ddp.step(opt),
                         "step 0: parameter(s) without a gradient: fc1.weight, fc1.bias of module "
                         "'critic' (use DdpOptions.find_unused_parameters to reduce them as zeros)",
                         comm::Error);
    // Its reductions never ran: a further backward pass is refused rather than summed into them.
    CHECK_THROWS_WITH_AS(loss_of(*model, 0, 2, r, false).backward(),
                         doctest::Contains("' of module 'critic' became ready twice before "
                                           "step(): the "
                                           "previous backward pass left parameter(s) without a "
                                           "gradient"),
                         comm::Error);
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE(
    "step() twice without a backward between says so, without suggesting find_unused_parameters") {
  torch::set_num_threads(1);
  auto errors = run_threads(kWorld, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DistributedModule ddp(rt, model);  // named after its type
    loss_of(*model, 0, 0, r, false).backward();
    ddp.step(opt);
    const auto before = model->fc1->weight.clone();
    try {
      ddp.step(opt);
      FAIL("a second step() was accepted");
    } catch (const comm::Error& e) {
      const std::string what = e.what();
      CHECK(what ==
            "step 1 of module 'troupe::test::Mlp': step() without a backward pass since "
            "the previous step() (a second step() in a row?); expected loss.backward() "
            "before each step()");
      CHECK(what.find("find_unused_parameters") == std::string::npos);
    }
    CHECK(torch::equal(model->fc1->weight, before));  // no silent extra step
    loss_of(*model, 1, 0, r, false).backward();       // and training goes on
    ddp.step(opt);
  });
  for (auto& e : errors) CHECK(e == "");
}
