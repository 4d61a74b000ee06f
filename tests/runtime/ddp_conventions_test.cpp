// DistributedModule and the conventions PyTorch DDP users bring: a denominator set at any point
// before step(), buffers broadcast from rank 0 (BatchNorm), and join for uneven inputs. Ranks are
// threads over the inproc transport; every case against a computation in one process.
#include "tests/support/torch_doctest.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

using test::run_threads;

// Linear, BatchNorm, Linear: parameters in two layers and the buffers of BatchNorm.
struct Net : torch::nn::Module {
  explicit Net(bool batch_norm = true) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    if (batch_norm) bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc1(x);
    if (bn) h = bn(h);
    return fc2(torch::relu(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

std::vector<torch::Tensor> flat_copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (auto& t : tensors) out.push_back(t.detach().to(torch::kDouble).clone().reshape({-1}));
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(
        worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  return worst;
}

void copy_state(Net& from, Net& to) {
  torch::NoGradGuard no_grad;
  auto a = from.parameters(), b = to.parameters();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  auto c = from.buffers(), d = to.buffers();
  for (size_t i = 0; i < c.size(); ++i) d[i].copy_(c[i]);
}

// Every (step, rank) slice of a run: 4 samples, rank r's shifted by r so BatchNorm's statistics
// differ between ranks.
struct Data {
  std::vector<std::vector<torch::Tensor>> x, y;
  Data(int steps, int world) {
    for (int s = 0; s < steps; ++s) {
      x.emplace_back();
      y.emplace_back();
      for (int r = 0; r < world; ++r) {
        x.back().push_back(torch::randn({4, 6}) * (1 + r) + r);
        y.back().push_back(torch::randn({4, 3}));
      }
    }
  }
};

// One step of the single-process reference: the gradient is sum over `ranks` of each slice's
// gradient, divided by `divisor`; the buffers are updated by the forward of `lead` alone (what
// the ranks see once the lead's buffers are broadcast).
void reference_step(Net& net, torch::optim::Optimizer& opt, const Data& d, int step,
                    const std::vector<int>& ranks, int lead, double divisor) {
  opt.zero_grad();
  auto saved = flat_copies(net.buffers());
  // Each slice's backward before the next forward: BatchNorm's backward reads the running
  // statistics, which are restored in place below.
  for (int r : ranks)
    if (r != lead) (torch::mse_loss(net.forward(d.x[step][r]), d.y[step][r]) / divisor).backward();
  {
    torch::NoGradGuard no_grad;
    auto buffers = net.buffers();
    for (size_t i = 0; i < buffers.size(); ++i)
      buffers[i].copy_(saved[i].view(buffers[i].sizes()).to(buffers[i].scalar_type()));
  }
  (torch::mse_loss(net.forward(d.x[step][lead]), d.y[step][lead]) / divisor).backward();
  opt.step();
}

}  // namespace

TEST_CASE(
    "set_denominator divides the step's sum of gradients whether called before or after backward") {
  torch::set_num_threads(1);
  const int world = 3, steps = 2;
  struct Case {
    std::string name;
    DdpOptions options;
    Algorithm algorithm = GradientAllReduce{};
    double before = 0, after = 0;  // 0: not called at that point
    double tolerance = 1e-5;
  };
  std::vector<Case> cases;
  auto base = [] {
    DdpOptions o;
    o.bucket_bytes = 128;  // several buckets
    o.first_bucket_bytes = 64;
    return o;
  };
  for (bool divide_before : {false, true})
    for (bool shared : {true, false})
      for (auto [before, after] : std::vector<std::pair<double, double>>{{7, 0}, {0, 7}, {2, 11}}) {
        Case c;
        c.options = base();
        c.options.divide_before = divide_before;
        c.options.shared_memory = shared;
        c.before = before;
        c.after = after;
        c.name = std::string(divide_before ? "divide before" : "divide after") +
                 (shared ? ", shared memory" : ", transport");
        cases.push_back(c);
      }
  {
    Case c;
    c.options = base();
    c.options.gradient_as_bucket_view = false;
    c.after = 5;
    c.name = "gradients copied into the buckets";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.options.delay_reduce = true;
    c.before = 3, c.after = 5;
    c.name = "delay_reduce";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.options.join = true;
    c.before = 2, c.after = 9;
    c.name = "with join";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.algorithm = HalfPrecision{};
    c.after = 6;
    c.tolerance = 2e-3;
    c.name = "half precision";
    cases.push_back(c);
  }
  for (auto& c : cases) {
    CAPTURE(c.name);
    CAPTURE(c.before);
    CAPTURE(c.after);
    torch::manual_seed(3);
    std::vector<std::shared_ptr<Net>> replicas;
    for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>(false));
    Data data(steps, world);
    // The closed form: sum over ranks of each rank's gradient (at rank 0's weights) / denominator.
    const double denominator = c.after > 0 ? c.after : c.before;
    std::vector<std::vector<torch::Tensor>> want(steps);
    auto reference = std::make_shared<Net>(false);
    copy_state(*replicas[0], *reference);
    for (int s = 0; s < steps; ++s) {
      for (auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
      for (int r = 0; r < world; ++r)
        torch::mse_loss(reference->forward(data.x[s][r]), data.y[s][r]).backward();
      for (auto& p : reference->parameters()) want[s].push_back(p.grad() / denominator);
    }
    std::vector<std::vector<std::vector<torch::Tensor>>> got(world);
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto net = replicas[static_cast<size_t>(r)];
      DistributedModule ddp(rt, net, c.algorithm, c.options);
      for (int s = 0; s < steps; ++s) {
        for (auto& p : net->parameters())
          if (p.grad().defined()) p.mutable_grad().zero_();
        if (c.before > 0) ddp.set_denominator(c.before);
        torch::mse_loss(net->forward(data.x[s][r]), data.y[s][r]).backward();
        if (c.after > 0) ddp.set_denominator(c.after);
        // No optimizer: the weights stay rank 0's; the optimizer would see these gradients.
        ddp.step([&] {
          std::vector<torch::Tensor> grads;
          for (auto& p : net->parameters()) grads.push_back(p.grad());
          got[static_cast<size_t>(r)].push_back(flat_copies(grads));
        });
      }
    });
    for (auto& e : errors) CHECK(e == "");
    for (int r = 0; r < world; ++r) {
      REQUIRE(got[static_cast<size_t>(r)].size() == static_cast<size_t>(steps));
      for (int s = 0; s < steps; ++s) {
        CAPTURE(r);
        CAPTURE(s);
        CHECK(max_difference(got[static_cast<size_t>(r)][static_cast<size_t>(s)],
                             flat_copies(want[static_cast<size_t>(s)])) < c.tolerance);
      }
    }
  }
}

