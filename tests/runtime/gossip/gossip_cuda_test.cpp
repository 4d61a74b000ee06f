// The gossip algorithms of algorithms/gossip/ on CUDA parameters, ranks as threads: D-PSGD and
// Choco-SGD staged through host memory (several ranks on one GPU), asynchronous model averaging
// staged the same way, and D-PSGD over NCCL (one rank on one GPU, or one GPU per rank where the
// machine has several), each against the single-process simulations of gossip_reference.h run on
// the CPU. Every case skips itself unless torch sees a CUDA device.
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "ddp/data_parallel.h"
#include "tests/runtime/gossip/gossip_reference.h"
#include "tests/support/skip.h"

using namespace troupe;
using namespace troupe::test::gossip;

namespace {

bool skip_without_cuda() {
  if (torch::cuda::is_available()) return false;
  troupe::test::skip_case("torch sees no CUDA device: skipping the CUDA gossip case");
  return true;
}

torch::Device gpu(int index) {
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

// The ranks' weights against the simulation's, and every rank's gossip path.
void check_ranks(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                 const std::vector<std::string>& paths, const std::string& path, double tolerance) {
  REQUIRE(got.size() == want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CHECK(paths[r] == path);
    REQUIRE(got[r].defined());
    CHECK((got[r] - want[r]).abs().max().item<double>() < tolerance);
  }
}

// D-PSGD on a ring, overlap and after_step, on `world` thread ranks (rank r on device_of(r)):
// every rank on `path`, its weights those of the simulation.
void check_dpsgd(int world, int steps, const GossipOptions& options,
                 const std::function<torch::Device(int)>& device_of, const std::string& path) {
  const double lr = 0.1;
  for (auto exchange : {Decentralized::Exchange::overlap, Decentralized::Exchange::after_step}) {
    CAPTURE(static_cast<int>(exchange));
    Decentralized algo;
    algo.topology = ring();
    algo.topology.mixing = comm::Mixing::metropolis;
    algo.exchange = exchange;
    std::vector<std::string> paths;
    auto got = train_ranks(
        world, steps, lr,
        [&](Runtime& rt, std::shared_ptr<Net> net) {
          return std::make_unique<DecentralizedModule>(rt, net, algo, options);
        },
        device_of, /*nccl=*/true, &paths);
    check_ranks(got, dpsgd_reference(algo, world, steps, lr), paths, path, 1e-4);
  }
}

}  // namespace

TEST_CASE("D-PSGD on CUDA parameters staged through host memory equals the simulation") {
  if (skip_without_cuda()) return;
  GossipOptions options;
  options.stage_through_host = true;  // four ranks share one GPU: no NCCL between them
  check_dpsgd(
      4, 5, options, [](int) { return gpu(0); }, "cuda via host staging");
}

TEST_CASE("Choco-SGD on CUDA parameters stages through host memory and equals the simulation") {
  if (skip_without_cuda()) return;
  const int world = 4, steps = 4;
  const double lr = 0.1;
  LowPrecisionDecentralized algo;
  algo.topology = ring();
  algo.gamma = 0.5;
  algo.block = 16;
  std::vector<std::string> paths;
  // Choco-SGD always stages, even where the Runtime has NCCL.
  auto got = train_ranks(
      world, steps, lr,
      [&](Runtime& rt, std::shared_ptr<Net> net) {
        return std::make_unique<DecentralizedModule>(rt, net, algo);
      },
      [](int) { return gpu(0); }, /*nccl=*/true, &paths);
  // The GPU's gradients differ from the CPU's in the last bits, which may move a difference
  // across an 8-bit rounding boundary: one quantisation step (range / 255 of a block of
  // differences, about 2e-4 here) times gamma times a weight. A missing copy back to the device
  // would be off by a whole step of SGD (about 1e-2).
  check_ranks(got, choco_reference(algo, world, steps, lr), paths, "cuda via host staging", 1e-3);
}

TEST_CASE(
    "asynchronous model average on CUDA parameters: warm-up allreduces gradients, the stop round "
    "averages") {
  if (skip_without_cuda()) return;
  const int world = 3;
  std::vector<torch::Tensor> after_warmup(world), after_finish(world);
  std::vector<std::string> paths(world);
  std::vector<double> distances(world, -1);
  const auto init = initial_weights();
  auto errors = test::run_threads(world, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>();
    if (rank == 0) load_flat(*net, init);
    net->to(gpu(0));
    AsyncModelAverage algo;
    algo.warmup_steps = 2;
    algo.sync_interval_ms = 60000;  // no timer round: only the stop round
    AsynchronousModule dp(rt, net, algo);
    paths[static_cast<size_t>(rank)] = dp.gossip_path();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      auto [x, y] = batch(rank, s);
      torch::mse_loss(net->forward(x.to(gpu(0))), y.to(gpu(0))).backward();
      dp.step(opt);
    }
    after_warmup[static_cast<size_t>(rank)] = flat_of(*net);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.fill_(static_cast<float>(rank + 1));
    }
    dp.finish();  // the stop round averages the device weights through the host mirror
    after_finish[static_cast<size_t>(rank)] = flat_of(*net);
    // Every rank now holds the mean: consensus_distance takes the CUDA weights through the host.
    distances[static_cast<size_t>(rank)] = consensus_distance(rt, *net);
  });
  check_no_errors(errors);
  const auto x = allreduce_sgd_reference(world, 2, 0.1);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(paths[static_cast<size_t>(r)] == "cuda via host staging");
    REQUIRE(after_warmup[static_cast<size_t>(r)].defined());
    CHECK((after_warmup[static_cast<size_t>(r)] - x).abs().max().item<double>() < 1e-4);
    CHECK((after_finish[static_cast<size_t>(r)] - 2.0).abs().max().item<double>() < 1e-6);
    CHECK(distances[static_cast<size_t>(r)] >= 0);
    CHECK(distances[static_cast<size_t>(r)] < 1e-6);
  }
}

TEST_CASE("D-PSGD over NCCL with world size 1 is SGD on the device") {
  if (skip_without_cuda()) return;
  check_dpsgd(
      1, 4, GossipOptions{}, [](int) { return gpu(0); }, "cuda via nccl");
}

TEST_CASE("D-PSGD over NCCL with one GPU per rank equals the simulation") {
  if (skip_without_cuda()) return;
  const int world = std::min(4, static_cast<int>(torch::cuda::device_count()));
  if (world < 2) {
    troupe::test::skip_case(
        "one CUDA device: NCCL needs a GPU per rank, skipping the multi-rank NCCL gossip case");
    return;
  }
  check_dpsgd(
      world, 5, GossipOptions{}, [](int rank) { return gpu(rank); }, "cuda via nccl");
}
