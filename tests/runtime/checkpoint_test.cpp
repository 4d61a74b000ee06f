// Checkpoint and resume: per algorithm family, N steps uninterrupted against k steps, a save, new
// wrappers and optimizers (torch's generator reseeded to junk, the model re-initialised), a load
// and N - k more steps: the parameters must be bit-identical (torch::equal). Then what a
// checkpoint refuses (truncated, corrupt, other version, world size or rank, missing) and that a
// refused one changes nothing. Ranks are threads over inproc.
#include "rank/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "algorithms/gossip/decentralized.h"
#include "algorithms/model_switch.h"
#include "algorithms/optim/centralized.h"
#include "algorithms/optim/fp16_optimizer.h"
#include "algorithms/optim/power_sgd.h"
#include "algorithms/optim/sign_sgd.h"
#include "algorithms/optim/sparsified_sgd.h"
#include "algorithms/registry.h"
#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "tests/support/tensors.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

namespace fs = std::filesystem;

// doctest's matcher for a message that contains `text`.
doctest::Contains mentions(const std::string& text) { return doctest::Contains(text.c_str()); }

// Two linear layers written with element-wise ops, so that the same model runs in float16 on the
// CPU whatever half kernels the LibTorch has there (1.13 had no half matrix product). Its weights
// come from `seed`.
struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    w1 = register_parameter("w1", torch::randn({5, 6}, gen) * 0.4);
    b1 = register_parameter("b1", torch::randn({5}, gen) * 0.1);
    w2 = register_parameter("w2", torch::randn({3, 5}, gen) * 0.4);
    b2 = register_parameter("b2", torch::randn({3}, gen) * 0.1);
  }
  static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& b) {
    return (x.unsqueeze(1) * w).sum(-1) + b;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return linear(linear(x.to(w1.scalar_type()), w1, b1), w2, b2);
  }
  torch::Tensor w1, b1, w2, b2;
};

torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  auto out = net.forward(x);
  return (out.to(torch::kFloat) - y).pow(2).mean();
}

constexpr int kWorld = 2;
constexpr int kSteps = 12;
constexpr int kStop = 5;

const test::StepData& data() {
  static const test::StepData d = [] {
    torch::manual_seed(11);
    return test::make_step_data(kWorld, kSteps, 4, 6, 3, /*shrinking=*/false);
  }();
  return d;
}

// Small buckets (several per model) and a layout that does not depend on timing.
DdpOptions small_buckets() {
  DdpOptions o;
  o.bucket_bytes = 64;
  o.first_bucket_bytes = 64;
  o.bucket_split_gap = std::chrono::microseconds(0);
  return o;
}

// One rank's training: the model, one step, and the parts of its state besides the model.
struct Job {
  std::shared_ptr<Net> net;
  std::function<void(const torch::Tensor& x, const torch::Tensor& y)> step;
  std::function<void(Checkpoint&)> add_state;
  std::shared_ptr<void> owner;  // the wrappers and optimizers
};

// Makes the job of one rank; `first_step` is where it starts (0, or the step it resumes at).
using MakeJob = std::function<Job(Runtime&, std::shared_ptr<Net>, int first_step)>;

Job bucket_job(Runtime& rt, std::shared_ptr<Net> net, Algorithm algorithm, double momentum) {
  struct Own {
    std::unique_ptr<DistributedModule> ddp;
    std::unique_ptr<torch::optim::SGD> sgd;
  };
  auto own = std::make_shared<Own>();
  own->ddp = std::make_unique<DistributedModule>(rt, net, algorithm, small_buckets());
  own->sgd = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                 torch::optim::SGDOptions(0.05).momentum(momentum));
  Job job;
  job.net = net;
  job.step = [own, net](const torch::Tensor& x, const torch::Tensor& y) {
    own->sgd->zero_grad();
    loss_of(*net, x, y).backward();
    own->ddp->step(*own->sgd);
  };
  job.add_state = [own](Checkpoint& c) { c.algorithm(*own->ddp).optimizer(*own->sgd); };
  job.owner = own;
  return job;
}

