// The Fashion-MNIST example on a GPU (--device): one rank, and two processes sharing the one GPU
// with a compressed algorithm, each against a CPU run of the same job; and a device that is not
// there refused by name (this half runs everywhere).
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "tests/support/example_run.h"
#include "tests/support/skip.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

test::ExampleRun fashion_mnist(int ranks, const std::vector<std::string>& extra) {
  // clang-format off
  std::vector<std::string> command = {FASHION_MNIST_BIN, "--model", "cnn", "--subset", "8192",
      "--batch", "32", "--epochs", "1", "--log-every", "1000", "--threads", "1"};
  // clang-format on
  command.insert(command.end(), extra.begin(), extra.end());
  return test::run_example(ranks, command);
}

// Rank 0's "epoch 1 test accuracy X%" as a fraction; -1 when absent.
double accuracy(const std::string& log) {
  const std::string key = "[rank 0] epoch 1 test accuracy ";
  const auto at = log.find(key);
  return at == std::string::npos ? -1 : std::stod(log.substr(at + key.size())) / 100;
}

}  // namespace

TEST_CASE("fashion_mnist refuses a CUDA device it does not see, naming it and what it sees") {
  const int gpus = static_cast<int>(torch::cuda::device_count());
  const std::string device = gpus == 0 ? "cuda" : "cuda:" + std::to_string(gpus);
  auto run = fashion_mnist(1, {"--device", device});
  INFO(run.log);
  CHECK(run.exit_codes == std::vector<int>{1});
  if (gpus == 0)
    CHECK(run.log.find("--device cuda: this process sees no CUDA device") != std::string::npos);
  else
    CHECK(run.log.find("--device " + device + ": this process sees " + std::to_string(gpus) +
                       " CUDA device(s)") != std::string::npos);
  auto bad = fashion_mnist(1, {"--device", "gpu0"});
  CHECK(bad.log.find("'gpu0' (expected cpu, cuda or cuda:N)") != std::string::npos);
}

TEST_CASE(
    "fashion_mnist trains on the GPU as on the CPU: one rank, and two processes sharing the "
    "GPU with fp16 compression") {
  if (torch::cuda::device_count() == 0) {
    test::skip_case("no CUDA device");
    return;
  }
  for (int ranks : {1, 2}) {
    CAPTURE(ranks);
    const std::vector<std::string> algorithm =
        ranks == 1 ? std::vector<std::string>{} : std::vector<std::string>{"--algorithm", "fp16"};
    auto cpu = fashion_mnist(ranks, algorithm);
    auto gpu_args = algorithm;
    gpu_args.insert(gpu_args.end(), {"--device", "cuda"});
    auto gpu = fashion_mnist(ranks, gpu_args);
    INFO("cpu:\n" << cpu.log << "\ngpu:\n" << gpu.log);
    REQUIRE(cpu.exit_codes == std::vector<int>(static_cast<size_t>(ranks), 0));
    REQUIRE(gpu.exit_codes == std::vector<int>(static_cast<size_t>(ranks), 0));
    CHECK(gpu.log.find("on cuda:0") != std::string::npos);
    // Another device's kernels round differently: the same job learns as well, not bit for bit.
    CHECK(accuracy(gpu.log) > 0.6);
    CHECK(std::abs(accuracy(gpu.log) - accuracy(cpu.log)) < 0.03);
  }
}
