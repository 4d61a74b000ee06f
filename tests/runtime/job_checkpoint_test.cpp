// The job's checkpoints (save_step / load_last), several named modules and optimizers in one
// Checkpoint, settings checked at resume, and the consolidated checkpoint (rank 0's model and
// optimizer, loaded by plain LibTorch and by a job of another world size). Ranks are threads over
// inproc; the states a killed save leaves behind are made by hand, file by file.
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "comm/status.h"
#include "ddp/distributed_module.h"
#include "rank/checkpoint.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torch_doctest.h"

using namespace troupe;

namespace {

namespace fs = std::filesystem;

doctest::Contains mentions(const std::string& text) { return doctest::Contains(text.c_str()); }

std::string fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() /
             ("troupe-job-checkpoint-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string text_of(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void require_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(errors[r] == "");
  }
}

// Linear, BatchNorm (buffers), Linear: nested modules, as an archive nests them.
struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    torch::manual_seed(seed);
    first = register_module("first", torch::nn::Linear(4, 6));
    norm = register_module("norm", torch::nn::BatchNorm1d(6));
    last = register_module("last", torch::nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return last(norm(first(x)).relu()); }
  torch::nn::Linear first{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Linear last{nullptr};
};

std::vector<torch::Tensor> state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

bool equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// The momentum buffer of each parameter of `net` in `sgd`, in parameter order.
std::vector<torch::Tensor> momentum_of(torch::optim::SGD& sgd, torch::nn::Module& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net.parameters()) {
    auto& state =
        static_cast<torch::optim::SGDParamState&>(*sgd.state().at(p.unsafeGetTensorImpl()));
    out.push_back(state.momentum_buffer().clone());
  }
  return out;
}

// load_last(dir) on `world` thread ranks whose Checkpoint holds the value "value" (into
// values[rank], which must have `world` entries) and what `settings` adds; what each rank threw.
std::vector<std::string> resume(int world, const std::string& dir, std::vector<int64_t>& values,
                                const std::function<void(int, Checkpoint&)>& settings = {}) {
  return test::run_threads(world, [&](int rank, Runtime& rt) {
    Checkpoint c(rt);
    c.value("value", values.at(static_cast<size_t>(rank)));
    if (settings) settings(rank, c);
    try {
      c.load_last(dir);
    } catch (const std::exception& e) {
      // As a program should (README, "An exception on one rank"): a rank slower to leave its
      // last collective then fails naming this reason, not "an exception unwound its Runtime".
      rt.fail(e.what());
      throw;
    }
  });
}

}  // namespace