MakeJob bucket_family(Algorithm algorithm, double momentum) {
  return [algorithm, momentum](Runtime& rt, std::shared_ptr<Net> net, int) {
    return bucket_job(rt, std::move(net), algorithm, momentum);
  };
}

// A DataParallel (the gossip algorithms, ModelSwitch) with SGD.
Job data_parallel_job(std::shared_ptr<Net> net, std::shared_ptr<DataParallel> dp, double momentum) {
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                 torch::optim::SGDOptions(0.05).momentum(momentum));
  Job job;
  job.net = net;
  job.step = [dp, sgd, net](const torch::Tensor& x, const torch::Tensor& y) {
    sgd->zero_grad();
    loss_of(*net, x, y).backward();
    dp->step(*sgd);
  };
  job.add_state = [dp, sgd](Checkpoint& c) { c.algorithm(*dp).optimizer(*sgd); };
  job.owner = std::make_shared<
      std::pair<std::shared_ptr<DataParallel>, std::shared_ptr<torch::optim::SGD>>>(dp, sgd);
  return job;
}

MakeJob gossip_family(JobAlgorithm algorithm) {
  return [algorithm](Runtime& rt, std::shared_ptr<Net> net, int) {
    std::shared_ptr<DataParallel> dp = make_data_parallel(rt, net, algorithm);
    return data_parallel_job(net, dp, 0.9);
  };
}

// The job of one of troupe's optimizers that reduce their own gradients (optim/).
template <typename Optimizer>
Job optimizer_job(std::shared_ptr<Net> net, std::shared_ptr<Optimizer> opt) {
  Job job;
  job.net = net;
  job.step = [opt, net](const torch::Tensor& x, const torch::Tensor& y) {
    opt->zero_grad();
    if constexpr (std::is_same_v<Optimizer, optim::FP16Optimizer>)
      opt->backward(loss_of(*net, x, y));  // scales the loss
    else
      loss_of(*net, x, y).backward();
    opt->step();
  };
  job.add_state = [opt](Checkpoint& c) { c.algorithm(*opt); };
  job.owner = opt;
  return job;
}

std::vector<torch::Tensor> params_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

struct Runs {
  std::vector<std::vector<torch::Tensor>> uninterrupted, resumed;
};

