// examples/dcgan's training loop (pytorch/examples' cpp/dcgan with only the wrapping added) on two
// thread ranks against one process that plays both ranks as PyTorch DDP defines them: after each
// backward pass, every replica's gradients of the modules it reached become the mean over the
// replicas, and their buffers rank 0's. Weights, buffers and losses agree bit for bit.
#include <memory>
#include <vector>

#include "examples/dcgan/gan.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;
using namespace troupe::examples::dcgan;

namespace {

constexpr int kWorld = 2;

GanOptions small() {
  GanOptions o;
  o.batch = 8;
  o.steps = 6;
  return o;
}

torch::Tensor images() {
  torch::manual_seed(42);
  return torch::rand({64, 1, 28, 28}) * 2 - 1;
}

struct Pair {
  Generator g;
  Discriminator d;
};

Pair make_pair(const GanOptions& o, uint64_t seed) {
  torch::manual_seed(seed);
  return {Generator(o.noise_size, o.channels), Discriminator(o.channels)};
}

void average_gradients(const std::vector<torch::nn::Module*>& replicas) {
  torch::NoGradGuard no_grad;
  auto p0 = replicas[0]->parameters(), p1 = replicas[1]->parameters();
  for (size_t i = 0; i < p0.size(); ++i) {
    auto mean = (p0[i].grad() + p1[i].grad()) * 0.5;
    p0[i].mutable_grad().copy_(mean);
    p1[i].mutable_grad().copy_(mean);
  }
}

void buffers_from_rank0(const std::vector<torch::nn::Module*>& replicas) {
  torch::NoGradGuard no_grad;
  auto b0 = replicas[0]->buffers(), b1 = replicas[1]->buffers();
  for (size_t i = 0; i < b0.size(); ++i) b1[i].copy_(b0[i]);
}

struct Reference {
  std::vector<Pair> models;
  std::vector<std::vector<StepLosses>> losses;
};

// The loop of examples/dcgan/gan.cpp, written out for both replicas in one process.
Reference reference(const GanOptions& o, const torch::Tensor& data) {
  Reference ref;
  ref.losses.resize(kWorld);
  std::vector<std::unique_ptr<torch::optim::Adam>> g_opt, d_opt;
  const auto adam = torch::optim::AdamOptions(o.lr).betas({o.beta1, 0.999});
  for (int r = 0; r < kWorld; ++r) {
    ref.models.push_back(make_pair(o, 0));  // rank 0's initial weights
    g_opt.push_back(std::make_unique<torch::optim::Adam>(ref.models[r].g->parameters(), adam));
    d_opt.push_back(std::make_unique<torch::optim::Adam>(ref.models[r].d->parameters(), adam));
  }
  std::vector<torch::nn::Module*> gs{ref.models[0].g.ptr().get(), ref.models[1].g.ptr().get()};
  std::vector<torch::nn::Module*> ds{ref.models[0].d.ptr().get(), ref.models[1].d.ptr().get()};
  const auto real_labels = torch::full({o.batch}, 0.9);
  const auto fake_labels = torch::zeros({o.batch});
  for (int s = 0; s < o.steps; ++s) {
    std::vector<torch::Tensor> fake(kWorld), d_real(kWorld), d_fake(kWorld), g_loss(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      auto& m = ref.models[r];
      m.d->zero_grad();
      d_real[r] =
          torch::binary_cross_entropy(m.d->forward(real_batch(data, o, s, r, kWorld)), real_labels);
      d_real[r].backward();
    }
    average_gradients(ds);
    buffers_from_rank0(ds);
    for (int r = 0; r < kWorld; ++r) {
      auto& m = ref.models[r];
      fake[r] = m.g->forward(noise_batch(o, s, r));
      d_fake[r] = torch::binary_cross_entropy(m.d->forward(fake[r].detach()), fake_labels);
      d_fake[r].backward();
    }
    average_gradients(ds);
    buffers_from_rank0(ds);
    for (int r = 0; r < kWorld; ++r) d_opt[r]->step();
    for (int r = 0; r < kWorld; ++r) {
      auto& m = ref.models[r];
      m.g->zero_grad();
      g_loss[r] = torch::binary_cross_entropy(m.d->forward(fake[r]), torch::ones({o.batch}));
      g_loss[r].backward();
    }
    average_gradients(ds);  // the generator's backward reaches the discriminator too
    buffers_from_rank0(ds);
    average_gradients(gs);
    buffers_from_rank0(gs);
    for (int r = 0; r < kWorld; ++r) g_opt[r]->step();
    for (int r = 0; r < kWorld; ++r)
      ref.losses[r].push_back(
          {d_real[r].item<double>() + d_fake[r].item<double>(), g_loss[r].item<double>()});
  }
  return ref;
}

void check_same(torch::nn::Module& got, torch::nn::Module& want, const char* what, int rank) {
  auto gp = got.named_parameters(), wp = want.named_parameters();
  REQUIRE(gp.size() == wp.size());
  for (size_t i = 0; i < gp.size(); ++i) {
    INFO("rank " << rank << ", " << what << " parameter " << gp[i].key());
    CHECK(torch::equal(gp[i].value(), wp[i].value()));
  }
  auto gb = got.named_buffers(), wb = want.named_buffers();
  REQUIRE(gb.size() == wb.size());
  for (size_t i = 0; i < gb.size(); ++i) {
    INFO("rank " << rank << ", " << what << " buffer " << gb[i].key());
    CHECK(torch::equal(gb[i].value(), wb[i].value()));
  }
}

}  // namespace

TEST_CASE(
    "the DCGAN loop on two ranks equals one process averaging each backward pass, bit for bit, "
    "buffers included") {
  torch::set_num_threads(1);
  const auto o = small();
  const auto data = images();
  auto ref = reference(o, data);
  // Rank 1 starts from other weights: the wrapping gives it rank 0's.
  std::vector<Pair> ranks{make_pair(o, 0), make_pair(o, 1)};
  std::vector<std::vector<StepLosses>> losses(kWorld);
  auto errors = test::run_threads(kWorld, [&](int r, Runtime& rt) {
    auto& m = ranks[static_cast<size_t>(r)];
    losses[static_cast<size_t>(r)] = train(rt, m.g, m.d, data, o);
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < kWorld; ++r) {
    check_same(*ranks[r].g, *ref.models[0].g, "generator", r);
    check_same(*ranks[r].d, *ref.models[0].d, "discriminator", r);
    REQUIRE(losses[r].size() == static_cast<size_t>(o.steps));
    for (int s = 0; s < o.steps; ++s) {
      INFO("rank " << r << ", step " << s);
      CHECK(losses[r][s].discriminator == ref.losses[r][s].discriminator);
      CHECK(losses[r][s].generator == ref.losses[r][s].generator);
    }
  }
  // The losses moved: the run trained rather than standing still.
  CHECK(losses[0].front().generator != losses[0].back().generator);
}