TEST_CASE("a GAN's two modules and two optimizers round-trip in one checkpoint under their names") {
  torch::manual_seed(1);
  torch::nn::Linear generator(3, 4), discriminator(4, 1);
  torch::optim::Adam g_adam(generator->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam d_adam(discriminator->parameters(), torch::optim::AdamOptions(0.02));
  for (int i = 0; i < 2; ++i) {
    g_adam.zero_grad();
    d_adam.zero_grad();
    discriminator(generator(torch::randn({5, 3}))).sum().backward();
    g_adam.step();
    d_adam.step();
  }
  Checkpoint saved(0, 1);
  saved.module(*generator, "generator")
      .module(*discriminator, "discriminator")
      .optimizer(g_adam, "generator adam")
      .optimizer(d_adam, "discriminator adam");
  const auto bytes = saved.serialize_state();

  torch::manual_seed(2);
  torch::nn::Linear g2(3, 4), d2(4, 1);
  torch::optim::Adam g2_adam(g2->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam d2_adam(d2->parameters(), torch::optim::AdamOptions(0.02));
  Checkpoint loaded(0, 1);
  loaded.module(*g2, "generator")
      .module(*d2, "discriminator")
      .optimizer(g2_adam, "generator adam")
      .optimizer(d2_adam, "discriminator adam");
  loaded.restore_state(bytes);
  CHECK(equal(state_of(*g2), state_of(*generator)));
  CHECK(equal(state_of(*d2), state_of(*discriminator)));
  auto exp_avg = [](torch::optim::Adam& adam, const torch::Tensor& p) {
    return static_cast<torch::optim::AdamParamState&>(*adam.state().at(p.unsafeGetTensorImpl()))
        .exp_avg();
  };
  CHECK(torch::equal(exp_avg(d2_adam, d2->weight), exp_avg(d_adam, discriminator->weight)));
  CHECK(torch::equal(exp_avg(g2_adam, g2->weight), exp_avg(g_adam, generator->weight)));

  // Two parts under one name are refused, and the message says how to name the second.
  Checkpoint twice(0, 1);
  twice.module(*generator);
  CHECK_THROWS_WITH(twice.module(*discriminator),
                    mentions("a second part named 'module' (expected one name per part; module() "
                             "and optimizer() take a name as their second argument)"));
  // The modules swapped: the names say which is which, and the shapes disagree.
  Checkpoint swapped(0, 1);
  swapped.module(*d2, "generator").module(*g2, "discriminator");
  swapped.optimizer(g2_adam, "generator adam").optimizer(d2_adam, "discriminator adam");
  CHECK_THROWS_WITH(swapped.restore_state(bytes, "the GAN's state"),
                    mentions("the GAN's state part 'generator': 'weight' saved as Float[4, 3], the "
                             "module has Float[1, 4]"));
}

TEST_CASE(
    "a job's checkpoint resumes from the last step every rank saved, whatever a killed save left "
    "behind") {
  const auto dir = fresh_dir("last-step");
  // Steps 5 and 8 saved by both ranks. Each rank's model as saved at step 8 (the ranks' models
  // differ: each must get its own).
  std::vector<std::vector<torch::Tensor>> at_8(2);
  require_no_errors(test::run_threads(2, [&](int rank, Runtime& rt) {
    int64_t value = 0;
    Net net(30 + static_cast<uint64_t>(rank));
    Checkpoint c(rt);
    c.module(net).value("value", value);
    for (int64_t step : {5, 8}) {
      value = 100 * step + rank;
      {
        torch::NoGradGuard no_grad;
        net.first->bias.add_(1);
      }
      c.save_step(dir, step);
    }
    at_8[static_cast<size_t>(rank)] = state_of(net);
  }));
  CHECK(names_in(dir) ==
        std::set<std::string>{"rank-0.complete", "rank-1.complete", "step-5", "step-8"});
  CHECK(text_of(dir + "/rank-1.complete") == "step 8\n");
  // What a kill leaves: rank 1 died before recording step 8 (its record still says 5), and a save
  // of step 12 was under way: rank 0's file written, rank 1's half-written (a temporary).
  std::ofstream(dir + "/rank-1.complete", std::ios::trunc) << "step 5\n";
  {
    int64_t junk = -7;
    Net net(99);
    Checkpoint c(0, 2);
    c.module(net).value("value", junk);
    c.save(dir + "/step-12");
    std::ofstream(dir + "/step-12/rank-1.troupe.tmp.999999") << "half a file";
    std::ofstream(dir + "/rank-0.troupe.tmp.999998") << "half a record";
  }
  const auto before = names_in(dir + "/step-12");
  CHECK(before.size() == 2);

  std::vector<int64_t> resumed_at(2, -1), values(2, -1);
  require_no_errors(test::run_threads(2, [&](int rank, Runtime& rt) {
    int64_t value = -1;
    Net net(50);
    Checkpoint c(rt);
    c.module(net).value("value", value);
    resumed_at[static_cast<size_t>(rank)] = c.load_last(dir);
    values[static_cast<size_t>(rank)] = value;
    CHECK(equal(state_of(net), at_8[static_cast<size_t>(rank)]));
    // After the resume every rank records the step it resumed from.
    CHECK(*Checkpoint::last_complete_step(dir, rank) == 8);
    value += 1000;
    c.save_step(dir, 10);
  }));
  CHECK(resumed_at == std::vector<int64_t>{8, 8});
  CHECK(values == std::vector<int64_t>{800, 801});
  // The save of step 10 kept steps 8 and 10 and removed the rest, temporaries included.
  CHECK(names_in(dir) ==
        std::set<std::string>{"rank-0.complete", "rank-1.complete", "step-10", "step-8"});
  CHECK(names_in(dir + "/step-10") == std::set<std::string>{"rank-0.troupe", "rank-1.troupe"});
  fs::remove_all(dir);
}

TEST_CASE(
    "a save leaves a later step's folder alone: the rank that left the save's barrier first may be "
    "writing its next step there") {
  const auto dir = fresh_dir("later-folder");
  int64_t value = 3;
  Checkpoint c(0, 1);
  c.value("value", value);
  c.save_step(dir, 1);
  // Another rank, ahead by a step, has created the folder of step 3 and not yet written its file
  // (write_file_atomically creates the folder, then the temporary). Our save of step 2 runs its
  // clean-up now: it must not remove that folder, or the other rank's write fails.
  fs::create_directories(dir + "/step-3");
  c.save_step(dir, 2);
  CHECK(names_in(dir) == std::set<std::string>{"rank-0.complete", "step-1", "step-2", "step-3"});
  // Earlier steps but the previous complete one still go (step 3's folder among them).
  c.save_step(dir, 4);
  CHECK(names_in(dir) == std::set<std::string>{"rank-0.complete", "step-2", "step-4"});
  // A later step's folder that no rank recorded is a killed save's: the resume removes it.
  fs::create_directories(dir + "/step-9");
  std::ofstream(dir + "/step-9/rank-0.troupe") << "a killed save's file";
  value = -1;
  CHECK(c.load_last(dir) == 4);
  CHECK(value == 3);
  CHECK(names_in(dir) == std::set<std::string>{"rank-0.complete", "step-2", "step-4"});
  fs::remove_all(dir);
}

TEST_CASE(
    "a resume refuses ranks whose files are of different steps, naming the rank and the file, and "
    "loads nothing") {
  const auto dir = fresh_dir("mixed");
  require_no_errors(test::run_threads(2, [&](int rank, Runtime& rt) {
    int64_t value = 0;
    Checkpoint c(rt);
    c.value("value", value);
    for (int64_t step : {20, 40}) {
      value = step + rank;
      c.save_step(dir, step);
    }
  }));
  // Rank 1's folder holds step 20 only (as when each rank kept its own files and one lagged).
  fs::remove(Checkpoint::file_of_step(dir, 40, 1));
  std::ofstream(dir + "/rank-1.complete", std::ios::trunc) << "step 20\n";
  std::vector<int64_t> values(2, -1);
  auto errors = resume(2, dir, values);
  for (auto& e : errors)
    CHECK(e.find("resume from '" + dir +
                 "': step 40 was recorded complete by rank 0, but its file is missing on rank 1 (" +
                 Checkpoint::file_of_step(dir, 40, 1) + ")") != std::string::npos);
  CHECK(values == std::vector<int64_t>{-1, -1});

  // No record anywhere: refused, naming the record it looked for.
  const auto empty = fresh_dir("none");
  fs::create_directories(empty);
  errors = resume(2, empty, values);
  CHECK(errors[0].find("no rank recorded a complete step (expected " + empty +
                       "/rank-0.complete") != std::string::npos);
  // A record that is not one.
  std::ofstream(empty + "/rank-1.complete") << "step forty\n";
  errors = resume(2, empty, values);
  CHECK(errors[1].find("'" + empty + "/rank-1.complete': holds \"step forty") != std::string::npos);
  CHECK(errors[0].find("the record of rank 1 is unreadable") != std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(empty);
}

TEST_CASE(
    "a resume with another batch size, seed or world size is refused by name before any rank "
    "changes") {
  const auto dir = fresh_dir("settings");
  require_no_errors(test::run_threads(2, [&](int rank, Runtime& rt) {
    int64_t value = 7 + rank;
    Checkpoint c(rt);
    c.value("value", value).setting("batch", 64).setting("model", "mlp");
    c.save_step(dir, 3);
  }));
  // Rank 1 alone runs with another batch size: rank 1 names the setting, rank 0 names rank 1, and
  // neither loads.
  std::vector<int64_t> values(2, -1);
  auto errors = resume(2, dir, values, [](int rank, Checkpoint& c) {
    c.setting("batch", rank == 1 ? 32 : 64).setting("model", "mlp");
  });
  CHECK(errors[1].find("part 'setting batch': saved with batch 64, this run has batch 32") !=
        std::string::npos);
  CHECK(errors[0].find("rank 1 refused their file of step 3") != std::string::npos);
  CHECK(values == std::vector<int64_t>{-1, -1});
  // A text setting.
  errors = resume(2, dir, values,
                  [](int, Checkpoint& c) { c.setting("batch", 64).setting("model", "cnn"); });
  CHECK(errors[0].find("saved with model 'mlp', this run has model 'cnn'") != std::string::npos);
  // Three ranks: rank 2 has no file of step 3, the others' say world size 2.
  std::vector<int64_t> three(3, -1);
  errors = resume(3, dir, three,
                  [](int, Checkpoint& c) { c.setting("batch", 64).setting("model", "mlp"); });
  INFO("rank 0: " << errors[0] << "\nrank 1: " << errors[1] << "\nrank 2: " << errors[2]);
  CHECK(errors[0].find("its file is missing on rank 2") != std::string::npos);
  fs::remove(Checkpoint::file_of_step(dir, 3, 1));
  fs::copy_file(Checkpoint::file_of_step(dir, 3, 0), Checkpoint::file_of_step(dir, 3, 1));
  {
    // A job of one rank: the world size is refused, naming the way to another world size.
    int64_t value = -1;
    Checkpoint c(0, 1);
    c.value("value", value).setting("batch", 64).setting("model", "mlp");
    CHECK_THROWS_WITH(c.load_last(dir),
                      mentions("saved by a job of world size 2, this job has world size 1 (a "
                               "rank's checkpoint continues the same job; save_consolidated / "
                               "load_consolidated carry the model to another world size)"));
    CHECK(value == -1);
  }
  fs::remove_all(dir);
}

TEST_CASE(
    "a consolidated checkpoint loads into plain LibTorch and into a job of another world size") {
  const auto dir = fresh_dir("consolidated");
  const auto data = torch::randn({6, 8, 4});
  std::vector<torch::Tensor> rank0_state, rank0_momentum;
  require_no_errors(test::run_threads(2, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>(5);
    DistributedModule ddp(rt, net);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < 3; ++s) {
      sgd.zero_grad();
      net->forward(data[s].narrow(0, rank * 4, 4)).pow(2).mean().backward();
      ddp.step(sgd);
    }
    int64_t epoch = 2;
    Checkpoint c(rt);
    c.module(*net).optimizer(sgd).rng().value("epoch", epoch).setting("batch", 4);
    c.save_consolidated(dir);
    if (rank == 0) {
      rank0_state = state_of(*net);
      rank0_momentum = momentum_of(sgd, *net);
    }
  }));
  CHECK(names_in(dir) == std::set<std::string>{"consolidated.troupe", "module.pt", "optimizer.pt"});

  // Plain LibTorch, no troupe: torch::load reads the model and the optimizer.
  auto plain = std::make_shared<Net>(77);
  torch::load(plain, dir + "/module.pt");
  CHECK(equal(state_of(*plain), rank0_state));
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::load(plain_sgd, dir + "/optimizer.pt");
  CHECK(equal(momentum_of(plain_sgd, *plain), rank0_momentum));

  // Three ranks load it, then train on together.
  require_no_errors(test::run_threads(3, [&](int rank, Runtime& rt) {
    auto net = std::make_shared<Net>(100 + static_cast<uint64_t>(rank));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    int64_t epoch = 0;
    Checkpoint c(rt);
    c.module(*net).optimizer(sgd).rng().value("epoch", epoch).setting("batch", 4);
    c.load_consolidated(dir);
    CHECK(epoch == 2);
    CHECK(equal(state_of(*net), rank0_state));
    CHECK(equal(momentum_of(sgd, *net), rank0_momentum));
    DistributedModule ddp(rt, net);
    sgd.zero_grad();
    net->forward(data[5].narrow(0, rank * 2, 2)).pow(2).mean().backward();
    ddp.step(sgd);
  }));
  fs::remove_all(dir);
}

TEST_CASE(
    "a consolidated checkpoint refuses a changed file, another model and a rank's state, before "
    "anything changes") {
  const auto dir = fresh_dir("consolidated-bad");
  auto net = std::make_shared<Net>(5);
  int64_t epoch = 4;
  Checkpoint saved(0, 1);
  saved.module(*net, "net").value("epoch", epoch);
  saved.save_consolidated(dir);

  auto fresh = std::make_shared<Net>(6);
  const auto untouched = state_of(*fresh);
  int64_t value = -1;
  Checkpoint c(0, 1);
  c.module(*fresh, "net").value("epoch", value);
  // Another model under the same name.
  torch::nn::Linear other(3, 3);
  Checkpoint wrong(0, 1);
  wrong.module(*other, "net").value("epoch", value);
  CHECK_THROWS_WITH(
      wrong.load_consolidated(dir),
      mentions("checkpoint '" + dir + "/net.pt': no parameter 'weight' in it (another model?)"));
  // Parts that differ.
  Checkpoint parts(0, 1);
  parts.module(*fresh, "generator").value("epoch", value);
  CHECK_THROWS_WITH(parts.load_consolidated(dir),
                    mentions("it holds the parts [net, value epoch], this Checkpoint's model and "
                             "values are [generator, value epoch]"));
  // The model file changed after the save.
  {
    std::fstream f(dir + "/net.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x42');
  }
  CHECK_THROWS_WITH(c.load_consolidated(dir), mentions("'" + dir + "/net.pt' has SHA-256 "));
  CHECK(equal(state_of(*fresh), untouched));
  CHECK(value == -1);
  // A rank's state is not a consolidated checkpoint, nor the other way round.
  saved.save(dir + "/rank");
  fs::rename(Checkpoint::file_of(dir + "/rank", 0), dir + "/consolidated.troupe");
  CHECK_THROWS_WITH(c.load_consolidated(dir), mentions("a rank's state, not a consolidated"));
  saved.save_consolidated(dir + "/rank");
  fs::rename(dir + "/rank/consolidated.troupe", Checkpoint::file_of(dir + "/rank", 0));
  CHECK_THROWS_WITH(c.load(dir + "/rank"), mentions("a consolidated checkpoint's manifest"));
  // No manifest: an interrupted save, or no save at all.
  fs::remove(dir + "/consolidated.troupe");
  CHECK_THROWS_WITH(c.load_consolidated(dir),
                    mentions("consolidated.troupe': cannot open: No such file or directory "
                             "(expected the manifest save_consolidated writes last)"));
  CHECK(equal(state_of(*fresh), untouched));
  fs::remove_all(dir);
}
