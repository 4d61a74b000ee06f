// DistributedModule with ranks as threads over the inproc transport: equivalence with one process
// trained on the concatenated batch, overlap, and the errors (mismatched models, unused
// parameters, stalls) — never a hang.
#include "tests/support/torch_doctest.h"

#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <vector>

#include "ddp/distributed_module.h"
#include "elastic/launch.h"
#include "tests/support/ddp_reference.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

using test::Case;
using test::copy_params;
using test::max_difference;
using test::Mlp;
using test::Optim;
using test::run_threads;

// `world` replicas of one 16-64-4 MLP (seed 3).
std::vector<std::shared_ptr<Mlp>> same_replicas(int world) {
  torch::manual_seed(3);
  std::vector<std::shared_ptr<Mlp>> replicas;
  for (int r = 0; r < world; ++r) replicas.push_back(std::make_shared<Mlp>(16, 64, 4));
  return replicas;
}

// Several small buckets for that MLP.
DdpOptions small_buckets() {
  DdpOptions o;
  o.bucket_bytes = 8192;
  o.first_bucket_bytes = 1024;
  return o;
}

}  // namespace

TEST_CASE("N ranks on their own shards end with the parameters of one process on the whole batch") {
  torch::set_num_threads(1);
  std::vector<Case> cases;
  auto base = [] {
    DdpOptions o;
    o.bucket_bytes = 200;  // several buckets even for this small model
    o.first_bucket_bytes = 100;
    return o;
  };
  for (auto aggregation : {Aggregation::bucket, Aggregation::layer, Aggregation::model})
    for (bool delay : {false, true})
      for (Optim optim : {Optim::sgd_momentum, Optim::adam}) {
        Case c;
        c.options = base();
        c.options.aggregation = aggregation;
        c.options.delay_reduce = delay;
        c.optim = optim;
        c.name = std::string("gradients, ") +
                 (aggregation == Aggregation::bucket  ? "by bucket"
                  : aggregation == Aggregation::layer ? "by layer"
                                                      : "by model") +
                 (delay ? ", delay_reduce" : ", overlapped") +
                 (optim == Optim::adam ? ", Adam" : ", SGD momentum");
        cases.push_back(c);
      }
  for (auto aggregation : {Aggregation::layer, Aggregation::model}) {
    Case c;
    c.options = base();
    c.options.agg_grad = false;
    c.options.aggregation = aggregation;
    c.name = std::string("weights averaged after the local step, ") +
             (aggregation == Aggregation::layer ? "by layer" : "by model");
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.options.divide_before = true;
    c.name = "divide before reducing";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.options.gradient_as_bucket_view = false;
    c.name = "gradients copied into the buckets";
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.set_to_none = true;
    c.hidden = 600;  // fc2's gradient, 1.44 MB, is copied into its bucket past the caches
    c.name = "gradients set to none, one of them over a MiB";
    cases.push_back(c);
  }
  for (bool before : {false, true}) {
    Case c;
    c.options = base();
    c.options.divide_before = before;
    c.denominator = 6;  // world 3: sum / 6 is half the average
    c.loss_scale = 0.5;
    c.name = std::string("a custom denominator per step") + (before ? ", divided before" : "");
    cases.push_back(c);
  }
  {
    Case c;
    c.options = base();
    c.options.average = false;
    c.loss_scale = 3;  // the sum over 3 ranks of mean losses
    c.name = "sum instead of average";
    cases.push_back(c);
  }
  // Every case through shared memory (ranks on one host: the default) and the transport.
  for (auto& c : cases)
    for (bool shared : {true, false}) {
      c.options.shared_memory = shared;
      CAPTURE(c.name);
      CAPTURE(shared);
      CHECK(max_difference(c, 3) < 2e-5);
    }
}

