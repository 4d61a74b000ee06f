// The optimizers of algorithms/optim/ against references written here with plain tensor ops:
// SignSGD (alone and under a majority-vote DistributedModule), SparsifiedSGD and its centralized
// version, optim::PowerSGD; and their argument checks. Ranks are threads over inproc.
#include <algorithm>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "algorithms/optim/power_sgd.h"
#include "algorithms/optim/sign_sgd.h"
#include "algorithms/optim/sparsified_sgd.h"
#include "comm/status.h"
#include "ddp/distributed_module.h"
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
    fc2 = register_module("fc2", torch::nn::Linear(8, 8));
    fc3 = register_module("fc3", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// SignSGD's rule, step by step, on plain tensors.
struct ReferenceSign {
  double lr, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  std::vector<torch::Tensor> bufs;

  void step(std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads) {
    bufs.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor d = grads[i] + weight_decay * params[i];
      if (momentum != 0) {
        bufs[i] = bufs[i].defined() ? momentum * bufs[i] + (1 - dampening) * d : d.clone();
        d = nesterov ? d + momentum * bufs[i] : bufs[i];
      }
      params[i] = params[i] - lr * torch::sign(d);
    }
  }
};

// One rank's share of SparsifiedSGD: v = memory + lr (g + wd p); c = the k largest |v|.
torch::Tensor top_k_update(torch::Tensor& memory, const torch::Tensor& grad, const torch::Tensor& p,
                           double lr, double wd, int64_t k) {
  torch::Tensor v = (memory + lr * (grad + wd * p)).flatten();
  auto keep = torch::zeros_like(v, torch::kBool);
  keep.index_put_({std::get<1>(v.abs().topk(k))}, true);
  torch::Tensor c = torch::where(keep, v, torch::zeros_like(v));
  memory = (v - c).view(p.sizes());
  return c.view(p.sizes());
}

// sum_t w_t x_t / sum_t w_t with w_t = (a + t)^2.
std::vector<torch::Tensor> weighted_average(const std::vector<std::vector<torch::Tensor>>& iterates,
                                            double a) {
  std::vector<torch::Tensor> sum;
  double weights = 0;
  for (size_t t = 0; t < iterates.size(); ++t) {
    const double w = (a + static_cast<double>(t)) * (a + static_cast<double>(t));
    weights += w;
    for (size_t i = 0; i < iterates[t].size(); ++i) {
      auto term = iterates[t][i].to(torch::kDouble) * w;
      if (sum.size() <= i)
        sum.push_back(term);
      else
        sum[i] = sum[i] + term;
    }
  }
  for (auto& s : sum) s = (s / weights).to(torch::kFloat);
  return sum;
}

}  // namespace

TEST_CASE(
    "SignSGD follows the closed-form update with momentum, dampening, nesterov and weight decay") {
  struct Config {
    std::string name;
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const auto& c :
       {Config{"plain", 0, 0, 0, false}, Config{"momentum", 0.9, 0, 0, false},
        Config{"momentum with dampening", 0.8, 0.3, 0, false}, Config{"nesterov", 0.9, 0, 0, true},
        Config{"weight decay and momentum", 0.5, 0.1, 0.05, false},
        Config{"nesterov and weight decay", 0.7, 0, 0.1, true}}) {
    CAPTURE(c.name);
    torch::manual_seed(3);
    std::vector<torch::Tensor> params = {torch::randn({5, 4}), torch::randn({7})};
    auto want = clones(params);
    for (auto& p : params) p.requires_grad_(true);
    optim::SignSGD opt(params, optim::SignSgdOptions(0.05)
                                   .momentum(c.momentum)
                                   .dampening(c.dampening)
                                   .weight_decay(c.weight_decay)
                                   .nesterov(c.nesterov));
    ReferenceSign ref{0.05, c.momentum, c.dampening, c.weight_decay, c.nesterov, {}};
    for (int s = 0; s < 4; ++s) {
      std::vector<torch::Tensor> grads = {torch::randn({5, 4}), torch::randn({7})};
      grads[0][0][0] = 0.0f;  // sign(0) = 0: no move without momentum or decay
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
      opt.step();
      ref.step(want, grads);
    }
    CHECK(max_diff(params, want) < 1e-6);
    if (c.momentum == 0 && c.weight_decay == 0)
      CHECK(params[0][0][0].item<float>() == want[0][0][0].item<float>());
  }
}

