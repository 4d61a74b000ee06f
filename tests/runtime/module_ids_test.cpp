// Module ids: a module gives its id back when destroyed, so a Runtime may create and destroy any
// number of modules; at most comm::tags::kMaxModules live at once.
#include "tests/support/torch_doctest.h"

#include <memory>
#include <string>
#include <vector>

#include "comm/status.h"
#include "comm/tags.h"
#include "ddp/distributed_module.h"
#include "rank/module_id.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;

TEST_CASE("a runtime creates and destroys 100 modules and the last one still reduces correctly") {
  torch::set_num_threads(1);
  constexpr int kModules = 100;
  std::vector<std::vector<float>> grads(2);
  std::vector<std::string> paths(2);
  auto errors = test::run_threads(2, [&](int r, Runtime& rt) {
    auto model =
        std::make_shared<torch::nn::LinearImpl>(torch::nn::LinearOptions(4, 1).bias(false));
    DdpOptions options;
    options.shared_memory = false;  // the transport path, whose messages carry the module id
    for (int i = 0; i < kModules; ++i) {
      DistributedModule ddp(rt, model, GradientAllReduce{}, options);
      paths[static_cast<size_t>(r)] = ddp.gradient_path();
      if (i + 1 < kModules) continue;
      torch::optim::SGD opt(model->parameters(), 0.0);  // lr 0: only the gradient is checked
      opt.zero_grad();
      // Rank r's input is all (r + 1): d(sum(w . x))/dw = r + 1 per coordinate.
      model->forward(torch::full({1, 4}, static_cast<float>(r + 1))).sum().backward();
      ddp.step(opt);
      const auto g = model->weight.grad().contiguous();
      grads[static_cast<size_t>(r)].assign(g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
    }
    // Every id is free again: the next module takes the first one.
    ModuleId next(rt);
    CHECK(next.value() == 1);
  });
  for (const auto& e : errors) CHECK(e == "");
  for (int r = 0; r < 2; ++r) {
    CHECK(paths[static_cast<size_t>(r)] == "cpu");
    // The average of ranks 0 and 1: (1 + 2) / 2 in every coordinate.
    REQUIRE(grads[static_cast<size_t>(r)].size() == 4);
    for (float g : grads[static_cast<size_t>(r)]) CHECK(g == doctest::Approx(1.5));
  }
}

TEST_CASE("module ids are the lowest free, and one more than the limit alive is refused by name") {
  auto errors = test::run_threads(1, [&](int, Runtime& rt) {
    std::vector<std::unique_ptr<ModuleId>> live;
    for (int i = 0; i < comm::tags::kMaxModules; ++i)
      live.push_back(std::make_unique<ModuleId>(rt));
    for (int i = 0; i < comm::tags::kMaxModules; ++i)
      CHECK(live[static_cast<size_t>(i)]->value() == i + 1);
    CHECK_THROWS_WITH_AS(ModuleId{rt}, doctest::Contains("at most 15 modules at once"),
                         comm::Error);
    live[6].reset();  // id 7
    live[2].reset();  // id 3
    ModuleId a(rt);
    ModuleId b(rt);
    CHECK(a.value() == 3);
    CHECK(b.value() == 7);
    CHECK(a.key_prefix() == (uint32_t{3} << 28));
  });
  for (const auto& e : errors) CHECK(e == "");
}