TEST_CASE("the equivalence check fails when the ranks do not reduce") {
  // The same harness with one rank's data and no reduction (a single rank wrapping nothing but
  // its own shard) must differ from the whole-batch reference: the test above can fail.
  torch::set_num_threads(1);
  torch::manual_seed(7);
  auto model = std::make_shared<Mlp>(6, 8, 3);
  auto reference = std::make_shared<Mlp>(6, 8, 3);
  copy_params(model, reference);
  auto x = torch::randn({12, 6}), y = torch::randn({12, 3});
  torch::optim::SGD a(model->parameters(), 0.1), b(reference->parameters(), 0.1);
  torch::mse_loss(model->forward(x.narrow(0, 0, 4)), y.narrow(0, 0, 4)).backward();
  a.step();
  torch::mse_loss(reference->forward(x), y).backward();
  b.step();
  double worst = 0;
  auto p = model->parameters(), q = reference->parameters();
  for (size_t i = 0; i < p.size(); ++i)
    worst = std::max(worst, (p[i] - q[i]).abs().max().item<double>());
  CHECK(worst > 1e-3);
}

TEST_CASE("a full bucket starts its reduction before backward ends") {
  torch::set_num_threads(1);
  torch::manual_seed(3);
  // Backward after the last layer (fc2's and fc1's gradients, about 2 GFLOP) lasts far longer
  // than the bucket actor takes to be scheduled, even on a machine busy with other builds: with
  // 4x smaller layers MKL finished backward first once under ctest -j2.
  std::vector<std::shared_ptr<Mlp>> replicas = {std::make_shared<Mlp>(2048, 1024, 10),
                                                std::make_shared<Mlp>(2048, 1024, 10)};
  std::vector<StepMetrics> seen(2);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    DdpOptions o;
    o.first_bucket_bytes = 64 << 10;  // fc3 alone
    o.bucket_bytes = 1 << 20;
    torch::optim::SGD opt(model->parameters(), 0.01);
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    CHECK(ddp.bucket_count() >= 3);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto x = torch::randn({512, 2048});
      model->forward(x).pow(2).mean().backward();
      ddp.step(opt);
    }
    seen[static_cast<size_t>(r)] = ddp.last_step();
    // The first bucket holds what backward produces first: the last layer.
    auto first = ddp.bucket_parameters()[0];
    CHECK(std::count(first.begin(), first.end(), "fc3.weight") == 1);
    CHECK(std::count(first.begin(), first.end(), "fc3.bias") == 1);
    CHECK(std::count(first.begin(), first.end(), "fc1.weight") == 0);
  });
  for (auto& e : errors) CHECK(e == "");
  for (auto& m : seen) {
    REQUIRE(m.bucket_start_us.size() >= 3);
    // The bucket of the last layer filled first and started while earlier layers' gradients were
    // still being computed (both times come from the same steady clock, recorded by the bucket
    // actor and by the last gradient hook).
    CHECK(m.bucket_start_us[0] < m.backward_end_us);
    CHECK(m.bytes_sent > 0);
  }
}

TEST_CASE(
    "on one host CPU buckets reduce through shared memory, each rank writing its share into the "
    "other") {
  torch::set_num_threads(1);
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    std::vector<size_t> sent(2);
    std::vector<std::string> path(2);
    std::vector<torch::Tensor> grads(2);
    auto errors = run_threads(2, [&](int r, Runtime& rt) {
      auto model = std::make_shared<Mlp>(6, 8, 3);  // 155 floats in 6 tensors
      torch::optim::SGD opt(model->parameters(), 0.1);
      DdpOptions o;
      o.aggregation = Aggregation::model;  // one bucket
      o.shared_memory = shared;
      DistributedModule ddp(rt, model, GradientAllReduce{}, o);
      torch::manual_seed(50 + r);
      torch::mse_loss(model->forward(torch::randn({4, 6})), torch::randn({4, 3})).backward();
      ddp.step(opt);
      sent[static_cast<size_t>(r)] = ddp.last_step().bytes_sent;
      path[static_cast<size_t>(r)] = ddp.gradient_path();
      grads[static_cast<size_t>(r)] = model->parameters()[0].grad().clone();
    });
    for (auto& e : errors) CHECK(e == "");
    CHECK(torch::equal(grads[0], grads[1]));  // the same bits on both ranks
    const std::string want = shared ? "cpu via shared memory" : "cpu";
    CHECK(path == std::vector<std::string>{want, want});
    if (shared) {
      // Each rank writes its share (cut at 64-byte lines) into the other's bucket once: together,
      // the bucket's bytes (155 floats, each tensor padded to 64 bytes at most).
      CHECK(sent[0] + sent[1] >= 155 * 4);
      CHECK(sent[0] + sent[1] <= 155 * 4 + 6 * 64);
      CHECK(sent[0] % 64 == 0);
    } else {
      CHECK(sent[0] >= 155 * 4);  // a ring or recursive doubling sends the whole bucket at least
    }
  }
  // Ranks on different hosts take the transport; ranks that disagree get the model check's error.
  auto errors = run_threads(2,
                            [](int, Runtime& rt) {
                              auto model = std::make_shared<Mlp>(6, 8, 3);
                              DistributedModule ddp(rt, model);
                              CHECK(ddp.gradient_path() == "cpu");
                            },
                            {"host-a", "host-b"});
  for (auto& e : errors) CHECK(e == "");
  errors = run_threads(2, [](int r, Runtime& rt) {
    DdpOptions o;
    o.shared_memory = r == 0;
    DistributedModule ddp(rt, std::make_shared<Mlp>(6, 8, 3), GradientAllReduce{}, o);
  });
  for (auto& e : errors)
    CHECK(e.find("model mismatch between rank 0 and rank 1") != std::string::npos);
  CHECK(errors[0].find("shared_memory on") != std::string::npos);
}

