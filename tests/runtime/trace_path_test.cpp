// DdpOptions::trace_path is checked when the module is built: a trace that could not be written
// at destruction would be lost without a word (a destructor cannot throw).
#include "tests/support/torch_doctest.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

/// What building a DistributedModule with `trace_path` throws on a 1-rank job ("" when nothing).
std::string module_error(const std::string& trace_path) {
  auto errors = test::run_threads(1, [&](int, Runtime& rt) {
    DdpOptions options;
    options.trace_path = trace_path;
    DistributedModule module(rt, torch::nn::Linear(3, 2).ptr(), GradientAllReduce{}, options);
  });
  return errors.at(0);
}

}  // namespace

TEST_CASE("a trace path that cannot be written is an error at construction naming the file") {
  CHECK(module_error("/nonexistent-troupe-folder/trace_{rank}.json") ==
        "DdpOptions.trace_path: cannot write the trace of rank 0 to "
        "'/nonexistent-troupe-folder/trace_0.json': No such file or directory (expected a "
        "writable file)");
  const std::string folder = std::filesystem::temp_directory_path().string();
  CHECK(module_error(folder).find("cannot write the trace of rank 0 to '" + folder + "'") !=
        std::string::npos);  // a folder, not a file
  const std::string file = folder + "/troupe_trace_path_test_" + std::to_string(getpid()) + ".json";
  CHECK(module_error(file) == "");
  CHECK(std::filesystem::file_size(file) > 0);  // written at destruction
  std::filesystem::remove(file);
}
