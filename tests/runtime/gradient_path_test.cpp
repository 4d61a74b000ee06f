// The choice of a module's gradient path (ddp/gradient_path.h): the first candidate that can
// serve is taken, the others say why they declined, and when none can the error lists every reason.
#include "tests/support/torch_doctest.h"

#include <memory>
#include <string>
#include <vector>

#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"
#include "rank/device.h"
#ifdef TROUPE_HAVE_CUDA
#include "ddp/gradient_path/device_codecs.h"
#endif
#include "tests/support/ddp_reference.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

namespace {

// A candidate that serves when `why` is empty and declines with `why` otherwise; it counts how
// often it was asked.
class FakePath : public GradientPath {
 public:
  FakePath(std::string name, std::string why, int* asked)
      : name_(std::move(name)), why_(std::move(why)), asked_(asked) {}
  std::string name() const override { return name_; }
  std::string can_serve(const GradientPathContext&) const override {
    ++*asked_;
    return why_;
  }
  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer&,
                                             std::vector<void*>) override {
    return nullptr;
  }

 private:
  std::string name_;
  std::string why_;
  int* asked_;
};

}  // namespace

TEST_CASE("the first gradient path that can serve is chosen, and the ones before it say why not") {
  std::vector<int> asked(3, 0);
  std::vector<std::unique_ptr<GradientPath>> candidates;
  candidates.push_back(
      std::make_unique<FakePath>("first", "the parameters are on the CPU", &asked[0]));
  candidates.push_back(std::make_unique<FakePath>("second", "", &asked[1]));
  candidates.push_back(std::make_unique<FakePath>("third", "", &asked[2]));
  auto choice = choose_gradient_path(std::move(candidates), GradientPathContext{});
  REQUIRE(choice.path);
  CHECK(choice.path->name() == "second");
  CHECK(choice.declined == std::vector<std::string>{"first: the parameters are on the CPU"});
  CHECK(asked == std::vector<int>{1, 1, 0});  // the walk stops at the first that serves
}

TEST_CASE("when no gradient path can serve, the error lists every candidate's reason") {
  std::vector<int> asked(2, 0);
  std::vector<std::unique_ptr<GradientPath>> candidates;
  candidates.push_back(
      std::make_unique<FakePath>("nccl", "troupe was built without NCCL", &asked[0]));
  candidates.push_back(
      std::make_unique<FakePath>("transport", "the parameters are on CUDA", &asked[1]));
  CHECK_THROWS_WITH_AS(choose_gradient_path(std::move(candidates), GradientPathContext{}),
                       "DistributedModule: no gradient path can reduce this module's buckets "
                       "(nccl: troupe was built without NCCL; transport: the parameters are on "
                       "CUDA)",
                       comm::Error);
  CHECK(asked == std::vector<int>{1, 1});
  CHECK_THROWS_WITH_AS(choose_gradient_path({}, GradientPathContext{}),
                       "DistributedModule: no gradient path can reduce this module's buckets (no "
                       "candidate)",
                       comm::Error);
}