TEST_CASE("SignSGD's momentum buffers survive torch::save and torch::load") {
  torch::manual_seed(4);
  auto a = torch::randn({6}).requires_grad_(true);
  auto b = a.detach().clone().requires_grad_(true);
  optim::SignSGD first({a}, optim::SignSgdOptions(0.1).momentum(0.9));
  a.mutable_grad() = torch::randn({6});
  first.step();
  std::stringstream saved;
  torch::save(first, saved);
  {
    torch::NoGradGuard no_grad;
    b.copy_(a);
  }
  optim::SignSGD second({b}, optim::SignSgdOptions(0.1).momentum(0.9));
  torch::load(second, saved);
  // A gradient opposite to the first: only a restored buffer keeps the first direction.
  auto g = -0.5 * a.grad();
  a.mutable_grad() = g.clone();
  b.mutable_grad() = g.clone();
  first.step();
  second.step();
  CHECK((a - b).abs().max().item<double>() == 0);
}

TEST_CASE("3 ranks voting by sign and stepping SignSGD match one process that votes by hand") {
  torch::set_num_threads(1);
  torch::manual_seed(7);
  const int world = 3, steps = 4;
  const int64_t batch = 4;
  std::vector<std::shared_ptr<Mlp>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
  auto reference = std::make_shared<Mlp>();
  copy_params(*replicas[0], *reference);  // rank 0's weights are broadcast to everyone
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < steps; ++s) {
    xs.push_back(torch::randn({world * batch, 6}));
    ys.push_back(torch::randn({world * batch, 3}));
  }
  auto options = optim::SignSgdOptions(0.01).momentum(0.9).weight_decay(0.01);
  ReferenceSign ref{0.01, 0.9, 0, 0.01, false, {}};
  auto want = clones(reference->parameters());
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> votes;
    for (int r = 0; r < world; ++r) {
      reference->zero_grad();
      torch::mse_loss(reference->forward(xs[s].narrow(0, r * batch, batch)),
                      ys[s].narrow(0, r * batch, batch))
          .backward();
      auto ps = reference->parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        // The codec's sign: zero counts as positive.
        auto sign = torch::where(ps[i].grad() < 0, -1.0f, 1.0f);
        if (votes.size() <= i)
          votes.push_back(sign);
        else
          votes[i] = votes[i] + sign;
      }
    }
    for (auto& v : votes) v = torch::sign(v);
    ref.step(want, votes);
    {
      torch::NoGradGuard no_grad;
      auto ps = reference->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(want[i]);
    }
  }
  std::vector<double> diffs(world, 1e9);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    optim::SignSGD opt(model->parameters(), options);
    DistributedModule ddp(rt, model, SignCompression{SignMode::majority_vote, false});
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(xs[s].narrow(0, r * batch, batch)),
                      ys[s].narrow(0, r * batch, batch))
          .backward();
      ddp.step(opt);
    }
    diffs[static_cast<size_t>(r)] = max_diff(model->parameters(), want);
  });
  for (auto& e : errors) CHECK(e == "");
  for (double d : diffs) CHECK(d < 1e-6);
}

TEST_CASE("SparsifiedSGD applies the k largest coordinates of v and keeps the rest in memory") {
  torch::manual_seed(5);
  std::vector<torch::Tensor> params = {torch::randn({4, 5}), torch::randn({7})};
  auto want = clones(params);
  for (auto& p : params) p.requires_grad_(true);
  const double lr = 0.5, wd = 0.1;
  optim::SparsifiedSGD opt(params, optim::SparsifiedSgdOptions(lr).weight_decay(wd).count(3));
  CHECK(opt.kept_per_step() == 6);
  std::vector<torch::Tensor> memory = {torch::zeros({4, 5}), torch::zeros({7})};
  for (int s = 0; s < 4; ++s) {
    std::vector<torch::Tensor> grads = {torch::randn({4, 5}), torch::randn({7})};
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
    auto before = clones(params);
    opt.step();
    for (size_t i = 0; i < params.size(); ++i) {
      auto c = top_k_update(memory[i], grads[i], want[i], lr, wd, 3);
      want[i] = want[i] - c;
      // Exactly k coordinates moved, by v's values there.
      CHECK((params[i] != before[i]).sum().item<int64_t>() == 3);
    }
    CHECK(max_diff(params, want) < 1e-6);
    CHECK(max_diff(opt.memory(), memory) < 1e-6);
  }
}

