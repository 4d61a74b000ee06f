// The elastic process tests' one-process reference (tests/support/elastic_reference.h) against
// non-elastic runs of the same job: W thread ranks, each wrapping its model in a
// StreamingDiLoCoModule and stepping it on its share of the global batches, must end where the
// reference's replicas of a job that never changed its world end. The elastic tests compare
// killed and restarted jobs with this reference; here the reference itself is checked.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "algorithms/local_update/streaming_diloco.h"
#include "tests/support/elastic_reference.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace troupe::test::elastic;

namespace {

// Each rank's weights after `steps` inner steps of `algorithm` (a streaming_job()) on `world`
// thread ranks.
std::vector<torch::Tensor> run_plain(const std::string& algorithm, int world, int64_t steps) {
  const Data d = make_data();
  // Built before the threads: make_model seeds torch's one generator.
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make_model());
  std::vector<torch::Tensor> out(static_cast<size_t>(world));
  auto errors = troupe::test::run_threads(world, [&](int rank, Runtime& rt) {
    auto& net = nets[static_cast<size_t>(rank)];
    auto opt = make_sgd(*net);
    StreamingDiLoCoModule dp(rt, net.ptr(), make_streaming(algorithm));
    ElasticSampler sampler(kSamples, kGlobalBatch, kSeed);
    for (int64_t s = 0; s < steps; ++s) {
      train_step(net, opt, d, s, rank, world, sampler);
      dp.step(opt);
    }
    out[static_cast<size_t>(rank)] = flat(*net).clone();
  });
  for (auto& e : errors) REQUIRE(e.empty());
  return out;
}

// The reference's replicas against the plain run's ranks: bit for bit where the reductions sum
// in the reference's order (an allreduce of one or two ranks, top-k's allgather scatter-added in
// rank order), else within float rounding (a ring of three sums each chunk in its own order).
void check_against_reference(const std::string& algorithm, int world, int64_t steps) {
  torch::set_num_threads(1);
  const auto plain = run_plain(algorithm, world, steps);
  const auto ref = reference_local_update(make_data(), algorithm, {{0, world, 0}}, steps);
  REQUIRE(ref.size() == plain.size());
  const bool exact = world <= 2 || algorithm.find("-topk") != std::string::npos;
  for (size_t r = 0; r < ref.size(); ++r) {
    CAPTURE(r);
    const double off = (plain[r] - ref[r]).abs().max().item<double>();
    CAPTURE(off);
    if (exact)
      CHECK(torch::equal(plain[r], ref[r]));
    else
      CHECK(off <= 1e-5);
  }
  // The replicas differ from each other (each merges its own), so the check sees each.
  if (world > 1) CHECK(!torch::equal(plain[0], plain[1]));
}

}  // namespace

TEST_CASE("the elastic reference matches a non-elastic Streaming DiLoCo run with eager updates") {
  // 22 steps: five syncs of each fragment, the last one in flight at the end.
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    check_against_reference("streaming-diloco-eager", world, 22);
  }
}

TEST_CASE(
    "the elastic reference matches a non-elastic Streaming DiLoCo run, with and without a "
    "top-k outer reduction") {
  for (const std::string algorithm :
       {"streaming-diloco", "streaming-diloco-topk", "streaming-diloco-eager-topk"})
    for (int world : {1, 2, 3}) {
      CAPTURE(algorithm);
      CAPTURE(world);
      check_against_reference(algorithm, world, 22);
    }
}
