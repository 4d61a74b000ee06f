// The gossip modules keep working on the model the user trains: a checkpoint loaded (torch::load)
// or a parameter replaced (set_data) after construction is re-attached to the module's flat
// buffer, and the results are those of the single-process simulations (gossip_reference.h); a
// replacement of another shape or dtype is refused naming the parameter. The asynchronous
// algorithms' rounds land only between iterations: a round that completes while the trainer is
// between a forward and its backward does not change the weights that backward differentiates.
#include <unistd.h>

#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/status.h"
#include "ddp/data_parallel.h"
#include "tests/runtime/gossip/gossip_reference.h"

using namespace troupe;
using namespace troupe::test::gossip;
using test::run_threads;

namespace {

namespace fs = std::filesystem;

/// A scratch folder for checkpoints, removed at the end of the test.
class CheckpointDir {
 public:
  CheckpointDir() {
    std::string pattern = (fs::temp_directory_path() / "troupe-gossip-trust-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~CheckpointDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

/// Saves a Net whose weights are `flat` to `path`.
void save_net(const torch::Tensor& flat, const std::string& path) {
  auto net = std::make_shared<Net>();
  load_flat(*net, flat);
  torch::save(net, path);
}

/// Weights unlike initial_weights(), the same on every rank: what a module is constructed from
/// before the checkpoint replaces them.
torch::Tensor construction_weights() { return initial_weights() * 0.5 + 0.25; }

enum class Replace { load, set_data };

/// Replaces every parameter of `net` (its storage, not its values in place) by the weights of the
/// checkpoint at `path`: torch::load, or set_data with tensors of those values.
void replace_weights(Net& net, std::shared_ptr<Net> handle, Replace how, const std::string& path) {
  if (how == Replace::load) {
    torch::load(handle, path);
    return;
  }
  auto loaded = std::make_shared<Net>();
  torch::load(loaded, path);
  auto params = net.parameters();
  auto values = loaded->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(values[i].detach().clone());
}

bool all_equal(const torch::Tensor& a, const torch::Tensor& b) { return torch::equal(a, b); }

}  // namespace

TEST_CASE(
    "a checkpoint loaded after constructing a decentralized module is gossiped like one "
    "loaded before") {
  CheckpointDir dir;
  const std::string checkpoint = dir.file("net.pt");
  save_net(initial_weights(), checkpoint);
  const int world = 4, steps = 5;
  const double lr = 0.1;
  for (auto exchange : {Decentralized::Exchange::after_step, Decentralized::Exchange::overlap}) {
    for (auto how : {Replace::load, Replace::set_data}) {
      CAPTURE(static_cast<int>(exchange));
      CAPTURE(static_cast<int>(how));
      Decentralized algo;
      algo.topology = ring();
      algo.topology.mixing = comm::Mixing::metropolis;
      algo.exchange = exchange;
      auto finals = train_ranks(world, steps, lr, [&](Runtime& rt, std::shared_ptr<Net> net) {
        load_flat(*net, construction_weights());
        auto dp = std::make_unique<DecentralizedModule>(rt, net, algo);
        replace_weights(*net, net, how, checkpoint);
        return dp;
      });
      // Every rank loaded the same weights: as if the module had started from them.
      const auto x = dpsgd_reference(algo, world, steps, lr);
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-5);
      }
    }
  }
}

TEST_CASE(
    "a checkpoint loaded after constructing a Choco-SGD module moves the weights, not the "
    "public copies") {
  CheckpointDir dir;
  const std::string checkpoint = dir.file("net.pt");
  save_net(initial_weights(), checkpoint);
  const int world = 4, steps = 4;
  const double lr = 0.1;
  LowPrecisionDecentralized algo;
  algo.topology = ring();
  algo.gamma = 0.5;
  algo.block = 16;
  auto finals = train_ranks(world, steps, lr, [&](Runtime& rt, std::shared_ptr<Net> net) {
    load_flat(*net, construction_weights());
    auto dp = std::make_unique<DecentralizedModule>(rt, net, algo);
    replace_weights(*net, net, Replace::load, checkpoint);
    return dp;
  });
  // The public copies (known to the neighbours) stay at the weights of construction.
  const auto x = choco_reference(algo, world, steps, lr, construction_weights());
  // 1e-3, not the 1e-5 of the other Choco tests: here x - x_hat spans the checkpoint's distance
  // from the construction weights, so one 8-bit step is large, and a last-bit difference that
  // moves a value across a rounding boundary showed as up to 2.6e-4 in about 1 run of 12. Without
  // the re-attach the ranks are off by far more.
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((finals[r] - x[r]).abs().max().item<double>() < 1e-3);
  }
}