TEST_CASE(
    "the rebuild after step 1 splits a bucket where backward paused, so it reduces during the "
    "pause") {
  // fc1 (4 MiB) and fc2 (1 MiB) fit one 25 MiB bucket, but fc1's gradients come a whole matrix
  // product (2048 x 512 x 256) after fc2's: with the split, fc2.weight's bucket reduces while
  // backward computes fc1's.
  torch::set_num_threads(1);
  torch::manual_seed(5);
  for (int64_t gap_us : {1000, 0}) {
    CAPTURE(gap_us);
    std::vector<std::shared_ptr<Mlp>> replicas = {std::make_shared<Mlp>(2048, 512, 10),
                                                  std::make_shared<Mlp>(2048, 512, 10)};
    std::vector<std::vector<std::vector<std::string>>> layouts(2);
    std::vector<StepMetrics> seen(2);
    auto errors = run_threads(2, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      DdpOptions o;
      o.first_bucket_bytes = 64 << 10;
      o.bucket_split_gap = std::chrono::microseconds(gap_us);
      torch::optim::SGD opt(model->parameters(), 0.01);
      DistributedModule ddp(rt, model, GradientAllReduce{}, o);
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        model->forward(torch::randn({256, 2048})).pow(2).mean().backward();
        ddp.step(opt);
      }
      layouts[static_cast<size_t>(r)] = ddp.bucket_parameters();
      seen[static_cast<size_t>(r)] = ddp.last_step();
    });
    for (auto& e : errors) CHECK(e == "");
    CHECK(layouts[0] == layouts[1]);  // rank 0's observation is everyone's layout
    auto bucket_of = [&](const std::string& name) {
      for (size_t b = 0; b < layouts[0].size(); ++b)
        if (std::count(layouts[0][b].begin(), layouts[0][b].end(), name))
          return static_cast<int>(b);
      return -1;
    };
    REQUIRE(bucket_of("fc2.weight") >= 0);
    if (gap_us == 0) {
      CHECK(bucket_of("fc2.weight") == bucket_of("fc1.weight"));
      continue;
    }
    CHECK(bucket_of("fc2.weight") != bucket_of("fc1.weight"));
    CHECK(bucket_of("fc1.bias") == bucket_of("fc1.weight"));  // one node, no pause between them
    for (auto& m : seen) {
      REQUIRE(m.bucket_start_us.size() == layouts[0].size());
      CHECK(m.bucket_start_us[static_cast<size_t>(bucket_of("fc2.weight"))] < m.backward_end_us);
    }
  }
}

TEST_CASE("ranks that wrap different models get an error naming the first difference") {
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, r == 0 ? 8 : 9, 3);
    DistributedModule ddp(rt, model);
  });
  for (auto& e : errors) {
    CHECK(e.find("model mismatch between rank 0 and rank 1") != std::string::npos);
    CHECK(e.find("fc1.weight [8, 6]") != std::string::npos);
    CHECK(e.find("fc1.weight [9, 6]") != std::string::npos);
  }
}