TEST_CASE(
    "SparsifiedSGD's random-k and block modes move k coordinates; a block wraps around the end") {
  const int64_t n = 10, k = 4;
  bool wrapped = false;
  for (uint64_t seed = 0; seed < 64; ++seed) {
    for (auto mode : {comm::SparseMode::random_k, comm::SparseMode::block}) {
      CAPTURE(seed);
      auto p = torch::randn({n}).requires_grad_(true);
      auto before = p.detach().clone();
      auto grad = torch::rand({n}) + 0.5;  // no zeros: every chosen coordinate moves
      p.mutable_grad() = grad.clone();
      optim::SparsifiedSGD opt({p},
                               optim::SparsifiedSgdOptions(1.0).count(k).mode(mode).seed(seed));
      opt.step();
      auto moved = (p.detach() != before);
      CHECK(moved.sum().item<int64_t>() == k);
      // What moved is what memory does not hold: memory == v - c.
      auto v = grad;
      CHECK((opt.memory()[0] - torch::where(moved, torch::zeros_like(v), v))
                .abs()
                .max()
                .item<double>() == 0);
      CHECK((before - p.detach() - torch::where(moved, v, torch::zeros_like(v)))
                .abs()
                .max()
                .item<double>() < 1e-6);
      if (mode != comm::SparseMode::block) continue;
      // A block: k coordinates in a row, cyclically.
      int64_t starts = 0;
      for (int64_t i = 0; i < n; ++i)
        starts += moved[i].item<bool>() && !moved[(i + n - 1) % n].item<bool>();
      CHECK(starts == 1);
      if (moved[n - 1].item<bool>() && moved[0].item<bool>()) wrapped = true;
    }
  }
  CHECK(wrapped);  // some seed started the block within k-1 of the end
}

TEST_CASE("SparsifiedSGD's estimated weights are the (a + t)^2-weighted average of the iterates") {
  for (double shift : {0.0, 2.0}) {
    CAPTURE(shift);
    torch::manual_seed(6);
    std::vector<torch::Tensor> params = {torch::randn({4, 5}), torch::randn({7})};
    for (auto& p : params) p.requires_grad_(true);
    optim::SparsifiedSGD opt(params,
                             optim::SparsifiedSgdOptions(0.3).count(3).average_shift(shift));
    const double a = shift > 0 ? shift : 27.0 / 6.0;  // d / k
    CHECK(opt.average_shift() == doctest::Approx(a));
    CHECK(max_diff(opt.estimated_weights(), params) == 0);
    std::vector<std::vector<torch::Tensor>> iterates;
    for (int s = 0; s < 4; ++s) {
      for (auto& p : params) p.mutable_grad() = torch::randn(p.sizes());
      opt.step();
      iterates.push_back(clones(params));
      CHECK(max_diff(opt.estimated_weights(), weighted_average(iterates, a)) < 1e-5);
    }
    CHECK(max_diff(opt.estimated_weights(), params) > 1e-3);  // an average, not the last iterate
  }
}

