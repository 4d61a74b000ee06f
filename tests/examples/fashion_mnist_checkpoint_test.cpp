// The Fashion-MNIST example as processes: a run of a few hundred steps, and the same run stopped
// after a checkpoint and resumed from it, must end with the same parameters (the checksum rank 0
// prints). Top-k with error feedback, so the algorithm's state must survive too.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/example_run.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

namespace fs = std::filesystem;

using Run = test::ExampleRun;

Run fashion_mnist(const std::vector<std::string>& extra, const std::string& batch = "16",
                  const std::string& model = "mlp") {
  // 1024 images per rank in batches of 16: 64 steps per epoch, 256 in all.
  // clang-format off
  std::vector<std::string> command = {FASHION_MNIST_BIN, "--model", model, "--subset", "2048",
      "--batch", batch, "--epochs", "4", "--log-every", "1000", "--threads", "1", "--algorithm",
      "topk:ratio=0.05", "--momentum", "0.9"};
  // clang-format on
  command.insert(command.end(), extra.begin(), extra.end());
  return test::run_example(2, command);
}

// What follows "parameter checksum " on rank 0's line; "" when none.
std::string checksum(const std::string& log) {
  const std::string key = "[rank 0] parameter checksum ";
  auto at = log.find(key);
  if (at == std::string::npos) return "";
  at += key.size();
  return log.substr(at, log.find('\n', at) - at);
}

// Every rank failed (the first to fail exits 1; the launcher may stop the others first).
bool none_succeeded(const std::vector<int>& exit_codes) {
  for (int code : exit_codes)
    if (code == 0) return false;
  return !exit_codes.empty();
}

}  // namespace

TEST_CASE("fashion_mnist stopped after a checkpoint and resumed ends bit-identical to one run") {
  const auto dir = (fs::temp_directory_path() /
                    ("troupe-fashion-mnist-checkpoint-" + std::to_string(::getpid())))
                       .string();
  fs::remove_all(dir);
  auto straight = fashion_mnist({});
  INFO(straight.log);
  REQUIRE(straight.exit_codes == std::vector<int>{0, 0});
  REQUIRE(checksum(straight.log).size() == 64);

  auto stopped =
      fashion_mnist({"--checkpoint", dir, "--checkpoint-every", "100", "--stop-step", "150"});
  INFO(stopped.log);
  REQUIRE(stopped.exit_codes == std::vector<int>{0, 0});
  CHECK(stopped.log.find("[rank 0] stopping after step 150") != std::string::npos);
  CHECK(checksum(stopped.log).empty());
  // The job's checkpoint: step 100 saved by both ranks and recorded complete by each.
  CHECK(fs::exists(dir + "/step-100/rank-0.troupe"));
  CHECK(fs::exists(dir + "/step-100/rank-1.troupe"));
  CHECK(fs::exists(dir + "/rank-1.complete"));

  auto resumed = fashion_mnist({"--resume", dir});
  INFO(resumed.log);
  REQUIRE(resumed.exit_codes == std::vector<int>{0, 0});
  CHECK(resumed.log.find("[rank 0] resumed from " + dir + " at step 100 (epoch 2, batch 36)") !=
        std::string::npos);
  CHECK(checksum(resumed.log) == checksum(straight.log));

  // Another batch size reorders the data: refused, naming it, on every rank.
  auto rebatched = fashion_mnist({"--resume", dir}, "32");
  INFO(rebatched.log);
  CHECK(none_succeeded(rebatched.exit_codes));
  CHECK(rebatched.log.find("part 'setting batch': saved with batch 16, this run has batch 32") !=
        std::string::npos);

  // The ranks' folders of different steps (rank 1 lagging at step 100 while rank 0 recorded 200, as
  // when each host keeps its own files): refused by name, where the resume used to go on.
  auto again = fashion_mnist({"--resume", dir, "--checkpoint", dir, "--checkpoint-every", "100"});
  INFO(again.log);
  REQUIRE(again.exit_codes == std::vector<int>{0, 0});
  REQUIRE(fs::exists(dir + "/step-200/rank-1.troupe"));
  fs::remove(dir + "/step-200/rank-1.troupe");
  { std::ofstream(dir + "/rank-1.complete", std::ios::trunc) << "step 100\n"; }
  auto mixed = fashion_mnist({"--resume", dir});
  INFO(mixed.log);
  CHECK(none_succeeded(mixed.exit_codes));
  CHECK(mixed.log.find(
            "step 200 was recorded complete by rank 0, but its file is missing on rank 1") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE(
    "fashion_mnist with --overlap-next-forward ends bit-identical to the ordinary run, "
    "through a checkpoint too") {
  // The CNN, whose forward awaits each layer; top-k with error feedback as above.
  auto with = [](const std::vector<std::string>& extra) {
    return fashion_mnist(extra, "16", "cnn");
  };
  auto straight = with({});
  INFO(straight.log);
  REQUIRE(straight.exit_codes == std::vector<int>{0, 0});
  REQUIRE(checksum(straight.log).size() == 64);
  auto overlapped = with({"--overlap-next-forward"});
  INFO(overlapped.log);
  REQUIRE(overlapped.exit_codes == std::vector<int>{0, 0});
  CHECK(checksum(overlapped.log) == checksum(straight.log));

  // The checkpoint after step 100 holds step 100's update, which the overlap applies only in the
  // next forward: the example awaits it before saving.
  const auto dir =
      (fs::temp_directory_path() / ("troupe-fashion-mnist-overlap-" + std::to_string(::getpid())))
          .string();
  fs::remove_all(dir);
  auto stopped = with({"--overlap-next-forward", "--checkpoint", dir, "--checkpoint-every", "100",
                       "--stop-step", "150"});
  INFO(stopped.log);
  REQUIRE(stopped.exit_codes == std::vector<int>{0, 0});
  auto resumed = with({"--overlap-next-forward", "--resume", dir});
  INFO(resumed.log);
  REQUIRE(resumed.exit_codes == std::vector<int>{0, 0});
  CHECK(checksum(resumed.log) == checksum(straight.log));
  fs::remove_all(dir);

  // The others take no gradient buckets: refused by name.
  auto gossip = test::run_example(
      2, {FASHION_MNIST_BIN, "--model", "cnn", "--subset", "2048", "--epochs", "1", "--algorithm",
          "decentralized:topology=ring", "--overlap-next-forward"});
  INFO(gossip.log);
  CHECK(none_succeeded(gossip.exit_codes));
  CHECK(gossip.log.find("--overlap-next-forward with --algorithm decentralized:topology=ring: "
                        "expected allreduce or a compressor") != std::string::npos);
}