TEST_CASE("a CPU module is told why the CUDA paths and shared memory declined") {
  // Two ranks on one host take shared memory; on two hosts, or with the option off, the transport.
  struct Setting {
    std::vector<std::string> hosts;
    bool shared_memory;
    std::string path;
    std::string shared_memory_declined;  // "": shared memory served
  };
  const std::vector<Setting> settings = {
      {{}, true, "cpu via shared memory", ""},
      {{"host-a", "host-b"},
       true,
       "cpu",
       "cpu via shared memory: rank 1 is not on rank 0's host (host 'host-b', another kernel or "
       "/dev/shm than rank 0's 'host-a')"},
      {{}, false, "cpu", "cpu via shared memory: DdpOptions::shared_memory is off"},
  };
  for (const auto& s : settings) {
    CAPTURE(s.path);
    CAPTURE(s.shared_memory_declined);
    std::vector<std::string> path(2);
    std::vector<std::vector<std::string>> declined(2);
    auto errors = test::run_threads(
        2,
        [&](int r, Runtime& rt) {
          DdpOptions o;
          o.shared_memory = s.shared_memory;
          DistributedModule ddp(rt, std::make_shared<test::Mlp>(4, 4, 2), GradientAllReduce{}, o);
          path[static_cast<size_t>(r)] = ddp.gradient_path();
          declined[static_cast<size_t>(r)] = ddp.declined_gradient_paths();
        },
        s.hosts);
    for (auto& e : errors) CHECK(e == "");
    std::vector<std::string> want = {
        "cuda via nccl: the parameters are on the CPU",
        "cuda via host staging, compressed on the device: the parameters are on the CPU",
        "cuda via host staging: the parameters are on the CPU"};
    if (!s.shared_memory_declined.empty()) want.push_back(s.shared_memory_declined);
    for (int r = 0; r < 2; ++r) {
      CHECK(path[static_cast<size_t>(r)] == s.path);
      CHECK(declined[static_cast<size_t>(r)] == want);
    }
  }
  // One rank: nothing to share.
  auto errors = test::run_threads(1, [](int, Runtime& rt) {
    DistributedModule ddp(rt, std::make_shared<test::Mlp>(4, 4, 2), PowerSGD{});
    CHECK(ddp.gradient_path() == "cpu");
    CHECK(ddp.declined_gradient_paths().back() ==
          "cpu via shared memory: powersgd(rank=2) is not GradientAllReduce (the only algorithm "
          "it runs)");
  });
  for (auto& e : errors) CHECK(e == "");
}

#ifdef TROUPE_HAVE_CUDA
// Which algorithms the staging path that compresses on the device takes (the rest stage float32):
// decided before any CUDA call, so it is checked on machines without a GPU too.
TEST_CASE(
    "the device codecs serve fp16, bf16, sign, ByteGrad, int4, top-k and PowerSGD, and "
    "name what they do not serve") {
  for (const Algorithm& served :
       {Algorithm(HalfPrecision{}), Algorithm(HalfPrecision{.bfloat16 = true}),
        Algorithm(SignCompression{}),
        Algorithm(SignCompression{.mode = SignMode::majority_vote, .error_feedback = false}),
        Algorithm(ByteGrad{}), Algorithm(Int4Quantization{}), Algorithm(Sparsification{}),
        Algorithm(Sparsification{.count = 3, .error_feedback = false})}) {
    CAPTURE(comm::algorithm_name(served));
    CHECK(device_codec_support(served) == "");
  }
#ifdef TROUPE_HAVE_C10_CUDA
  CHECK(device_codec_support(PowerSGD{}) == "");
#else
  CHECK(device_codec_support(PowerSGD{}).find("needs LibTorch's c10_cuda") != std::string::npos);
#endif
  CHECK(device_codec_support(GradientAllReduce{}) == "allreduce has no device codec");
  CHECK(device_codec_support(Sparsification{.mode = SparseMode::random_k}) ==
        comm::algorithm_name(Sparsification{.mode = SparseMode::random_k}) +
            " has no device codec (top-k has)");
  CHECK(device_codec_support(Sparsification{.momentum = 0.9}) ==
        comm::algorithm_name(Sparsification{.momentum = 0.9}) +
            ": top-k with momentum correction has no device codec");
}
#endif

// NCCL refuses two ranks on one GPU: Runtime::nccl_available() says no where a host's ranks
// outnumber the GPUs it sees (two processes sharing one GPU then stage through the host).
TEST_CASE("the NCCL paths need a GPU for each rank of a host, and say so") {
  CHECK(gpus_for_nccl(1, 1) == "");
  CHECK(gpus_for_nccl(2, 8) == "");
  CHECK(gpus_for_nccl(8, 8) == "");
  CHECK(gpus_for_nccl(2, 1) ==
        "2 ranks on this host, 1 CUDA device seen: NCCL needs a GPU of its own for each rank "
        "(ranks that share one reduce through host staging)");
  CHECK(gpus_for_nccl(3, 2).find("3 ranks on this host, 2 CUDA devices seen") == 0);
  CHECK(gpus_for_nccl(1, 0).find("1 ranks on this host, 0 CUDA devices seen") == 0);
  // Without a GPU no Runtime offers NCCL, whatever rank 0 published.
  if (!torch::cuda::is_available()) {
    auto errors = test::run_threads(2, [](int, Runtime& rt) { CHECK_FALSE(rt.nccl_available()); });
    for (auto& e : errors) CHECK(e == "");
  }
}