TEST_CASE(
    "CentralizedSparsifiedSGD on 3 ranks keeps identical parameters equal to a simulation of all "
    "ranks") {
  torch::set_num_threads(1);
  torch::manual_seed(8);
  const int world = 3, steps = 4;
  const int64_t batch = 5, k = 4;
  const double lr = 0.2, wd = 0.01;
  std::vector<torch::nn::Linear> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(torch::nn::Linear(6, 4));
  torch::nn::Linear reference(6, 4);
  copy_params(*replicas[0], *reference);  // the optimizer broadcasts rank 0's parameters
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < steps; ++s) {
    xs.push_back(torch::randn({world * batch, 6}));
    ys.push_back(torch::randn({world * batch, 4}));
  }
  // Every rank's memory, and the average of their sparse updates.
  auto want = clones(reference->parameters());
  std::vector<std::vector<torch::Tensor>> memory(world);
  for (auto& m : memory)
    for (const auto& p : want) m.push_back(torch::zeros_like(p));
  std::vector<std::vector<torch::Tensor>> iterates;
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> sum;
    for (int r = 0; r < world; ++r) {
      reference->zero_grad();
      torch::mse_loss(reference->forward(xs[s].narrow(0, r * batch, batch)),
                      ys[s].narrow(0, r * batch, batch))
          .backward();
      auto ps = reference->parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        auto c = top_k_update(memory[r][i], ps[i].grad(), want[i], lr, wd, k);
        if (sum.size() <= i)
          sum.push_back(c);
        else
          sum[i] = sum[i] + c;
      }
    }
    torch::NoGradGuard no_grad;
    auto ps = reference->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      want[i] = want[i] - sum[i] / world;
      ps[i].copy_(want[i]);
    }
    iterates.push_back(clones(want));
  }
  const double a = 28.0 / 8.0;  // d = 24 + 4, k = 4 per tensor
  auto want_average = weighted_average(iterates, a);
  std::vector<std::vector<torch::Tensor>> finals(world);
  std::vector<double> diffs(world, 1e9), average_diffs(world, 1e9);
  auto errors = run_threads(world, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    optim::CentralizedSparsifiedSGD opt(rt, model->parameters(),
                                        optim::SparsifiedSgdOptions(lr).weight_decay(wd).count(k));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(xs[s].narrow(0, r * batch, batch)),
                      ys[s].narrow(0, r * batch, batch))
          .backward();
      opt.step();
    }
    finals[r] = clones(model->parameters());
    diffs[r] = max_diff(model->parameters(), want);
    average_diffs[r] = max_diff(opt.estimated_weights(), want_average);
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(diffs[r] < 1e-6);
    CHECK(average_diffs[r] < 1e-5);
    CHECK(max_diff(finals[r], finals[0]) == 0);
  }
}

TEST_CASE(
    "optim::PowerSGD on 2 ranks keeps identical parameters, and before start_iter is SGD on the "
    "whole batch") {
  torch::set_num_threads(1);
  const int world = 2, steps = 4;
  const int64_t batch = 4;
  for (uint32_t start_iter : {0u, 100u}) {
    CAPTURE(start_iter);
    torch::manual_seed(9);
    std::vector<std::shared_ptr<Mlp>> replicas;
    for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>());
    auto reference = std::make_shared<Mlp>();
    copy_params(*replicas[0], *reference);
    std::vector<torch::Tensor> xs, ys;
    for (int s = 0; s < steps; ++s) {
      xs.push_back(torch::randn({world * batch, 6}));
      ys.push_back(torch::randn({world * batch, 3}));
    }
    torch::optim::SGD sgd(reference->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.001));
    for (int s = 0; s < steps; ++s) {
      sgd.zero_grad();
      torch::mse_loss(reference->forward(xs[s]), ys[s]).backward();
      sgd.step();
    }
    comm::PowerSGD algorithm;
    algorithm.rank = 1;
    algorithm.start_iter = start_iter;
    std::vector<std::vector<torch::Tensor>> finals(world);
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      optim::PowerSGD opt(
          rt, model,
          optim::PowerSgdOptimizerOptions(0.1).momentum(0.9).weight_decay(0.001).algorithm(
              algorithm));
      CHECK(opt.module().algorithm_name() == "powersgd(rank=1)");
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        torch::mse_loss(model->forward(xs[s].narrow(0, r * batch, batch)),
                        ys[s].narrow(0, r * batch, batch))
            .backward();
        opt.step();
      }
      finals[r] = clones(model->parameters());
    });
    for (auto& e : errors) CHECK(e == "");
    CHECK(max_diff(finals[1], finals[0]) == 0);
    const double from_sgd = max_diff(finals[0], reference->parameters());
    if (start_iter > steps)
      CHECK(from_sgd < 1e-5);
    else
      CHECK(from_sgd > 1e-4);  // rank-1 approximations of the 8x8 gradients
  }
}