TEST_CASE(
    "parameters without a gradient are named, or reduced as zeros with find_unused_parameters") {
  torch::set_num_threads(1);
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3, /*extra_head=*/true);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DistributedModule ddp(rt, model);
    torch::mse_loss(model->forward(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
    ddp.step(opt);
  });
  for (auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("parameter(s) without a gradient: unused.weight, unused.bias") !=
          std::string::npos);
  }
  std::vector<torch::Tensor> unused_after(2);
  errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3, /*extra_head=*/true);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.find_unused_parameters = true;
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    auto before = model->unused->weight.clone();
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(torch::ones({2, 6}) * (r + 1)), torch::zeros({2, 3}))
          .backward();
      ddp.step(opt);
    }
    CHECK(torch::equal(model->unused->weight, before));  // zero gradient: unchanged by SGD
    unused_after[static_cast<size_t>(r)] = model->fc1->weight.clone();
  });
  for (auto& e : errors) CHECK(e == "");
  CHECK(torch::allclose(unused_after[0], unused_after[1]));
}

TEST_CASE("no_sync accumulates locally and the next backward reduces the sum") {
  torch::set_num_threads(1);
  torch::manual_seed(11);
  std::vector<std::shared_ptr<Mlp>> replicas = {std::make_shared<Mlp>(6, 8, 3),
                                                std::make_shared<Mlp>(6, 8, 3)};
  auto reference = std::make_shared<Mlp>(6, 8, 3);
  copy_params(replicas[0], reference);
  auto x = torch::randn({8, 6}), y = torch::randn({8, 3});
  // Reference: the gradient of two micro-batches per rank, averaged over ranks.
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  for (int r = 0; r < 2; ++r)
    for (int micro = 0; micro < 2; ++micro) {
      auto xi = x.narrow(0, r * 4 + micro * 2, 2), yi = y.narrow(0, r * 4 + micro * 2, 2);
      (torch::mse_loss(reference->forward(xi), yi) / 2).backward();
    }
  ref_opt.step();
  std::vector<torch::Tensor> got(2);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = replicas[static_cast<size_t>(r)];
    torch::optim::SGD opt(model->parameters(), 0.1);
    DistributedModule ddp(rt, model);
    opt.zero_grad();
    {
      auto guard = ddp.no_sync();
      torch::mse_loss(model->forward(x.narrow(0, r * 4, 2)), y.narrow(0, r * 4, 2)).backward();
      CHECK_THROWS_WITH(ddp.step(opt), doctest::Contains("inside no_sync()"));
    }
    torch::mse_loss(model->forward(x.narrow(0, r * 4 + 2, 2)), y.narrow(0, r * 4 + 2, 2))
        .backward();
    ddp.step(opt);
    got[static_cast<size_t>(r)] = model->fc1->weight.clone();
  });
  for (auto& e : errors) CHECK(e == "");
  for (auto& g : got) CHECK(torch::allclose(g, reference->fc1->weight, 1e-5, 1e-6));
}

TEST_CASE("a rank that stops contributing is reported with the bucket and the missing rank") {
  torch::set_num_threads(1);
  auto start = std::chrono::steady_clock::now();
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.stall_timeout = 500ms;
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    if (r == 1) {
      // Rank 1 leaves the job without its backward; rank 0's step must not hang.
      return;
    }
    torch::mse_loss(model->forward(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
    ddp.step(opt);
  });
  CHECK(errors[1] == "");
  // Two ranks of one host reduce through shared memory, whose reduction has the step's deadline
  // too: whichever of the two reports fires first names the timeout, the bucket and rank 1 (the
  // shared-memory reduction as "ranks 1 did not contribute", the stall report as "step 0 stalled
  // ... waits for rank(s) 1").
  INFO(errors[0]);
  const bool stalled = errors[0].find("step 0 stalled") != std::string::npos &&
                       errors[0].find("waits for rank(s) 1") != std::string::npos;
  const bool shared_memory =
      errors[0].find("ranks 1 did not contribute within 500 ms") != std::string::npos;
  CHECK((stalled || shared_memory));
  CHECK(errors[0].find("500 ms") != std::string::npos);
  CHECK(errors[0].find("bucket 0 (") != std::string::npos);
  // Either report names the module and the settings that set the deadline.
  CHECK(errors[0].find("module 'troupe::test::Mlp'") != std::string::npos);
  CHECK(errors[0].find("DdpOptions::stall_timeout") != std::string::npos);
  CHECK(errors[0].find("RuntimeOptions::collective_timeout") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < 15s);
}

