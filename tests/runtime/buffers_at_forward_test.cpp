// Buffers (BatchNorm's running statistics) stay equal across ranks as a program goes on past a
// step: a forward and backward pass that is no step's (a GAN's generator phase through the
// discriminator) leaves every rank with rank 0's buffers, as the next forward of PyTorch DDP would
// see them; DdpOptions::broadcast_buffers = false leaves each rank its own.
#include <memory>
#include <vector>

#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

#include <ATen/CPUGeneratorImpl.h>

using namespace troupe;

namespace {

struct BnNet : torch::nn::Module {
  BnNet() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

torch::Tensor batch(int s, int r) {
  // A private generator: the thread ranks draw at once.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * s + r);
  return torch::randn({8, 6}, gen) * (r + 1) + r;  // the ranks' statistics differ
}

// Each rank's buffers after 3 steps and one more forward and backward pass with no step.
std::vector<std::vector<torch::Tensor>> buffers_after(bool broadcast) {
  torch::set_num_threads(1);
  std::vector<std::vector<torch::Tensor>> out(2);
  auto errors = test::run_threads(2, [&](int r, Runtime& rt) {
    auto net = std::make_shared<BnNet>();
    torch::optim::SGD opt(net->parameters(), 0.1);
    DdpOptions o;
    o.broadcast_buffers = broadcast;
    DistributedModule ddp(rt, net, GradientAllReduce{}, o);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      net->forward(batch(s, r)).square().mean().backward();
      ddp.step(opt);
    }
    net->forward(batch(3, r)).square().mean().backward();  // no step: the generator's phase
    for (auto& b : net->buffers()) out[static_cast<size_t>(r)].push_back(b.clone());
  });
  for (auto& e : errors) CHECK(e == "");
  return out;
}

}  // namespace

TEST_CASE(
    "a forward and backward pass after the last step leaves every rank with rank 0's buffers") {
  auto b = buffers_after(true);
  REQUIRE(b[0].size() == 3);  // running_mean, running_var, num_batches_tracked
  REQUIRE(b[1].size() == 3);
  for (size_t i = 0; i < b[0].size(); ++i) {
    INFO("buffer " << i);
    CHECK(torch::equal(b[0][i], b[1][i]));
  }
  CHECK(b[0][2].item<int64_t>() == 4);
}

TEST_CASE("broadcast_buffers off leaves each rank the running statistics of its own batches") {
  auto b = buffers_after(false);
  REQUIRE(b[0].size() == 3);
  CHECK_FALSE(torch::equal(b[0][0], b[1][0]));
  CHECK_FALSE(torch::equal(b[0][1], b[1][1]));
}
