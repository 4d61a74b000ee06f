// Models held the way LibTorch programs hold them — a TORCH_MODULE holder, torch::nn::Linear —
// wrapped on thread ranks and trained against one process on the whole batch; the empty holder
// refused; the shard samplers the umbrella header documents. Includes only <troupe/troupe.h> of
// troupe's API.
#include "tests/support/torch_doctest.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <troupe/troupe.h>
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

constexpr int kWorld = 2;
constexpr int64_t kBatch = 4;  // per rank
constexpr int kSteps = 3;
constexpr double kLr = 0.1;

void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto a = from.parameters(), b = to.parameters();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

double max_difference(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  return worst;
}

/// How a rank wraps its holder.
enum class Wrapper { distributed_module, make_data_parallel, decentralized };

/// kSteps of plain SGD on kWorld thread ranks, each on its slice of the batch, with the model held
/// in a `Holder` (built by `make`), against one process on the whole batch. Plain SGD keeps D-PSGD
/// on a complete graph of two (adapt-then-combine) equal to it too: the average of the two local
/// steps is the step on the whole batch. Returns the largest difference over ranks.
template <typename Holder, typename Make>
double holder_difference(Wrapper wrapper, Make make) {
  torch::manual_seed(11);
  std::vector<Holder> replicas;
  for (int r = 0; r < kWorld; ++r) replicas.push_back(make());
  Holder reference = make();
  copy_params(*replicas[0], *reference);  // rank 0's weights are broadcast to everyone
  const int64_t in = reference->parameters()[0].size(1);
  const int64_t out = reference->parameters().back().size(0);
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(torch::randn({kWorld * kBatch, in}));
    ys.push_back(torch::randn({kWorld * kBatch, out}));
  }
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(kLr));
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(xs[s]), ys[s]).backward();
    ref_opt.step();
  }
  std::vector<double> diffs(kWorld, 1e9);
  auto errors = test::run_threads(kWorld, [&](int r, Runtime& rt) {
    Holder model = replicas[static_cast<size_t>(r)];  // a holder copy shares the module
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    std::unique_ptr<DataParallel> dp;
    std::unique_ptr<DistributedModule> ddp;
    if (wrapper == Wrapper::distributed_module) {
      ddp = std::make_unique<DistributedModule>(rt, model);
    } else if (wrapper == Wrapper::make_data_parallel) {
      dp = make_data_parallel(rt, model, JobAlgorithm{comm::Compression{GradientAllReduce{}}});
    } else {
      Decentralized d;
      d.topology.kind = comm::TopologyKind::complete;
      d.exchange = Decentralized::Exchange::after_step;
      dp = std::make_unique<DecentralizedModule>(rt, model, d);
    }
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto x = xs[s].narrow(0, r * kBatch, kBatch), y = ys[s].narrow(0, r * kBatch, kBatch);
      torch::mse_loss(model->forward(x), y).backward();
      if (ddp)
        ddp->step(opt);
      else
        dp->step(opt);
    }
    if (dp) dp->finish();
    diffs[static_cast<size_t>(r)] = max_difference(*model, *reference);
  });
  for (auto& e : errors) CHECK(e == "");
  return *std::max_element(diffs.begin(), diffs.end());
}

}  // namespace

TEST_CASE("a TORCH_MODULE holder wrapped on two ranks trains like one process on the whole batch") {
  torch::set_num_threads(1);
  auto make = [] { return Net(); };
  CHECK(holder_difference<Net>(Wrapper::distributed_module, make) < 2e-5);
  CHECK(holder_difference<Net>(Wrapper::make_data_parallel, make) < 2e-5);
  CHECK(holder_difference<Net>(Wrapper::decentralized, make) < 2e-5);
}