TEST_CASE("a param group's own options are the ones its step uses, for SignSGD and SparsifiedSGD") {
  // LibTorch 2.x's add_param_group gives a group of an optimizer that is not its own a copy of
  // the defaults; troupe's optimizers keep what the caller gave each group.
  torch::manual_seed(9);
  auto a = torch::randn({5}).requires_grad_(true), b = torch::randn({5}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a});
  groups.emplace_back(std::vector<torch::Tensor>{b}, std::make_unique<optim::SignSgdOptions>(0.5));
  optim::SignSGD sign(groups, optim::SignSgdOptions(0.1));
  CHECK(sign.param_groups()[0].options().get_lr() == 0.1);
  CHECK(sign.param_groups()[1].options().get_lr() == 0.5);
  auto ga = torch::randn({5}), gb = torch::randn({5});
  auto want_a = (a - 0.1 * ga.sign()).detach(), want_b = (b - 0.5 * gb.sign()).detach();
  a.mutable_grad() = ga;
  b.mutable_grad() = gb;
  sign.step();
  CHECK(torch::equal(a, want_a));
  CHECK(torch::equal(b, want_b));

  // SparsifiedSGD: a group's own k (count) decides how many of its coordinates move.
  auto c = torch::randn({10}).requires_grad_(true), d = torch::randn({10}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> sparse_groups;
  sparse_groups.emplace_back(std::vector<torch::Tensor>{c});
  sparse_groups.emplace_back(
      std::vector<torch::Tensor>{d},
      std::make_unique<optim::SparsifiedSgdOptions>(optim::SparsifiedSgdOptions(0.2).count(4)));
  optim::SparsifiedSGD sparse(sparse_groups, optim::SparsifiedSgdOptions(0.2).count(1));
  CHECK(sparse.kept_per_step() == 5);
  auto c_before = c.detach().clone(), d_before = d.detach().clone();
  c.mutable_grad() = torch::randn({10});
  d.mutable_grad() = torch::randn({10});
  sparse.step();
  CHECK((c != c_before).sum().item<int64_t>() == 1);
  CHECK((d != d_before).sum().item<int64_t>() == 4);
}