TEST_CASE("bad options are rejected naming the option and the value") {
  auto errors = run_threads(1, [&](int, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    DdpOptions o;
    o.align_bytes = 48;
    CHECK_THROWS_WITH(DistributedModule(rt, model, GradientAllReduce{}, o),
                      doctest::Contains("align_bytes=48 (expected a power of two)"));
    o.align_bytes = 64;
    o.bucket_split_gap = std::chrono::microseconds(-5);
    CHECK_THROWS_WITH(DistributedModule(rt, model, GradientAllReduce{}, o),
                      doctest::Contains("bucket_split_gap=-5us (expected >= 0)"));
    DistributedModule ddp(rt, model);
    CHECK_THROWS_WITH(ddp.set_denominator(0), doctest::Contains("set_denominator(0"));
    CHECK_THROWS_WITH(DistributedModule(rt, nullptr), doctest::Contains("module is null"));
  });
  CHECK(errors[0] == "");
}

TEST_CASE(
    "a Chrome trace of each rank holds forward, backward, the waits and every bucket's reduction") {
  torch::set_num_threads(1);
  const std::string dir = "/tmp/troupe_trace_test_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  auto errors = run_threads(2, [&](int, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    torch::optim::SGD opt(model->parameters(), 0.1);
    DdpOptions o;
    o.aggregation = Aggregation::layer;
    o.trace_path = dir + "/trace_{rank}.json";
    DistributedModule ddp(rt, model, GradientAllReduce{}, o);
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
      ddp.step(opt);
    }
  });
  for (auto& e : errors) CHECK(e == "");
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(dir + "/trace_" + std::to_string(rank) + ".json");
    REQUIRE(in.good());
    auto trace = nlohmann::json::parse(in);
    std::map<std::string, int> names;
    for (auto& e : trace["traceEvents"]) {
      CHECK(e["ph"] == "X");
      CHECK(e["pid"] == rank);
      CHECK(e["dur"].get<int64_t>() >= 0);
      names[e["name"].get<std::string>()]++;
    }
    CHECK(names["forward"] == 2);
    CHECK(names["backward"] == 2);
    CHECK(names["wait for reductions"] == 2);
    for (int b = 0; b < 6; ++b) CHECK(names["reduce bucket " + std::to_string(b)] == 2);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("allreduce_parameters averages the weights and broadcast_parameters copies rank 0's") {
  torch::set_num_threads(1);
  std::vector<torch::Tensor> averaged(2), broadcast(2);
  auto errors = run_threads(2, [&](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(6, 8, 3);
    DistributedModule ddp(rt, model);
    {
      torch::NoGradGuard no_grad;
      model->fc1->weight.fill_(r == 0 ? 1.0 : 3.0);
    }
    ddp.allreduce_parameters();
    averaged[static_cast<size_t>(r)] = model->fc1->weight.clone();
    {
      torch::NoGradGuard no_grad;
      model->fc1->weight.fill_(r == 0 ? 5.0 : 7.0);
    }
    ddp.broadcast_parameters(0);
    broadcast[static_cast<size_t>(r)] = model->fc1->weight.clone();
  });
  for (auto& e : errors) CHECK(e == "");
  for (int r = 0; r < 2; ++r) {
    CHECK(torch::allclose(averaged[r], torch::full_like(averaged[r], 2.0)));
    CHECK(torch::allclose(broadcast[r], torch::full_like(broadcast[r], 5.0)));
  }
}

