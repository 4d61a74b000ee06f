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
    "train like one process; the other compressed algorithms stage the float32 bucket") {
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
      CHECK(paths[i] == "cuda via host staging, half precision cast on the device");
      // Only the 16-bit image crossed to the host, and the transport sent 2 bytes an element.
      CHECK(full[i] > 0);
      CHECK(cast[i] * 2 == full[i]);
      if (got[i].empty()) continue;
      CHECK(test::max_diff(got[i], want) < 1e-2);  // 16 bits on the wire
    }
  }
  // ByteGrad has no device codec in a gradient path: the float32 bucket is staged, and every rank
  // decodes the same bytes.
  auto got = train(job, ByteGrad{}, DdpOptions{}, /*nccl=*/false, on_gpu, &paths);
  for (int r = 0; r < job.world; ++r) {
    CAPTURE(r);
    CHECK(paths[static_cast<size_t>(r)] == "cuda via host staging");
    if (got[static_cast<size_t>(r)].empty() || got[0].empty()) continue;
    CHECK(test::max_diff(got[static_cast<size_t>(r)], got[0]) == 0);
    CHECK(test::max_diff(got[static_cast<size_t>(r)], want) < 5e-2);
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