TEST_CASE("bad optimizer arguments are rejected with a message naming them") {
  auto p = torch::randn({4}).requires_grad_(true);
  using optim::SignSgdOptions;
  using optim::SparsifiedSgdOptions;
  CHECK_THROWS_WITH_AS(optim::SignSGD({p}, SignSgdOptions(-0.1)),
                       "SignSgdOptions.lr=-0.1 (expected > 0)", comm::Error);
  CHECK_THROWS_WITH_AS(optim::SignSGD({p}, SignSgdOptions(0.1).momentum(-1)),
                       "SignSgdOptions.momentum=-1 (expected >= 0)", comm::Error);
  CHECK_THROWS_WITH_AS(optim::SignSGD({p}, SignSgdOptions(0.1).weight_decay(-0.5)),
                       "SignSgdOptions.weight_decay=-0.5 (expected >= 0)", comm::Error);
  CHECK_THROWS_WITH_AS(optim::SignSGD({p}, SignSgdOptions(0.1).nesterov(true)),
                       "SignSgdOptions.nesterov=true with momentum=0 and dampening=0 (expected "
                       "momentum > 0 and dampening = 0)",
                       comm::Error);
  CHECK_THROWS_WITH_AS(
      optim::SignSGD({p}, SignSgdOptions(0.1).nesterov(true).momentum(0.9).dampening(0.1)),
      "SignSgdOptions.nesterov=true with momentum=0.9 and dampening=0.1 (expected "
      "momentum > 0 and dampening = 0)",
      comm::Error);
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{p}, std::make_unique<SignSgdOptions>(-2));
    CHECK_THROWS_WITH_AS(optim::SignSGD(groups, SignSgdOptions(0.1)),
                         "SignSgdOptions.lr=-2 (expected > 0)", comm::Error);
  }

  CHECK_THROWS_WITH_AS(optim::SparsifiedSGD({p}, SparsifiedSgdOptions(-1)),
                       "SparsifiedSgdOptions.lr=-1 (expected > 0)", comm::Error);
  CHECK_THROWS_WITH_AS(optim::SparsifiedSGD({p}, SparsifiedSgdOptions(0.1).weight_decay(-1)),
                       "SparsifiedSgdOptions.weight_decay=-1 (expected >= 0)", comm::Error);
  CHECK_THROWS_WITH_AS(optim::SparsifiedSGD({p}, SparsifiedSgdOptions(0.1).ratio(0)),
                       "SparsifiedSgdOptions.ratio=0 with count=0 (expected 0 < ratio <= 1, or a "
                       "count > 0)",
                       comm::Error);
  CHECK_THROWS_WITH_AS(optim::SparsifiedSGD({p}, SparsifiedSgdOptions(0.1).ratio(1.5)),
                       "SparsifiedSgdOptions.ratio=1.5 with count=0 (expected 0 < ratio <= 1, or "
                       "a count > 0)",
                       comm::Error);
  CHECK_NOTHROW(optim::SparsifiedSGD({p}, SparsifiedSgdOptions(0.1).ratio(0).count(2)));
  CHECK_THROWS_WITH_AS(
      optim::SparsifiedSGD({p}, SparsifiedSgdOptions(0.1).average_shift(-1)),
      "SparsifiedSgdOptions.average_shift=-1 (expected > 0, or 0 for max(1, d / k))", comm::Error);
  CHECK_THROWS_WITH_AS(
      optim::SparsifiedSGD({p, torch::zeros({3}, torch::kDouble)}, SparsifiedSgdOptions(0.1)),
      "SparsifiedSGD parameter 1 is a Double cpu tensor (expected a contiguous "
      "float32 CPU tensor)",
      comm::Error);
  CHECK_THROWS_WITH_AS(optim::SparsifiedSGD({torch::zeros({3, 4}).t()}, SparsifiedSgdOptions(0.1)),
                       "SparsifiedSGD parameter 0 is a Float cpu non-contiguous tensor (expected a "
                       "contiguous float32 CPU tensor)",
                       comm::Error);

  // Those that need a Runtime: one rank, and two ranks with different models.
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    auto net = std::make_shared<Mlp>();
    CHECK_THROWS_WITH_AS(optim::PowerSGD(rt, net, optim::PowerSgdOptimizerOptions(-0.5)),
                         "PowerSgdOptimizerOptions.lr=-0.5 (expected > 0)", comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::PowerSGD(rt, net, optim::PowerSgdOptimizerOptions(0.1).momentum(-0.1)),
        "PowerSgdOptimizerOptions.momentum=-0.1 (expected >= 0)", comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::PowerSGD(rt, net, optim::PowerSgdOptimizerOptions(0.1).weight_decay(-3)),
        "PowerSgdOptimizerOptions.weight_decay=-3 (expected >= 0)", comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::PowerSGD(rt, net, optim::PowerSgdOptimizerOptions(0.1).nesterov(true)),
        "PowerSgdOptimizerOptions.nesterov=true with momentum=0 (expected momentum > 0)",
        comm::Error);
    comm::PowerSGD zero_rank;
    zero_rank.rank = 0;
    CHECK_THROWS_WITH_AS(
        optim::PowerSGD(rt, net, optim::PowerSgdOptimizerOptions(0.1).algorithm(zero_rank)),
        "PowerSGD.rank=0 (expected >= 1)", comm::Error);
    CHECK_THROWS_WITH_AS(
        optim::CentralizedSparsifiedSGD(rt, net->parameters(), SparsifiedSgdOptions(0.1).ratio(2)),
        "SparsifiedSgdOptions.ratio=2 with count=0 (expected 0 < ratio <= 1, or a "
        "count > 0)",
        comm::Error);
  });
  CHECK(errors == std::vector<std::string>{""});
  errors = run_threads(2, [&](int r, Runtime& rt) {
    torch::nn::Linear model(6, r == 0 ? 4 : 5);
    optim::CentralizedSparsifiedSGD opt(rt, model->parameters(),
                                        SparsifiedSgdOptions(0.1).count(2));
  });
  CHECK(errors[0] ==
        "CentralizedSparsifiedSGD: rank 1 has 2 parameters, 35 elements, k=4 (rank 0 has 2, 28, "
        "k=4; expected the same on every rank)");
  CHECK(errors[1] ==
        "CentralizedSparsifiedSGD: rank 0 has 2 parameters, 28 elements, k=4 (rank 1 has 2, 35, "
        "k=4; expected the same on every rank)");
}