TEST_CASE("compressed algorithms run in the bucket flow and leave every rank the same parameters") {
  torch::set_num_threads(1);
  const int world = 3;
  std::vector<std::pair<std::string, Algorithm>> algorithms = {
      {"allreduce", GradientAllReduce{}},
      {"fp16", HalfPrecision{}},
      {"bf16", HalfPrecision{true}},
      {"bytegrad", ByteGrad{}},
      {"int4", Int4Quantization{}},
      {"sign", SignCompression{}},
      {"sign-vote", SignCompression{SignMode::majority_vote, false}},
      {"topk", Sparsification{SparseMode::top_k, 0.02}},
      {"randomk", Sparsification{SparseMode::random_k, 0.1}},
      {"blockk", Sparsification{SparseMode::block, 0.1}},
      {"powersgd", PowerSGD{1, true, true, 0.0, 0}},
  };
  std::map<std::string, size_t> bytes;
  for (auto& entry : algorithms) {
    const std::string& name = entry.first;
    const Algorithm& algorithm = entry.second;
    CAPTURE(name);
    auto replicas = same_replicas(world);
    std::vector<size_t> sent(world);
    auto errors = run_threads(world, [&](int r, Runtime& rt) {
      auto model = replicas[static_cast<size_t>(r)];
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
      DdpOptions o = small_buckets();
      o.shared_memory = false;  // every algorithm's bytes over the transport, to compare them
      DistributedModule ddp(rt, model, algorithm, o);
      torch::manual_seed(100 + r);
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        torch::mse_loss(model->forward(torch::randn({8, 16})), torch::randn({8, 4})).backward();
        ddp.step(opt);
      }
      sent[static_cast<size_t>(r)] = ddp.last_step().bytes_sent;
    });
    for (auto& e : errors) CHECK(e == "");
    for (int r = 1; r < world; ++r) {
      auto a = replicas[0]->parameters(), b = replicas[static_cast<size_t>(r)]->parameters();
      for (size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i], b[i]));
    }
    bytes[name] = sent[0];
  }
  // Bytes rank 0 sent in the last step, against the full-precision allreduce of the same buckets.
  const double full = static_cast<double>(bytes["allreduce"]);
  CHECK(full >= 5508 * 4);  // 5508 float32 gradients (small buckets: recursive doubling)
  CHECK(bytes["fp16"] * 2 == bytes["allreduce"]);
  CHECK(bytes["bf16"] * 2 == bytes["allreduce"]);
  CHECK(bytes["bytegrad"] < full / 2.5);  // ~4x against the ring; less against doubling
  CHECK(bytes["int4"] < full / 5);        // ~8x against the ring; less against doubling
  CHECK(bytes["sign"] < full / 8);
  CHECK(bytes["topk"] < full / 4);
  CHECK(bytes["randomk"] < full / 8);
  CHECK(bytes["powersgd"] < full / 4);
}

TEST_CASE(
    "PowerSGD reads a gradient set to none where autograd put it, with the bits of copying it into "
    "its bucket") {
  // The same job twice: gradients set to none before each backward (each is handed to the
  // bucket's reduction where it lies), and zeroed in place (autograd accumulates into the buckets,
  // nothing to hand over). Steps before start_iter (a plain allreduce) and after it.
  torch::set_num_threads(1);
  const int world = 2;
  for (bool feedback : {true, false}) {
    CAPTURE(feedback);
    std::vector<std::vector<torch::Tensor>> result[2];
    // The batches, drawn here: the ranks' threads share torch's generator.
    torch::manual_seed(5);
    std::vector<torch::Tensor> xs, ys;
    for (int k = 0; k < world * 5; ++k) {
      xs.push_back(torch::randn({8, 16}));
      ys.push_back(torch::randn({8, 4}));
    }
    for (bool set_to_none : {true, false}) {
      auto replicas = same_replicas(world);
      auto errors = run_threads(world, [&](int r, Runtime& rt) {
        auto model = replicas[static_cast<size_t>(r)];
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
        DdpOptions o = small_buckets();
        // One layout for both runs: a rebuild's splits follow the timing of step 1's backward.
        o.rebuild_buckets = false;
        DistributedModule ddp(rt, model, PowerSGD{2, true, feedback, 1.0, 2}, o);
        for (int s = 0; s < 5; ++s) {
          opt.zero_grad(set_to_none);
          const auto k = static_cast<size_t>(s * world + r);
          torch::mse_loss(model->forward(xs[k]), ys[k]).backward();
          ddp.step(opt);
        }
      });
      for (auto& e : errors) CHECK(e == "");
      for (auto& m : replicas) result[set_to_none ? 0 : 1].push_back(m->parameters());
    }
    for (int r = 0; r < world; ++r)
      for (size_t i = 0; i < result[0][static_cast<size_t>(r)].size(); ++i) {
        CAPTURE(r);
        CAPTURE(i);
        CHECK(torch::equal(result[0][static_cast<size_t>(r)][i],
                           result[1][static_cast<size_t>(r)][i]));
      }
  }
}