TEST_CASE("asynchronous model average averages the weights loaded or set after construction") {
  CheckpointDir dir;
  const std::string checkpoint = dir.file("net.pt");
  save_net(initial_weights(), checkpoint);
  const int world = 3;
  const auto init = initial_weights();
  for (int r = 0; r < world; ++r)
    save_net(torch::full_like(init, static_cast<float>(r + 1)),
             dir.file("rank" + std::to_string(r)));
  std::vector<torch::Tensor> after_warmup(world), after_abort(world), after_finish(world);
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    load_flat(*net, construction_weights());
    AsyncModelAverage algo;
    algo.warmup_steps = 2;
    algo.sync_interval_ms = 60000;  // no timer round: only the stop rounds
    AsynchronousModule dp(rt, net, algo);
    replace_weights(*net, net, Replace::load, checkpoint);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      torch::mse_loss(net->forward(x), y).backward();
      dp.step(opt);
    }
    after_warmup[rank] = flat_of(*net);
    // Rank-dependent checkpoints, loaded between steps: the stop round must average them.
    replace_weights(*net, net, Replace::load, dir.file("rank" + std::to_string(rank)));
    dp.abort();
    after_abort[rank] = flat_of(*net);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.set_data(torch::full_like(p, 3.0f * rank));
    }
    dp.resume();
    dp.finish();
    after_finish[rank] = flat_of(*net);
    CHECK(dp.stats().background_rounds == 2);
  });
  check_no_errors(errors);
  const auto x = allreduce_sgd_reference(world, 2, 0.1);  // the warm-up's, from the checkpoint
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((after_warmup[r] - x).abs().max().item<double>() < 1e-5);
    CHECK((after_abort[r] - 2.0).abs().max().item<double>() < 1e-6);   // mean of 1, 2, 3
    CHECK((after_finish[r] - 3.0).abs().max().item<double>() < 1e-6);  // mean of 0, 3, 6
  }
}

TEST_CASE("a gossip module refuses a parameter replaced by one of another shape or dtype") {
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    Decentralized algo;
    algo.exchange = Decentralized::Exchange::after_step;
    for (bool wrong_shape : {true, false}) {
      CAPTURE(wrong_shape);
      auto net = std::make_shared<Net>();
      DecentralizedModule dp(rt, net, algo);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      if (wrong_shape) {
        net->fc1->weight.set_data(torch::zeros({7, 6}));
        CHECK_THROWS_WITH_AS(dp.step(opt),
                             doctest::Contains("parameter fc1.weight has shape [7, 6] now, "
                                               "expected [7, 5]"),
                             comm::Error);
      } else {
        net->fc2->bias.set_data(torch::zeros({3}, torch::kFloat64));
        CHECK_THROWS_WITH_AS(
            dp.step(opt), doctest::Contains("parameter fc2.bias is Double now, expected float32"),
            comm::Error);
      }
    }
  });
  check_no_errors(errors);
}