TEST_CASE("set_denominator refuses a bad value, weight averaging and summing, naming why") {
  auto errors = run_threads(1, [](int, Runtime& rt) {
    DistributedModule ddp(rt, std::make_shared<Net>(false));
    CHECK_THROWS_WITH(ddp.set_denominator(0),
                      doctest::Contains("expected a finite denominator > 0"));
    CHECK_THROWS_WITH(ddp.set_denominator(std::numeric_limits<double>::infinity()),
                      doctest::Contains("finite"));
    CHECK_THROWS_WITH(ddp.set_denominator(std::nan("")), doctest::Contains("> 0"));
    DdpOptions weights;
    weights.agg_grad = false;
    DistributedModule averaging(rt, std::make_shared<Net>(false), GradientAllReduce{}, weights);
    CHECK_THROWS_WITH(averaging.set_denominator(4), doctest::Contains("agg_grad = false"));
    DdpOptions sum;
    sum.average = false;
    DistributedModule summing(rt, std::make_shared<Net>(false), GradientAllReduce{}, sum);
    CHECK_THROWS_WITH(summing.set_denominator(4), doctest::Contains("average = false"));
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("broadcast_buffers gives every rank rank 0's BatchNorm statistics after each step") {
  torch::set_num_threads(1);
  const int world = 3, steps = 3;
  for (bool broadcast : {true, false})
    for (bool shared : {true, false}) {
      CAPTURE(broadcast);
      CAPTURE(shared);
      torch::manual_seed(5);
      std::vector<std::shared_ptr<Net>> replicas;
      for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>());
      Data data(steps, world);
      auto reference = std::make_shared<Net>();
      copy_state(*replicas[0], *reference);
      torch::optim::SGD ref_opt(reference->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
      std::vector<std::vector<torch::Tensor>> ref_buffers;
      for (int s = 0; s < steps; ++s) {
        reference_step(*reference, ref_opt, data, s, {0, 1, 2}, 0, world);
        ref_buffers.push_back(flat_copies(reference->buffers()));
      }
      // buffers[s][r]: rank r's buffers after step s.
      std::vector<std::vector<std::vector<torch::Tensor>>> buffers(
          steps, std::vector<std::vector<torch::Tensor>>(world));
      std::vector<std::vector<torch::Tensor>> weights(world);
      auto errors = run_threads(world, [&](int r, Runtime& rt) {
        auto net = replicas[static_cast<size_t>(r)];
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        DdpOptions options;
        options.broadcast_buffers = broadcast;
        options.shared_memory = shared;
        DistributedModule ddp(rt, net, GradientAllReduce{}, options);
        for (int s = 0; s < steps; ++s) {
          opt.zero_grad();
          torch::mse_loss(net->forward(data.x[s][r]), data.y[s][r]).backward();
          ddp.step(opt);
          buffers[s][r] = flat_copies(net->buffers());
        }
        weights[static_cast<size_t>(r)] = flat_copies(net->parameters());
      });
      for (auto& e : errors) CHECK(e == "");
      for (auto& w : weights) CHECK(max_difference(w, flat_copies(reference->parameters())) < 1e-5);
      for (int s = 0; s < steps; ++s) {
        CAPTURE(s);
        CHECK(max_difference(buffers[s][0], ref_buffers[s]) < 1e-5);  // rank 0 kept its own
        for (int r = 1; r < world; ++r) {
          CAPTURE(r);
          const double off = max_difference(buffers[s][r], buffers[s][0]);
          if (broadcast)
            CHECK(off == 0);
          else
            CHECK(off > 1e-3);  // each rank's statistics of its own data
        }
      }
    }
}

TEST_CASE(
    "ranks that disagree on broadcast_buffers or join get an error naming the option, not a hang") {
  for (int which = 0; which < 2; ++which) {
    auto errors = run_threads(2, [&](int r, Runtime& rt) {
      DdpOptions options;
      if (r == 1 && which == 0) options.broadcast_buffers = false;
      if (r == 1 && which == 1) options.join = true;
      DistributedModule ddp(rt, std::make_shared<Net>(), GradientAllReduce{}, options);
    });
    for (auto& e : errors)
      CHECK(e.find(which == 0 ? "broadcast_buffers" : "join") != std::string::npos);
  }
}

TEST_CASE(
    "with join, ranks with uneven numbers of batches finish, equal to one process shadowing the "
    "joined ranks with zeros") {
  torch::set_num_threads(1);
  const int world = 3;
  struct Case {
    std::vector<int> batches;
    bool agg_grad = true;
    bool initial_world = true;
    bool shared = true;
  };
  std::vector<Case> cases;
  for (auto batches : std::vector<std::vector<int>>{{5, 3, 1}, {1, 3, 5}, {0, 2, 1}})
    for (bool initial : {true, false})
      for (bool shared : {true, false}) cases.push_back({batches, true, initial, shared});
  cases.push_back({{5, 3, 1}, false, true, true});  // weights averaged over the ranks training
  cases.push_back({{0, 2, 4}, false, true, false});
  for (auto& c : cases) {
    CAPTURE(c.batches[0]);
    CAPTURE(c.batches[1]);
    CAPTURE(c.batches[2]);
    CAPTURE(c.agg_grad);
    CAPTURE(c.initial_world);
    CAPTURE(c.shared);
    const int steps = *std::max_element(c.batches.begin(), c.batches.end());
    torch::manual_seed(11);
    std::vector<std::shared_ptr<Net>> replicas;
    for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Net>());
    Data data(steps, world);
    // Weight averaging with plain SGD is the average gradient over the ranks training.
    auto make_optimizer = [&](Net& net) {
      return torch::optim::SGD(net.parameters(),
                               torch::optim::SGDOptions(0.1).momentum(c.agg_grad ? 0.9 : 0.0));
    };
    auto reference = std::make_shared<Net>();
    copy_state(*replicas[0], *reference);
    auto ref_opt = make_optimizer(*reference);
    for (int s = 0; s < steps; ++s) {
      std::vector<int> training;
      for (int r = 0; r < world; ++r)
        if (c.batches[static_cast<size_t>(r)] > s) training.push_back(r);
      const bool by_world = c.agg_grad && c.initial_world;
      reference_step(*reference, ref_opt, data, s, training, training.front(),
                     by_world ? world : static_cast<double>(training.size()));
    }
    std::vector<std::vector<torch::Tensor>> finals(world);
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto net = replicas[static_cast<size_t>(r)];
      auto opt = make_optimizer(*net);
      DdpOptions options;
      options.join = true;
      options.divide_by_initial_world_size = c.initial_world;
      options.agg_grad = c.agg_grad;
      options.shared_memory = c.shared;
      options.bucket_bytes = 128;  // several buckets, rebuilt after step 1
      options.first_bucket_bytes = 64;
      options.aggregation = c.agg_grad ? Aggregation::bucket : Aggregation::layer;
      DistributedModule ddp(rt, net, GradientAllReduce{}, options);
      for (int s = 0; s < c.batches[static_cast<size_t>(r)]; ++s) {
        opt.zero_grad();
        torch::mse_loss(net->forward(data.x[s][r]), data.y[s][r]).backward();
        ddp.step(opt);
      }
      ddp.join();
      auto state = flat_copies(net->parameters());
      for (auto& b : flat_copies(net->buffers())) state.push_back(b);
      finals[static_cast<size_t>(r)] = state;
    });
    for (auto& e : errors) CHECK(e == "");
    auto want = flat_copies(reference->parameters());
    for (auto& b : flat_copies(reference->buffers())) want.push_back(b);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      REQUIRE(finals[static_cast<size_t>(r)].size() == want.size());
      CHECK(max_difference(finals[static_cast<size_t>(r)], want) < 1e-5);
      CHECK(max_difference(finals[static_cast<size_t>(r)], finals[0]) == 0);
    }
  }
}

TEST_CASE(
    "join is refused without the option, after a backward without its step, and with a majority "
    "vote") {
  auto errors = run_threads(1, [](int, Runtime& rt) {
    auto net = std::make_shared<Net>();
    {
      DistributedModule ddp(rt, net);
      CHECK_THROWS_WITH(ddp.join(), doctest::Contains("without DdpOptions.join"));
    }
    DdpOptions options;
    options.join = true;
    DistributedModule ddp(rt, net, GradientAllReduce{}, options);
    torch::mse_loss(net->forward(torch::randn({4, 6})), torch::randn({4, 3})).backward();
    CHECK_THROWS_WITH(ddp.join(), doctest::Contains("after a backward without its step()"));
    SignCompression vote;
    vote.mode = SignMode::majority_vote;
    vote.error_feedback = false;
    CHECK_THROWS_WITH(DistributedModule(rt, std::make_shared<Net>(), vote, options),
                      doctest::Contains("zero gradient would vote"));
  });
  for (auto& e : errors) CHECK(e == "");
}