TEST_CASE(
    "PowerSGD before start_iter and fp16 on exact values match the full-allreduce reference") {
  torch::set_num_threads(1);
  Case c;
  c.options.bucket_bytes = 200;
  c.options.first_bucket_bytes = 100;
  c.algorithm = PowerSGD{2, true, true, 2.0, 100};
  CHECK(max_difference(c, 3) < 1e-5);
  c.algorithm = HalfPrecision{};
  CHECK(max_difference(c, 2) < 2e-3);  // gradients rounded to fp16 (2^-11 relative) for 3 steps
}

TEST_CASE("a compressed algorithm with weight averaging, or a bad setting, is refused clearly") {
  auto errors = run_threads(1, [](int, Runtime& rt) {
    auto model = std::make_shared<Mlp>(4, 4, 2);
    DdpOptions o;
    o.agg_grad = false;
    CHECK_THROWS_WITH(DistributedModule(rt, model, PowerSGD{}, o),
                      "powersgd(rank=2) compresses gradients: it needs DdpOptions.agg_grad = true "
                      "(weights are averaged with GradientAllReduce)");
    CHECK_THROWS_WITH(DistributedModule(rt, model, ByteGrad{0}),
                      "ByteGrad.block=0 (expected >= 1 element per block)");
  });
  for (auto& e : errors) CHECK(e == "");
}

TEST_CASE("ranks that choose different algorithms get an error naming both, not a hang") {
  auto errors = run_threads(2, [](int r, Runtime& rt) {
    auto model = std::make_shared<Mlp>(4, 4, 2);
    if (r == 0)
      DistributedModule(rt, model, PowerSGD{});
    else
      DistributedModule(rt, model, GradientAllReduce{});
  });
  for (auto& e : errors)
    CHECK(e ==
          "model mismatch between rank 0 and rank 1 at entry 0: rank 0 has 'algorithm "
          "powersgd(rank=2)', rank 1 has 'algorithm allreduce' (every rank must wrap the "
          "same model)");
}

TEST_CASE("hierarchical reduction over ranks pretending to be on two hosts matches one process") {
  torch::set_num_threads(1);
  for (bool divide_before : {false, true}) {
    Case c;
    c.options.hierarchical = true;
    c.options.divide_before = divide_before;
    c.options.bucket_bytes = 256;  // several buckets
    c.options.first_bucket_bytes = 128;
    c.hosts = {"host-a", "host-a", "host-b", "host-b", "host-b"};
    CAPTURE(divide_before);
    CHECK(max_difference(c, 5) < 1e-5);
  }
  // The reduction really goes by host: a rank that is not its host's leader sends its gradients
  // once (to the leader), where a flat allreduce of 5 ranks sends at least twice their size.
  const std::vector<std::string> hosts = {"host-a", "host-a", "host-b", "host-b", "host-b"};
  for (bool hierarchical : {true, false}) {
    auto sent = std::make_shared<std::vector<size_t>>(5);
    auto errors = run_threads(
        5,
        [&, sent](int r, Runtime& rt) {
          auto model = std::make_shared<Mlp>(6, 8, 3);  // 155 floats: 620 bytes
          torch::optim::SGD opt(model->parameters(), 0.1);
          DdpOptions o;
          o.hierarchical = hierarchical;
          DistributedModule ddp(rt, model, GradientAllReduce{}, o);
          torch::mse_loss(model->forward(torch::randn({4, 6})), torch::randn({4, 3})).backward();
          ddp.step(opt);
          (*sent)[static_cast<size_t>(r)] = ddp.last_step().bytes_sent;
        },
        hosts);
    for (auto& e : errors) CHECK(e == "");
    CAPTURE(hierarchical);
    if (hierarchical) {
      CHECK((*sent)[1] >= 620);
      CHECK((*sent)[1] <= 620 + 6 * 64);  // 6 tensors, each padded to 64 bytes at most
    } else {
      CHECK((*sent)[1] >= 2 * 620);
    }
  }
  auto errors = run_threads(3,
                            [](int, Runtime& rt) {
                              CHECK(rt.hosts() == std::vector<std::string>{"x", "y", "x"});
                              CHECK(host_indices(rt.hosts()) == std::vector<int>{0, 1, 0});
                            },
                            {"x", "y", "x"});
  for (auto& e : errors) CHECK(e == "");
}