namespace {

/// What train_between_rounds saw on one rank.
struct Seen {
  torch::Tensor before, after;  // the weights before the first step and after finish()
  double distance_before = 0, distance_after = 0;  // consensus distance, before and after training
  uint64_t rounds = 0;
  int blocked = 0;          // steps that waited for a round between forward and backward
  int changed = 0;          // steps whose weights changed between forward and backward
  int wrong_gradients = 0;  // steps whose gradients were not those of the forward's weights
};

/// `world` thread ranks, rank r starting from initial_weights() + r, train `steps` steps of SGD
/// (`lr`) with the module `make` returns; every fifth step waits between its forward and its
/// backward until a background round has completed on this rank. Checks at every step that
/// backward differentiated the weights forward saw.
using MakeAsynchronous =
    std::function<std::unique_ptr<AsynchronousModule>(Runtime&, std::shared_ptr<Net>)>;

std::vector<Seen> train_between_rounds(int world, int steps, double lr,
                                       const MakeAsynchronous& make) {
  std::vector<Seen> seen(static_cast<size_t>(world));
  const auto init = initial_weights();
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    Seen& mine = seen[static_cast<size_t>(rank)];
    auto net = std::make_shared<Net>();
    load_flat(*net, init + static_cast<float>(rank));
    mine.before = flat_of(*net);
    mine.distance_before = consensus_distance(rt, *net);
    auto dp = make(rt, net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      auto out = net->forward(x);
      const auto at_forward = flat_of(*net);
      if (s % 5 == 2) {
        // A round completes now, between this forward and its backward.
        const uint64_t rounds = dp->stats().background_rounds;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (dp->stats().background_rounds == rounds) {
          if (std::chrono::steady_clock::now() > deadline)
            throw comm::Error("rank " + std::to_string(rank) + ", step " + std::to_string(s) +
                              ": no background round within 20 s");
          std::this_thread::yield();
        }
        ++mine.blocked;
      }
      torch::mse_loss(out, y).backward();
      if (!all_equal(flat_of(*net), at_forward)) ++mine.changed;
      std::vector<torch::Tensor> grads;
      for (auto& p : net->parameters()) grads.push_back(p.grad().reshape({-1}));
      if ((torch::cat(grads) - gradient_at(at_forward, rank, s)).abs().max().item<double>() > 1e-5)
        ++mine.wrong_gradients;
      dp->step(opt);
    }
    mine.distance_after = consensus_distance(rt, *net);
    dp->finish();
    mine.after = flat_of(*net);
    mine.rounds = dp->stats().background_rounds;
  });
  check_no_errors(errors);
  return seen;
}

GossipOptions own_weights() {
  GossipOptions o;
  o.broadcast_parameters = false;  // rank r starts from initial_weights() + r
  return o;
}

void check_between_iterations(const std::vector<Seen>& seen, int steps) {
  for (size_t r = 0; r < seen.size(); ++r) {
    CAPTURE(r);
    CHECK(seen[r].blocked == (steps + 2) / 5);
    CHECK(seen[r].rounds >= static_cast<uint64_t>(seen[r].blocked));
    CHECK(seen[r].changed == 0);
    CHECK(seen[r].wrong_gradients == 0);
  }
}

}  // namespace

TEST_CASE(
    "asynchronous model average lands its rounds between iterations, never between a "
    "forward and its backward") {
  const int world = 3, steps = 40;
  AsyncModelAverage algo;
  algo.sync_interval_ms = 10;
  auto make = [&](Runtime& rt, std::shared_ptr<Net> net) {
    return std::make_unique<AsynchronousModule>(rt, net, algo, own_weights());
  };
  SUBCASE("training: the models draw together") {
    auto seen = train_between_rounds(world, steps, 0.05, make);
    check_between_iterations(seen, steps);
    // Started 0, 1 and 2 apart in every weight; rounds pull them to their average.
    CHECK(seen[0].distance_before > 4.0);
    CHECK(seen[0].distance_after < 0.25 * seen[0].distance_before);
  }
  SUBCASE("no training (lr 0): every model ends at the mean of the initial ones") {
    auto seen = train_between_rounds(world, steps, 0.0, make);
    check_between_iterations(seen, steps);
    const auto mean = initial_weights() + 1.0f;
    for (size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      CHECK((seen[r].after - mean).abs().max().item<double>() < 1e-5);
      CHECK(seen[r].distance_after < 1e-4);
    }
  }
}

TEST_CASE("asynchronous gossip lands its exchanges between iterations and keeps the mean") {
  const int world = 4, steps = 40;
  AsyncGossip algo;
  algo.topology = ring();
  algo.min_interval_ms = 5;
  auto seen = train_between_rounds(world, steps, 0.0, [&](Runtime& rt, std::shared_ptr<Net> net) {
    return std::make_unique<AsynchronousModule>(rt, net, algo, own_weights());
  });
  check_between_iterations(seen, steps);
  // lr 0: only exchanges change the models, and each keeps their sum.
  auto sum = torch::zeros_like(seen[0].after);
  for (const auto& s : seen) sum = sum + s.after;
  CHECK((sum / world - (initial_weights() + 1.5f)).abs().max().item<double>() < 1e-4);
  CHECK(seen[0].distance_after < 0.5 * seen[0].distance_before);
}