std::string fresh_dir(const std::string& name) {
  auto dir =
      fs::temp_directory_path() / ("troupe-checkpoint-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

// kSteps uninterrupted, and kStop steps + save + new everything + load + the rest, on 2 ranks.
Runs run_both(const MakeJob& make, const std::string& name, bool with_algorithm_state = true) {
  const auto& d = data();
  const std::string dir = fresh_dir(name);
  Runs runs;
  runs.uninterrupted.resize(kWorld);
  runs.resumed.resize(kWorld);
  auto errors = test::run_threads(kWorld, [&](int rank, Runtime& rt) {
    auto job = make(rt, std::make_shared<Net>(7), 0);
    for (int s = 0; s < kSteps; ++s) job.step(d.x(s, rank), d.y(s, rank));
    runs.uninterrupted[static_cast<size_t>(rank)] = params_of(*job.net);
  });
  for (auto& e : errors) REQUIRE(e == "");
  errors = test::run_threads(kWorld, [&](int rank, Runtime& rt) {
    {
      auto job = make(rt, std::make_shared<Net>(7), 0);
      for (int s = 0; s < kStop; ++s) job.step(d.x(s, rank), d.y(s, rank));
      Checkpoint checkpoint(rt);
      checkpoint.module(*job.net);
      if (with_algorithm_state) job.add_state(checkpoint);
      checkpoint.save(dir);
    }
    torch::manual_seed(12345 + static_cast<uint64_t>(rank));  // junk
    auto job = make(rt, std::make_shared<Net>(99), kStop);
    Checkpoint checkpoint(rt);
    checkpoint.module(*job.net);
    if (with_algorithm_state) job.add_state(checkpoint);
    checkpoint.load(dir);
    for (int s = kStop; s < kSteps; ++s) job.step(d.x(s, rank), d.y(s, rank));
    runs.resumed[static_cast<size_t>(rank)] = params_of(*job.net);
  });
  for (auto& e : errors) REQUIRE(e == "");
  fs::remove_all(dir);
  return runs;
}

bool identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

void check_bit_identical(const MakeJob& make, const std::string& name) {
  auto runs = run_both(make, name);
  for (int r = 0; r < kWorld; ++r) {
    INFO(name << ", rank " << r << ": max difference "
              << test::max_diff(runs.uninterrupted[static_cast<size_t>(r)],
                                runs.resumed[static_cast<size_t>(r)]));
    CHECK(identical(runs.uninterrupted[static_cast<size_t>(r)],
                    runs.resumed[static_cast<size_t>(r)]));
  }
  // The trajectory moved: a resume that loaded nothing of it would not match by accident.
  CHECK_FALSE(identical(runs.uninterrupted[0], params_of(*std::make_shared<Net>(7))));
}

}  // namespace

TEST_CASE("a resumed allreduce run is bit-identical to the uninterrupted one") {
  check_bit_identical(bucket_family(GradientAllReduce{}, 0.9), "allreduce");
}

TEST_CASE("a resumed fp16 allreduce run is bit-identical to the uninterrupted one") {
  check_bit_identical(bucket_family(HalfPrecision{}, 0.9), "fp16");
}

TEST_CASE("a resumed top-k run with error feedback and momentum correction is bit-identical") {
  Sparsification topk;
  topk.ratio = 0.2;
  topk.momentum = 0.9;
  check_bit_identical(bucket_family(topk, 0), "topk");
}

TEST_CASE("a resumed random-k run with error feedback is bit-identical") {
  Sparsification randomk;
  randomk.mode = SparseMode::random_k;
  randomk.ratio = 0.3;
  randomk.seed = 5;
  check_bit_identical(bucket_family(randomk, 0.9), "randomk");
}

TEST_CASE("a resumed sign-compression run with error feedback is bit-identical") {
  check_bit_identical(bucket_family(SignCompression{}, 0.9), "sign");
}

TEST_CASE("a resumed top-k run without its error-feedback state is not bit-identical") {
  // What the tests above would see if the algorithm's state were left out of the checkpoint.
  Sparsification topk;
  topk.ratio = 0.2;
  topk.momentum = 0.9;
  auto runs = run_both(bucket_family(topk, 0), "topk-without-state", false);
  CHECK_FALSE(identical(runs.uninterrupted[0], runs.resumed[0]));
}

TEST_CASE("a resumed optim::PowerSGD run is bit-identical (Qs, error feedback, warm-up count)") {
  comm::PowerSGD power;
  power.rank = 1;
  power.min_compression_rate = 0;
  power.start_iter = 2;
  MakeJob make = [power](Runtime& rt, std::shared_ptr<Net> net, int) {
    auto opt = std::make_shared<optim::PowerSGD>(
        rt, net,
        optim::PowerSgdOptimizerOptions(0.05).momentum(0.9).algorithm(power).ddp(small_buckets()));
    return optimizer_job(net, opt);
  };
  check_bit_identical(make, "powersgd");
}

TEST_CASE("a resumed CentralizedAdam run is bit-identical") {
  MakeJob make = [](Runtime& rt, std::shared_ptr<Net> net, int) {
    auto opt = std::make_shared<optim::CentralizedAdam>(
        rt, net, optim::CentralizedAdamOptions(0.01).grad_clip(0.5).ddp(small_buckets()));
    return optimizer_job(net, opt);
  };
  check_bit_identical(make, "centralized-adam");
}

TEST_CASE("a resumed FP16Optimizer run is bit-identical (masters, loss scale, its growth count)") {
  MakeJob make = [](Runtime& rt, std::shared_ptr<Net> net, int) {
    // A scale window of 3: the scale grows before and after the stop at step 5.
    auto opt = std::make_shared<optim::FP16Optimizer>(
        rt, net, torch::optim::SGDOptions(0.05).momentum(0.9),
        optim::Fp16OptimizerOptions().init_scale(64).scale_window(3).ddp(small_buckets()));
    return optimizer_job(net, opt);
  };
  check_bit_identical(make, "fp16-optimizer");
}

TEST_CASE("a resumed D-PSGD run (overlap: a round in flight at the save) is bit-identical") {
  Decentralized d;
  d.topology.kind = comm::TopologyKind::ring;
  check_bit_identical(gossip_family(d), "dpsgd");
}

TEST_CASE("a resumed Choco-SGD run is bit-identical (the public copies)") {
  LowPrecisionDecentralized l;
  l.topology.kind = comm::TopologyKind::ring;
  l.gamma = 0.5;
  l.block = 8;
  check_bit_identical(gossip_family(l), "choco");
}

TEST_CASE("a resumed ModelSwitch run is bit-identical after a switch to top-k") {
  Sparsification topk;
  topk.ratio = 0.2;
  const JobAlgorithm first = comm::Compression(GradientAllReduce{});
  const JobAlgorithm second = comm::Compression(topk);
  MakeJob make = [=](Runtime& rt, std::shared_ptr<Net> net, int first_step) {
    auto ms = std::make_shared<ModelSwitch>(rt, net, first, small_buckets());
    if (first_step > 1) ms->switch_to(second);  // the saved run switched at step 2
    auto job = data_parallel_job(net, ms, 0.9);
    auto step = job.step;
    auto count = std::make_shared<int>(first_step);
    job.step = [=](const torch::Tensor& x, const torch::Tensor& y) {
      if ((*count)++ == 2) ms->switch_to(second);
      step(x, y);
    };
    return job;
  };
  check_bit_identical(make, "model-switch");
}

TEST_CASE("a ModelSwitch refuses a state saved under another algorithm, naming both") {
  Sparsification topk;
  topk.ratio = 0.2;
  auto errors = test::run_threads(kWorld, [&](int, Runtime& rt) {
    auto net = std::make_shared<Net>(7);
    ModelSwitch ms(rt, net, comm::Compression(GradientAllReduce{}), small_buckets());
    std::string state;
    comm::StateWriter out(state);
    ms.save_state(out);
    ms.switch_to(comm::Compression(topk));
    comm::StateReader in(state, "the test's state");
    CHECK_THROWS_WITH(ms.load_state(in),
                      doctest::Contains("saved while running allreduce (after 0 switches); this "
                                        "ModelSwitch runs top-k(0.2)+ef"));
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("a state saved under another algorithm is refused and leaves the model untouched") {
  Sparsification topk;
  topk.ratio = 0.2;
  auto errors = test::run_threads(kWorld, [&](int, Runtime& rt) {
    std::string state;
    {
      auto net = std::make_shared<Net>(7);
      DistributedModule ddp(rt, net, GradientAllReduce{}, small_buckets());
      Checkpoint c(rt);
      c.module(*net).algorithm(ddp);
      state = c.serialize_state();
    }
    auto net = std::make_shared<Net>(99);
    DistributedModule ddp(rt, net, topk, small_buckets());
    const auto before = params_of(*net);
    Checkpoint c(rt);
    c.module(*net).algorithm(ddp);
    CHECK_THROWS_WITH(c.restore_state(state, "the test's state"),
                      doctest::Contains("saved under algorithm allreduce, this DistributedModule "
                                        "runs top-k(0.2)+ef"));
    CHECK(identical(params_of(*net), before));
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("the asynchronous algorithms' state round-trips") {
  auto errors = test::run_threads(kWorld, [&](int rank, Runtime& rt) {
    const auto& d = data();
    std::string saved;
    {
      // A warm-up longer than the run: no background round changes the state under the test.
      auto net = std::make_shared<Net>(7);
      AsynchronousModule dp(rt, net, AsyncModelAverage{100, 50});
      torch::optim::SGD sgd(net->parameters(), 0.05);
      for (int s = 0; s < 3; ++s) {
        sgd.zero_grad();
        loss_of(*net, d.x(s, rank), d.y(s, rank)).backward();
        dp.step(sgd);
      }
      comm::StateWriter out(saved);
      dp.save_state(out);
      CHECK(dp.stats().steps == 3);
      dp.finish();
    }
    auto net = std::make_shared<Net>(7);
    AsynchronousModule dp(rt, net, AsyncModelAverage{100, 50});
    comm::StateReader in(saved, "the averager's state");
    dp.load_state(in);
    in.expect_end();
    CHECK(dp.stats().steps == 3);
    std::string again;
    comm::StateWriter out(again);
    dp.save_state(out);
    CHECK(again == saved);
    dp.finish();
  });
  for (auto& e : errors) CHECK(e == "");
}

namespace {

// One process, a torch::optim optimizer of troupe's: kSteps uninterrupted against kStop, a
// checkpoint of the model and the optimizer, new ones, a load and the rest.
using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(Net&)>;

void check_local_optimizer(const MakeOptimizer& make) {
  const auto& d = data();
  auto train = [&](Net& net, torch::optim::Optimizer& opt, int from, int to) {
    for (int s = from; s < to; ++s) {
      opt.zero_grad();
      loss_of(net, d.x(s, 0), d.y(s, 0)).backward();
      opt.step();
    }
  };
  Net straight(7);
  auto opt = make(straight);
  train(straight, *opt, 0, kSteps);
  std::string state;
  {
    Net first(7);
    auto o = make(first);
    train(first, *o, 0, kStop);
    Checkpoint c(0, 1);
    c.module(first).optimizer(*o);
    state = c.serialize_state();
  }
  Net resumed(99);
  auto o = make(resumed);
  Checkpoint c(0, 1);
  c.module(resumed).optimizer(*o);
  c.restore_state(state);
  train(resumed, *o, kStop, kSteps);
  CHECK(identical(params_of(straight), params_of(resumed)));
}

}  // namespace

TEST_CASE("a resumed SparsifiedSGD run is bit-identical (memory, estimated weights, step count)") {
  check_local_optimizer([](Net& net) {
    return std::make_unique<optim::SparsifiedSGD>(net.parameters(),
                                                  optim::SparsifiedSgdOptions(0.05).ratio(0.2));
  });
}

TEST_CASE("a resumed SignSGD run with momentum is bit-identical") {
  check_local_optimizer([](Net& net) {
    return std::make_unique<optim::SignSGD>(net.parameters(),
                                            optim::SignSgdOptions(0.01).momentum(0.9));
  });
}

TEST_CASE("a checkpoint restores torch's generator and the embedder's values") {
  auto net = torch::nn::Linear(3, 2);
  int64_t epoch = 4, batch = 17;
  std::string shuffle = "generator state";
  Checkpoint checkpoint(0, 1);
  checkpoint.module(*net)
      .rng()
      .value("epoch", epoch)
      .value("batch", batch)
      .bytes("shuffle", shuffle);
  torch::manual_seed(3);
  const auto state = checkpoint.serialize_state();
  const auto drawn = torch::rand({8});
  const auto weights = net->weight.detach().clone();
  torch::manual_seed(1000);
  epoch = batch = 0;
  shuffle.clear();
  {
    torch::NoGradGuard no_grad;
    net->weight.fill_(0);
  }
  checkpoint.restore_state(state);
  CHECK(torch::equal(torch::rand({8}), drawn));
  CHECK(torch::equal(net->weight, weights));
  CHECK(epoch == 4);
  CHECK(batch == 17);
  CHECK(shuffle == "generator state");
}

namespace {

// A saved one-rank checkpoint of a small module, and what a refused load must leave unchanged.
struct Saved {
  std::string dir = fresh_dir("bad-input");
  std::string file;
  torch::nn::Linear net{3, 2};
  int64_t epoch = 6;
  Saved() {
    Checkpoint c(0, 1);
    c.module(*net).value("epoch", epoch);
    c.save(dir);
    file = Checkpoint::file_of(dir, 0);
  }
  ~Saved() { fs::remove_all(dir); }
  std::string bytes() const {
    std::ifstream in(file, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  void write(const std::string& bytes) const {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  }
  // Loads into a fresh module and value with `rank` of `world`: throws what the load threw, after
  // checking that nothing was changed.
  void load(int rank = 0, int world = 1) const {
    torch::nn::Linear fresh(3, 2);
    {
      torch::NoGradGuard no_grad;
      fresh->weight.fill_(-1);
    }
    int64_t value = -1;
    Checkpoint c(rank, world);
    c.module(*fresh).value("epoch", value);
    try {
      c.load(dir);
    } catch (...) {
      CHECK(value == -1);
      CHECK(torch::equal(fresh->weight, torch::full({2, 3}, -1.0)));
      throw;
    }
  }
};

}  // namespace

TEST_CASE("a checkpoint file is written atomically and loads back") {
  Saved saved;
  // A temporary file of an earlier process of this rank that died mid-save, and another rank's.
  std::ofstream(saved.file + ".tmp.999999") << "half a file";
  std::ofstream(Checkpoint::file_of(saved.dir, 1) + ".tmp.999999") << "another rank's";
  {
    Checkpoint c(0, 1);
    c.module(*saved.net).value("epoch", saved.epoch);
    c.save(saved.dir);
  }
  CHECK_FALSE(fs::exists(saved.file + ".tmp.999999"));
  CHECK(fs::exists(Checkpoint::file_of(saved.dir, 1) + ".tmp.999999"));  // not this rank's
  fs::remove(Checkpoint::file_of(saved.dir, 1) + ".tmp.999999");
  for (auto& entry : fs::directory_iterator(saved.dir))
    CHECK(entry.path().filename() == "rank-0.troupe");  // no temporary file left behind
  torch::nn::Linear fresh(3, 2);
  int64_t epoch = 0;
  Checkpoint c(0, 1);
  c.module(*fresh).value("epoch", epoch);
  c.load(saved.dir);
  CHECK(torch::equal(fresh->weight, saved.net->weight));
  CHECK(epoch == 6);
}

TEST_CASE("a missing checkpoint file is refused, naming the file") {
  Saved saved;
  fs::remove(saved.file);
  CHECK_THROWS_WITH(saved.load(), mentions("checkpoint '" + saved.file +
                                           "': cannot open: No such file or directory"));
}

TEST_CASE("a truncated checkpoint file is refused, naming the file") {
  Saved saved;
  auto bytes = saved.bytes();
  saved.write(bytes.substr(0, bytes.size() - 10));
  CHECK_THROWS_WITH(saved.load(), mentions("'" + saved.file + "': truncated"));
  saved.write(bytes.substr(0, 20));
  CHECK_THROWS_WITH(saved.load(), mentions("'" + saved.file + "': truncated"));
}

TEST_CASE("a checkpoint file with a flipped byte is refused as corrupt") {
  Saved saved;
  auto bytes = saved.bytes();
  bytes[bytes.size() - 3] ^= 0x10;
  saved.write(bytes);
  CHECK_THROWS_WITH(saved.load(), mentions("'" + saved.file + "': corrupt"));
}

TEST_CASE("a checkpoint file of another format version is refused") {
  Saved saved;
  auto bytes = saved.bytes();
  bytes[8] = 7;  // the version follows the 8-byte magic
  saved.write(bytes);
  CHECK_THROWS_WITH(saved.load(),
                    mentions("'" + saved.file + "': format version 7, this build reads version " +
                             std::to_string(troupe::Checkpoint::kVersion)));
  // A file of the version before (Streaming DiLoCo's state then lacked what eager updates keep).
  bytes[8] = 1;
  saved.write(bytes);
  CHECK_THROWS_WITH(saved.load(), mentions("': format version 1, this build reads version 3"));
  // Version 2: an optimizer's state did not yet name the LibTorch that wrote it.
  bytes[8] = 2;
  saved.write(bytes);
  CHECK_THROWS_WITH(saved.load(), mentions("': format version 2, this build reads version 3"));
  saved.write("not a checkpoint at all, but long enough to hold a header of sixty bytes....");
  CHECK_THROWS_WITH(saved.load(), doctest::Contains("not a troupe checkpoint"));
}

TEST_CASE("a checkpoint of another world size or rank is refused") {
  Saved saved;
  CHECK_THROWS_WITH(saved.load(0, 2), mentions("'" + saved.file +
                                               "': saved by a job of world size 1, this "
                                               "job has world size 2"));
  // Rank 1's file under rank 0's name.
  Checkpoint c(1, 2);
  int64_t epoch = 1;
  c.value("epoch", epoch);
  c.save(saved.dir);
  fs::rename(Checkpoint::file_of(saved.dir, 1), Checkpoint::file_of(saved.dir, 0));
  Checkpoint rank0(0, 2);
  rank0.value("epoch", epoch);
  CHECK_THROWS_WITH(rank0.load(saved.dir), doctest::Contains("saved by rank 1, this is rank 0"));
}

TEST_CASE("a checkpoint of another model is refused before anything is loaded") {
  Saved saved;
  torch::nn::Linear other(4, 2);
  int64_t value = -1;
  Checkpoint c(0, 1);
  c.module(*other).value("epoch", value);
  CHECK_THROWS_WITH(c.load(saved.dir),
                    doctest::Contains("'weight' saved as Float[2, 3], the module has Float[2, 4]"));
  CHECK(value == -1);
  Checkpoint parts(0, 1);
  parts.value("epoch", value).value("batch", value);
  CHECK_THROWS_WITH(parts.load(saved.dir),
                    doctest::Contains("it holds the parts [module, value epoch], this Checkpoint "
                                      "has [value epoch, value batch]"));
}

TEST_CASE(
    "an optimizer's state loads exactly under the LibTorch that wrote it, and another's is "
    "refused naming both versions") {
  torch::manual_seed(3);
  torch::nn::Linear net(3, 2);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    adam.zero_grad();
    net->forward(torch::rand({4, 3})).sum().backward();
    adam.step();
  }
  std::string bytes;
  troupe::comm::StateWriter out(bytes);
  troupe::save_optimizer(adam, out);

  auto moments_of = [&net](torch::optim::Adam& opt) {
    auto& state = static_cast<torch::optim::AdamParamState&>(
        *opt.state().at(net->weight.unsafeGetTensorImpl()));
    return std::make_pair(state.step(), state.exp_avg_sq().clone());
  };
  torch::optim::Adam same(net->parameters(), torch::optim::AdamOptions(0.1));
  troupe::comm::StateReader in(bytes, "adam's state");
  troupe::load_optimizer(same, in);
  CHECK(moments_of(same).first == 2);
  CHECK(torch::equal(moments_of(same).second, moments_of(adam).second));

  // The same archive, labelled as another LibTorch's.
  troupe::comm::StateReader parts(bytes, "adam's state");
  CHECK(parts.string() == TORCH_VERSION);
  const std::string archive = parts.string();
  std::string other;
  troupe::comm::StateWriter relabel(other);
  relabel.string("1.13.1");
  relabel.string(archive);
  torch::optim::Adam fresh(net->parameters(), torch::optim::AdamOptions(0.1));
  troupe::comm::StateReader old_state(other, "adam's state");
  CHECK_THROWS_WITH(troupe::load_optimizer(fresh, old_state),
                    mentions("adam's state: the optimizer's state was written by LibTorch 1.13.1, "
                             "this build runs LibTorch " TORCH_VERSION));
  CHECK(fresh.state().empty());  // nothing was loaded
}