TEST_CASE("a torch::nn::Linear wrapped on two ranks trains like one process on the whole batch") {
  torch::set_num_threads(1);
  auto make = [] { return torch::nn::Linear(5, 2); };
  CHECK(holder_difference<torch::nn::Linear>(Wrapper::distributed_module, make) < 2e-5);
  CHECK(holder_difference<torch::nn::Linear>(Wrapper::decentralized, make) < 2e-5);
}

TEST_CASE("an empty module holder is refused, naming the wrapper") {
  std::vector<std::string> what(2);
  auto errors = test::run_threads(1, [&](int, Runtime& rt) {
    torch::nn::Linear empty{nullptr};
    try {
      DistributedModule ddp(rt, empty);
    } catch (const comm::Error& e) {
      what[0] = e.what();
    }
    try {
      DecentralizedModule gossip(rt, empty, Decentralized{});
    } catch (const comm::Error& e) {
      what[1] = e.what();
    }
  });
  CHECK(errors[0] == "");
  CHECK(what[0].find("DistributedModule: the module holder is empty") != std::string::npos);
  CHECK(what[1].find("DecentralizedModule: the module holder is empty") != std::string::npos);
}

TEST_CASE("a Module subclass by value is told apart from holders and shared_ptrs at compile time") {
  static_assert(is_module_by_value<NetImpl&>);
  static_assert(is_module_by_value<const NetImpl>);
  static_assert(!is_module_by_value<Net>);
  static_assert(!is_module_by_value<torch::nn::Linear>);
  static_assert(!is_module_by_value<std::shared_ptr<NetImpl>>);
  // What every wrapper's constructor takes: shared_ptrs of any Module subclass, and holders.
  static_assert(std::is_convertible_v<std::shared_ptr<NetImpl>, ModelRef>);
  static_assert(std::is_convertible_v<std::shared_ptr<torch::nn::Module>, ModelRef>);
  static_assert(std::is_convertible_v<Net&, ModelRef>);
  static_assert(std::is_convertible_v<const torch::nn::Linear&, ModelRef>);
  static_assert(!std::is_convertible_v<std::shared_ptr<int>, ModelRef>);
  CHECK(true);  // the checks above are the test; a failing one does not compile
}

TEST_CASE(
    "DistributedRandomSampler with the Runtime's rank and world size gives equal shards that "
    "cover the dataset, reshuffled by set_epoch") {
  const int64_t n = 9;  // not a multiple of the world size: the shards are padded to 5 and 5
  auto dataset = torch::data::datasets::TensorDataset(torch::arange(n).unsqueeze(1))
                     .map(torch::data::transforms::Stack<torch::data::TensorExample>());
  std::vector<std::vector<std::vector<int64_t>>> seen(2);  // [epoch][rank] -> indices in order
  for (auto& epoch : seen) epoch.resize(kWorld);
  auto errors = test::run_threads(kWorld, [&](int r, Runtime& rt) {
    for (size_t epoch = 0; epoch < seen.size(); ++epoch) {
      torch::data::samplers::DistributedRandomSampler sampler(
          n, static_cast<size_t>(rt.world_size()), static_cast<size_t>(rt.rank()));
      sampler.set_epoch(epoch);
      auto loader = torch::data::make_data_loader(dataset, std::move(sampler), 2);
      for (auto& batch : *loader)
        for (int64_t i = 0; i < batch.data.size(0); ++i)
          seen[epoch][static_cast<size_t>(r)].push_back(batch.data[i][0].item<int64_t>());
    }
  });
  for (auto& e : errors) CHECK(e == "");
  for (const auto& epoch : seen) {
    CHECK(epoch[0].size() == 5);
    CHECK(epoch[1].size() == 5);
    std::set<int64_t> all(epoch[0].begin(), epoch[0].end());
    all.insert(epoch[1].begin(), epoch[1].end());
    CHECK(all.size() == static_cast<size_t>(n));  // covering, one index padded twice
  }
  CHECK(seen[0][0] != seen[1][0]);  // set_epoch changed the shuffle
}
