// Bad input to troupe's tools is refused up front with a message that names the flag or key, the
// value and what is allowed: never a stack trace, a bare std::bad_alloc, or a run that "succeeds"
// without doing anything.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "elastic/launch.h"
#include "tests/support/command.h"
#include "tests/support/idx_files.h"

namespace {

namespace fs = std::filesystem;

using troupe::test::Output;
using troupe::test::run;

bool has(const Output& out, const std::string& part) {
  return out.text.find(part) != std::string::npos;
}

/// The command failed, saying `part`.
void check_refused(const Output& out, const std::string& part) {
  INFO(out.text);
  CHECK(out.status != 0);
  CHECK(has(out, part));
}

const std::string kTroupe = TROUPE_BIN;
const std::string kFashionMnist = fs::path(TROUPE_BIN).parent_path().string() + "/fashion_mnist";
const std::string kCharLm = fs::path(TROUPE_BIN).parent_path().string() + "/char_lm";

/// A fresh folder removed with everything in it; `train` and `test` images written into it.
struct DataFolder {
  DataFolder(uint32_t train, uint32_t test) {
    std::string pattern = (fs::temp_directory_path() / "troupe-bad-input-XXXXXX").string();
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path = pattern;
    troupe::test::write_split(path, "train", train);
    troupe::test::write_split(path, "t10k", test);
  }
  ~DataFolder() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
  /// A job file in the folder: `job` and `trainer` are the bodies of [job] and [trainer].
  std::string job(const std::string& job_table, const std::string& trainer) const {
    const std::string file = path + "/job.toml";
    std::ofstream(file) << "[job]\n"
                        << job_table << "\n[algorithm]\nname = \"allreduce\"\n"
                        << "[trainer]\nmodel = \"mlp\"\ndata = \"" << path << "\"\n"
                        << trainer;
    return file;
  }
  std::string path;
};

}  // namespace

TEST_CASE("troupe bench allreduce refuses a negative, a partial and an unallocatable size") {
  check_refused(run(kTroupe + " bench allreduce --transport inproc --bytes -5"),
                "--bytes: size '-5' is not a number");
  check_refused(run(kTroupe + " bench allreduce --transport inproc --bytes 3"),
                "--bytes: size '3' is not a whole number of 4-byte elements");
  auto huge = run(kTroupe + " bench allreduce --transport inproc --world 2 --bytes 1024GiB");
  check_refused(huge,
                "--bytes 1024GiB on 2 rank(s) needs at least 2 TiB of memory but this host has");
  CHECK_FALSE(has(huge, "bad_alloc"));
}

TEST_CASE("troupe bench ddp refuses a model it does not have, naming the two it has") {
  auto unknown = run(kTroupe + " bench ddp --world 1 --model resnet --steps 1");
  INFO(unknown.text);
  CHECK(unknown.status != 0);
  CHECK(has(unknown, "--model 'resnet' (expected mlp or cnn)"));
}

TEST_CASE(
    "troupe bench ddp and char_lm refuse a device they do not know, or one the process does not "
    "see, naming it") {
  for (const std::string& program : {kTroupe + " bench ddp --world 1 --steps 1", kCharLm}) {
    CAPTURE(program);
    check_refused(run(program + " --device gpu0"), "'gpu0' (expected cpu, cuda or cuda:N)");
    // No machine has a thousand GPUs: the message says how many this one has (maybe none).
    auto absent = run(program + " --device cuda:999");
    check_refused(absent, "--device cuda:999: this process sees ");
    CHECK_FALSE(has(absent, "terminate called"));
  }
}

TEST_CASE("floating and integer flags name the flag, the value and the range") {
  auto nan_lr = run(kFashionMnist + " --lr nan");
  INFO(nan_lr.text);
  CHECK(nan_lr.status != 0);
  CHECK(has(nan_lr, "--lr: nan is not a finite number (expected a number > 0)"));
  CHECK_FALSE(has(nan_lr, "Exception raised from"));  // no torch stack trace
  auto zero_epochs = run(kFashionMnist + " --epochs 0");
  INFO(zero_epochs.text);
  CHECK(zero_epochs.status != 0);
  CHECK(has(zero_epochs, "--epochs: 0 is out of range (expected an integer >= 1)"));
  auto many = run(kTroupe + " launch -n 5000 -- true");
  INFO(many.text);
  CHECK(many.status != 0);
  CHECK(has(many, "--nprocs: 5000 is out of range (expected an integer in 1..4096)"));
}

TEST_CASE("troupe run refuses a job of more ranks than one host starts, starting none") {
  DataFolder data(10, 10);
  // A program that does not exist: were the size not checked, the launch would stop at rank 0.
  const std::string job =
      data.job("world_size = 100000\nmode = \"processes\"", "program = \"/nonexistent/trainer\"\n");
  auto out = run(kTroupe + " run " + job);
  INFO(out.text);
  CHECK(out.status != 0);
  CHECK(has(out, "job.world_size = 100000: expected an integer in [1, 4096]"));
  CHECK_FALSE(has(out, "cannot start"));
}

TEST_CASE("a batch larger than a rank's shard, or an empty test set, is refused before training") {
  SUBCASE("three training images and a batch of 64") {
    DataFolder data(3, 10);
    auto out =
        run(kTroupe + " run " + data.job("world_size = 1\nmode = \"threads\"", "batch = 64\n"));
    INFO(out.text);
    CHECK(out.status != 0);
    CHECK(has(out, "batch 64 per rank is larger than each rank's shard of 3 training image(s)"));
    CHECK_FALSE(has(out, "test accuracy"));
  }
  SUBCASE("a shard of 5 images per rank and a batch of 6") {
    DataFolder data(10, 10);
    auto out =
        run(kTroupe + " run " + data.job("world_size = 2\nmode = \"threads\"", "batch = 6\n"));
    INFO(out.text);
    CHECK(out.status != 0);
    CHECK(has(out, "batch 6 per rank is larger than each rank's shard of 5 training image(s)"));
    CHECK_FALSE(has(out, "test accuracy"));
  }
  SUBCASE("no test images") {
    DataFolder data(64, 0);
    auto out =
        run(kTroupe + " run " + data.job("world_size = 1\nmode = \"threads\"", "batch = 8\n"));
    INFO(out.text);
    CHECK(out.status != 0);
    CHECK(has(out, "the test set holds no images"));
  }
}

TEST_CASE("a trace path that cannot be written fails the run naming the path") {
  DataFolder data(64, 10);
  const std::string port = std::to_string(troupe::pick_free_port());
  auto out = run("MASTER_PORT=" + port + " " + kFashionMnist + " --model mlp --batch 8 --data " +
                 data.path + " --trace /nonexistent-troupe-folder/trace_{rank}.json");
  INFO(out.text);
  CHECK(out.status != 0);
  CHECK(has(out, "cannot write the trace of rank 0 to '/nonexistent-troupe-folder/trace_0.json'"));
}
