// DistributedModule with CUDA parameters, ranks as threads: host staging (inproc, several ranks on
// one GPU), a compressed algorithm (which always stages), and NCCL (one rank, or one GPU per rank
// where the machine has several), each against one process trained on the whole batch. Every case
// skips itself unless torch sees a CUDA device.
#include "tests/support/torch_doctest.h"

#include <chrono>
#include <string>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "ddp/distributed_module.h"
#include "elastic/launch.h"
#include "tests/support/skip.h"
#include "tests/support/tensors.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

bool skip_without_cuda() {
  if (torch::cuda::is_available()) return false;
  troupe::test::skip_case("torch sees no CUDA device: skipping the CUDA DistributedModule case");
  return true;
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::tanh(fc2(torch::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

constexpr int64_t kBatch = 8;  // per rank
constexpr int kSteps = 4;

/// The job: initial weights, and each step's batch for the whole world (rank r takes rows
/// [r kBatch, (r + 1) kBatch)).
struct Job {
  explicit Job(int world) : world(world) {
    torch::manual_seed(7);
    initial = std::make_shared<Net>();
    for (int s = 0; s < kSteps; ++s) {
      inputs.push_back(torch::randn({world * kBatch, 16}));
      targets.push_back(torch::randn({world * kBatch, 4}));
    }
  }
  int world;
  std::shared_ptr<Net> initial;
  std::vector<torch::Tensor> inputs, targets;
};

/// One process on the whole batch, on the CPU: what every rank must end with.
std::vector<torch::Tensor> reference(const Job& job) {
  auto net = std::make_shared<Net>();
  test::copy_params(*job.initial, *net);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    sgd.zero_grad();
    torch::mse_loss(net->forward(job.inputs[s]), job.targets[s]).backward();
    sgd.step();
  }
  return test::clones(net->parameters());
}

/// One rank's training on device `device`; returns its final parameters on the CPU and the
/// module's gradient path, and the bytes it sent in its last step. `set_to_none`: each step
/// zeroes the gradients by setting them to none (Module::zero_grad(true)) instead of SGD's
/// zero_grad().
std::vector<torch::Tensor> train_rank(Runtime& rt, const Job& job, int device, Algorithm algorithm,
                                      DdpOptions options, std::string* path, bool set_to_none,
                                      size_t* bytes_sent) {
  const torch::Device cuda(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
  auto net = std::make_shared<Net>();
  test::copy_params(*job.initial, *net);
  net->to(cuda);
  DistributedModule ddp(rt, net, std::move(algorithm), std::move(options));
  *path = ddp.gradient_path();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t r = rt.rank();
  for (int s = 0; s < kSteps; ++s) {
    if (set_to_none)
      net->zero_grad(/*set_to_none=*/true);
    else
      sgd.zero_grad();
    auto x = job.inputs[s].narrow(0, r * kBatch, kBatch).to(cuda);
    auto y = job.targets[s].narrow(0, r * kBatch, kBatch).to(cuda);
    torch::mse_loss(net->forward(x), y).backward();
    ddp.step(sgd);
  }
  *bytes_sent = ddp.last_step().bytes_sent;
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().to(torch::kCPU));
  return out;
}

/// Runs `world` thread ranks; rank r on device device_of(r). Returns each rank's parameters;
/// `bytes`, when given, gets what each rank sent in its last step.
std::vector<std::vector<torch::Tensor>> train(const Job& job, Algorithm algorithm,
                                              DdpOptions options, bool nccl,
                                              const std::function<int(int)>& device_of,
                                              std::vector<std::string>* paths,
                                              bool set_to_none = false,
                                              std::vector<size_t>* bytes = nullptr) {
  auto fabric = std::make_shared<comm::InprocFabric>(job.world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> ranks;
  for (int r = 0; r < job.world; ++r) {
    ranks.push_back(test::thread_rank(r, job.world, port, fabric, 60s));
    ranks.back().nccl = nccl;
  }
  std::vector<std::vector<torch::Tensor>> params(static_cast<size_t>(job.world));
  paths->assign(static_cast<size_t>(job.world), "");
  std::vector<size_t> sent(static_cast<size_t>(job.world), 0);
  auto errors = test::run_ranks(ranks, [&](int r, Runtime& rt) {
    const auto i = static_cast<size_t>(r);
    params[i] =
        train_rank(rt, job, device_of(r), algorithm, options, &(*paths)[i], set_to_none, &sent[i]);
  });
  if (bytes) *bytes = sent;
  for (auto& e : errors) CHECK(e == "");
  return params;
}

}  // namespace

TEST_CASE(
    "CUDA parameters reduced through host staging by thread ranks on one GPU match one process") {
  if (skip_without_cuda()) return;
  const Job job(3);
  const auto want = reference(job);
  DdpOptions several;  // several buckets, rebuilt after step 1
  several.bucket_bytes = 4096;
  several.first_bucket_bytes = 1024;
  several.stage_through_host = true;
  DdpOptions copies = several;  // gradients copied in and out, everything reduced in step()
  copies.gradient_as_bucket_view = false;
  copies.delay_reduce = true;
  for (const auto& options : {several, copies}) {
    std::vector<std::string> paths;
    auto got = train(
        job, GradientAllReduce{}, options, /*nccl=*/false, [](int) { return 0; }, &paths);
    for (int r = 0; r < job.world; ++r) {
      CAPTURE(r);
      CHECK(paths[static_cast<size_t>(r)] == "cuda via host staging");
      if (got[static_cast<size_t>(r)].empty()) continue;
      CHECK(test::max_diff(got[static_cast<size_t>(r)], want) < 1e-4);
    }
  }
}

TEST_CASE(
    "fp16 and bf16 on CUDA parameters are cast on the device, stage half the bytes of float32 and "
    "train like one process; random-k stages the float32 bucket") {
  if (skip_without_cuda()) return;
  const Job job(2);
  const auto want = reference(job);
  auto on_gpu = [](int) { return 0; };
  std::vector<std::string> paths;
  std::vector<size_t> full, cast;
  DdpOptions staged;
  staged.stage_through_host = true;
  train(job, GradientAllReduce{}, staged, /*nccl=*/false, on_gpu, &paths, false, &full);
  for (bool bfloat16 : {false, true}) {
    CAPTURE(bfloat16);
    auto got = train(job, HalfPrecision{bfloat16}, DdpOptions{}, /*nccl=*/false, on_gpu, &paths,
                     false, &cast);
    for (int r = 0; r < job.world; ++r) {
      CAPTURE(r);
      const auto i = static_cast<size_t>(r);
      CHECK(paths[i] == "cuda via host staging, compressed on the device");
      // Only the 16-bit image crossed to the host, and the transport sent 2 bytes an element.
      CHECK(full[i] > 0);
      CHECK(cast[i] * 2 == full[i]);
      if (got[i].empty()) continue;
      CHECK(test::max_diff(got[i], want) < 1e-2);  // 16 bits on the wire
    }
  }
  // Random-k has no device codec: the float32 bucket is staged, and every rank decodes the same
  // bytes.
  auto got = train(job, Sparsification{.mode = SparseMode::random_k, .ratio = 0.5}, DdpOptions{},
                   /*nccl=*/false, on_gpu, &paths);
  for (int r = 0; r < job.world; ++r) {
    CAPTURE(r);
    CHECK(paths[static_cast<size_t>(r)] == "cuda via host staging");
    if (got[static_cast<size_t>(r)].empty() || got[0].empty()) continue;
    CHECK(test::max_diff(got[static_cast<size_t>(r)], got[0]) == 0);
  }
}

namespace {

// A model whose gradients have the same bits on any device: two linear maps of the input, each
// scored by a fixed linear loss, inputs and loss weights small integers. The gradient of a weight
// is c^T x and of a bias the sum of c: integers far below 2^24 (exact in float32 in any order of
// summation, and in TF32), whatever the weights. The two maps' sizes leave alignment padding in
// the buckets (3 x 16 + 3 is no multiple of 16 floats).
struct ExactNet : torch::nn::Module {
  ExactNet() {
    a = register_module("a", torch::nn::Linear(16, 40));
    b = register_module("b", torch::nn::Linear(16, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

constexpr int kExactSteps = 4;

// Rank r's batch of step s, and the loss weights of its two maps: integers in [-4, 4].
torch::Tensor small_integers(int64_t rows, int64_t cols, int64_t seed) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  return torch::randint(-4, 5, {rows, cols}, g, torch::kFloat);
}

// Each rank's reduced gradients (on the CPU) of steps [first, kExactSteps), with the module on
// `device`; the gradient path of rank 0 in `path`. `load`: each rank's module state to start from;
// `saved`: gets each rank's state after step kExactSteps / 2.
std::vector<std::vector<torch::Tensor>> exact_gradients(
    int world, const Algorithm& algorithm, const torch::Device& device, std::string* path,
    int first = 0, const std::vector<std::string>* load = nullptr,
    std::vector<std::string>* saved = nullptr) {
  DdpOptions options;
  options.bucket_bytes = 1024;  // several buckets, some with several tensors
  options.first_bucket_bytes = 512;
  options.rebuild_buckets = false;  // the same buckets on both devices (ready order may differ)
  std::vector<std::vector<torch::Tensor>> seen(static_cast<size_t>(world));
  std::vector<std::string> paths(static_cast<size_t>(world));
  if (saved) saved->assign(static_cast<size_t>(world), "");
  auto errors = test::run_threads(world, [&](int r, Runtime& rt) {
    torch::manual_seed(3);
    auto net = std::make_shared<ExactNet>();
    net->to(device);
    DistributedModule ddp(rt, net, algorithm, options);
    paths[static_cast<size_t>(r)] = ddp.gradient_path();
    const auto ca = small_integers(kBatch, 40, 100 + r).to(device);
    const auto cb = small_integers(kBatch, 3, 200 + r).to(device);
    if (load) {
      comm::StateReader in((*load)[static_cast<size_t>(r)], "rank " + std::to_string(r));
      ddp.load_state(in);
    }
    if (saved) (*saved)[static_cast<size_t>(r)].clear();
    for (int s = first; s < kExactSteps; ++s) {
      if (saved && s == kExactSteps / 2) {
        comm::StateWriter out((*saved)[static_cast<size_t>(r)]);
        ddp.save_state(out);
      }
      net->zero_grad();
      const auto x = small_integers(kBatch, 16, 1000 * s + r).to(device);
      ((net->a(x) * ca).sum() + (net->b(x) * cb).sum()).backward();
      ddp.step([&] {
        for (auto& p : net->parameters())
          seen[static_cast<size_t>(r)].push_back(p.grad().to(torch::kCPU));
      });
    }
  });
  for (auto& e : errors) CHECK(e == "");
  *path = paths[0];
  return seen;
}

}  // namespace

TEST_CASE(
    "fp16, bf16, sign, majority vote, ByteGrad, int4 and top-k compress on the device and reduce "
    "to the bits the same algorithm gives on the CPU, step after step") {
  if (skip_without_cuda()) return;
  const torch::Device cuda(torch::kCUDA, 0);
  const std::vector<std::pair<std::string, Algorithm>> algorithms = {
      {"fp16", HalfPrecision{}},
      {"bf16", HalfPrecision{.bfloat16 = true}},
      {"sign", SignCompression{}},
      {"sign without error feedback", SignCompression{.error_feedback = false}},
      {"majority vote", SignCompression{.mode = SignMode::majority_vote, .error_feedback = false}},
      {"bytegrad", ByteGrad{.block = 64}},
      {"int4", Int4Quantization{.block = 32}},
      {"top-k", Sparsification{.ratio = 0.05}},
      {"top-k without error feedback", Sparsification{.count = 5, .error_feedback = false}},
  };
  for (const auto& named : algorithms) {
    const std::string& name = named.first;
    const Algorithm& algorithm = named.second;
    CAPTURE(name);
    for (int world : {2, 3}) {
      CAPTURE(world);
      std::string cpu_path, gpu_path;
      const auto want = exact_gradients(world, algorithm, torch::kCPU, &cpu_path);
      const auto got = exact_gradients(world, algorithm, cuda, &gpu_path);
      CHECK(cpu_path == "cpu");
      CHECK(gpu_path == "cuda via host staging, compressed on the device");
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        const auto& w = want[static_cast<size_t>(r)];
        const auto& g = got[static_cast<size_t>(r)];
        REQUIRE(g.size() == w.size());
        REQUIRE(!w.empty());
        for (size_t i = 0; i < w.size(); ++i) {
          CAPTURE(i);
          CHECK(torch::equal(g[i], w[i]));
        }
      }
    }
  }
}

TEST_CASE(
    "one rank with NCCL trains like one process, and divide_before scales by the denominator") {
  if (skip_without_cuda()) return;
  const Job job(1);
  const auto want = reference(job);
  std::vector<std::string> paths;
  bool have_nccl = false;
  auto errors = test::run_threads(1, [&](int, Runtime& rt) { have_nccl = rt.nccl_available(); });
  REQUIRE(errors[0] == "");
  if (!have_nccl) {
    troupe::test::skip_case(
        "no NCCL unique id from rank 0 (troupe built without NCCL?): skipping the NCCL case");
    return;
  }
  auto got = train(
      job, GradientAllReduce{}, DdpOptions{}, /*nccl=*/true, [](int) { return 0; }, &paths);
  CHECK(paths[0] == "cuda via nccl");
  if (!got[0].empty()) CHECK(test::max_diff(got[0], want) < 1e-4);

  // A scaled NCCL sum: the gradients step() sees are the local ones / 4.
  errors = test::run_threads(1, [&](int, Runtime& rt) {
    const torch::Device cuda(torch::kCUDA, 0);
    auto net = std::make_shared<Net>();
    test::copy_params(*job.initial, *net);
    net->to(cuda);
    DdpOptions options;
    options.divide_before = true;
    DistributedModule ddp(rt, net, GradientAllReduce{}, options);
    REQUIRE(ddp.gradient_path() == "cuda via nccl");
    auto local = std::make_shared<Net>();
    test::copy_params(*job.initial, *local);
    torch::mse_loss(local->forward(job.inputs[0]), job.targets[0]).backward();
    std::vector<torch::Tensor> expected;
    for (auto& p : local->parameters()) expected.push_back(p.grad() / 4);
    ddp.set_denominator(4);
    torch::mse_loss(net->forward(job.inputs[0].to(cuda)), job.targets[0].to(cuda)).backward();
    std::vector<torch::Tensor> seen;
    ddp.step([&] {
      for (auto& p : net->parameters()) seen.push_back(p.grad().to(torch::kCPU));
    });
    CHECK(test::max_diff(seen, expected) < 1e-5);
  });
  CHECK(errors[0] == "");
}

TEST_CASE("NCCL over thread ranks with one GPU each matches one process") {
  if (skip_without_cuda()) return;
  const int devices = static_cast<int>(torch::cuda::device_count());
  if (devices < 2) {
    troupe::test::skip_case(
        "one CUDA device: NCCL needs one GPU per rank; skipping the multi-rank NCCL case");
    return;
  }
  const Job job(std::min(devices, 4));
  const auto want = reference(job);
  DdpOptions options;
  options.bucket_bytes = 4096;
  options.first_bucket_bytes = 1024;
  std::vector<std::string> paths;
  auto got = train(
      job, GradientAllReduce{}, options, /*nccl=*/true, [](int r) { return r; }, &paths);
  for (int r = 0; r < job.world; ++r) {
    CAPTURE(r);
    CHECK(paths[static_cast<size_t>(r)] == "cuda via nccl");
    if (got[static_cast<size_t>(r)].empty()) continue;
    CHECK(test::max_diff(got[static_cast<size_t>(r)], want) < 1e-4);
  }
}

TEST_CASE("CUDA gradients set to none are averaged through host staging and through NCCL") {
  if (skip_without_cuda()) return;
  const Job job(3);
  const auto want = reference(job);
  DdpOptions staged;
  staged.bucket_bytes = 4096;
  staged.first_bucket_bytes = 1024;
  staged.stage_through_host = true;
  DdpOptions copies = staged;
  copies.gradient_as_bucket_view = false;
  for (const auto& options : {staged, copies}) {
    CAPTURE(options.gradient_as_bucket_view);
    std::vector<std::string> paths;
    auto got = train(
        job, GradientAllReduce{}, options, /*nccl=*/false, [](int) { return 0; }, &paths,
        /*set_to_none=*/true);
    for (int r = 0; r < job.world; ++r) {
      CAPTURE(r);
      CHECK(paths[static_cast<size_t>(r)] == "cuda via host staging");
      if (got[static_cast<size_t>(r)].empty()) continue;
      CHECK(test::max_diff(got[static_cast<size_t>(r)], want) < 1e-4);
    }
  }

  // NCCL on one rank: a gradient that never reached its bucket would leave step() the local one
  // instead of the local one / 4.
  bool have_nccl = false;
  auto errors = test::run_threads(1, [&](int, Runtime& rt) { have_nccl = rt.nccl_available(); });
  REQUIRE(errors[0] == "");
  if (!have_nccl) {
    MESSAGE("no NCCL unique id from rank 0 (troupe built without NCCL?): skipping the NCCL case");
    return;
  }
  errors = test::run_threads(1, [&](int, Runtime& rt) {
    const torch::Device cuda(torch::kCUDA, 0);
    auto net = std::make_shared<Net>();
    test::copy_params(*job.initial, *net);
    net->to(cuda);
    DistributedModule ddp(rt, net);
    REQUIRE(ddp.gradient_path() == "cuda via nccl");
    auto local = std::make_shared<Net>();
    test::copy_params(*job.initial, *local);
    torch::mse_loss(local->forward(job.inputs[0]), job.targets[0]).backward();
    std::vector<torch::Tensor> expected;
    for (auto& p : local->parameters()) expected.push_back(p.grad() / 4);
    net->zero_grad(/*set_to_none=*/true);
    ddp.set_denominator(4);
    torch::mse_loss(net->forward(job.inputs[0].to(cuda)), job.targets[0].to(cuda)).backward();
    std::vector<torch::Tensor> seen;
    ddp.step([&] {
      for (auto& p : net->parameters()) seen.push_back(p.grad().to(torch::kCPU));
    });
    CHECK(test::max_diff(seen, expected) < 1e-5);
  });
  CHECK(errors[0] == "");
}

TEST_CASE(
    "the error memory of sign and top-k compressed on the device is checkpointed in the CPU's "
    "format: a GPU checkpoint resumes on the CPU, and a CPU one on the GPU, with the same bits") {
  if (skip_without_cuda()) return;
  const torch::Device cuda(torch::kCUDA, 0);
  for (const Algorithm& algorithm :
       {Algorithm(SignCompression{}), Algorithm(Sparsification{.ratio = 0.05})}) {
    CAPTURE(comm::algorithm_name(algorithm));
    const int world = 2;
    const size_t params = 4;  // per step: a.weight, a.bias, b.weight, b.bias
    const size_t later = params * (kExactSteps - kExactSteps / 2);  // the steps after the save
    std::string path;
    std::vector<std::string> from_gpu, from_cpu;
    const auto gpu = exact_gradients(world, algorithm, cuda, &path, 0, nullptr, &from_gpu);
    const auto cpu = exact_gradients(world, algorithm, torch::kCPU, &path, 0, nullptr, &from_cpu);
    const auto on_cpu =
        exact_gradients(world, algorithm, torch::kCPU, &path, kExactSteps / 2, &from_gpu);
    const auto on_gpu = exact_gradients(world, algorithm, cuda, &path, kExactSteps / 2, &from_cpu);
    const auto fresh = exact_gradients(world, algorithm, cuda, &path, kExactSteps / 2);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const auto i = static_cast<size_t>(r);
      REQUIRE(from_gpu[i] == from_cpu[i]);
      REQUIRE(on_cpu[i].size() == later);
      REQUIRE(on_gpu[i].size() == later);
      REQUIRE(gpu[i].size() == later + params * (kExactSteps / 2));
      for (size_t k = 0; k < later; ++k) {
        CAPTURE(k);
        const auto& want = gpu[i][gpu[i].size() - later + k];
        CHECK(torch::equal(on_cpu[i][k], want));
        CHECK(torch::equal(on_gpu[i][k], want));
      }
      // The error memory matters: without it (a fresh module from the same step) the bits differ.
      bool differs = false;
      for (size_t k = 0; k < later; ++k)
        differs = differs || !torch::equal(fresh[i][k], gpu[i][gpu[i].size() - later + k]);
      CHECK(differs);
    }
  }
}

TEST_CASE(
    "PowerSGD runs on the device (torch ops on the staging streams, two rounds a step) and matches "
    "the CPU reduction to rounding, through its warm-up and a checkpoint moved to the CPU") {
  if (skip_without_cuda()) return;
  const torch::Device cuda(torch::kCUDA, 0);
  // Step 0 is the warm-up's full allreduce; steps 1-3 compress a.weight (40 x 16, rank 2).
  for (bool warm_start : {true, false}) {
    CAPTURE(warm_start);
    const Algorithm power = PowerSGD{.rank = 2, .warm_start = warm_start, .start_iter = 1};
    for (int world : {2, 3}) {
      CAPTURE(world);
      std::string cpu_path, gpu_path;
      std::vector<std::string> saved;
      const auto want = exact_gradients(world, power, torch::kCPU, &cpu_path);
      const auto got = exact_gradients(world, power, cuda, &gpu_path, 0, nullptr, &saved);
      const auto resumed =
          exact_gradients(world, power, torch::kCPU, &cpu_path, kExactSteps / 2, &saved);
      CHECK(gpu_path == "cuda via host staging, compressed on the device");
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        const auto i = static_cast<size_t>(r);
        REQUIRE(got[i].size() == want[i].size());
        REQUIRE(!want[i].empty());
        for (size_t k = 0; k < want[i].size(); ++k) {
          CAPTURE(k);
          const double scale = std::max(1.0, want[i][k].abs().max().item<double>());
          CHECK((got[i][k] - want[i][k]).abs().max().item<double>() <= 1e-4 * scale);
          if (k < 4) CHECK(torch::equal(got[i][k], want[i][k]));  // the warm-up: a plain sum
        }
        // The GPU's state (memory, Qs) continued on the CPU gives the GPU's later steps.
        const size_t later = resumed[i].size();
        REQUIRE(later == got[i].size() / 2);
        for (size_t k = 0; k < later; ++k) {
          CAPTURE(k);
          const auto& g = got[i][got[i].size() - later + k];
          const double scale = std::max(1.0, g.abs().max().item<double>());
          CHECK((resumed[i][k] - g).abs().max().item<double>() <= 1e-4 * scale);
        }
      }
    }
  }
}
