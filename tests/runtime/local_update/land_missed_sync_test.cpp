// The point an elastic trainer rolls back to (LocalUpdateModule::step(inner, landed)) and the
// catch-up of a rank whose sync failed where it completed on the others (land_missed_sync), on
// thread ranks: a second module on a shadow replica that trained the same steps without the sync
// takes the first module's shared state of the landing point, lands the sync, and from there
// both go on bit-identically (Streaming DiLoCo: the fragment due at that point starts at the
// shadow's next step).
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "algorithms/local_update/diloco.h"
#include "algorithms/local_update/streaming_diloco.h"
#include "comm/state.h"
#include "comm/status.h"
#include "tests/support/local_update.h"
#include "tests/support/thread_ranks.h"

using namespace troupe;
using namespace troupe::test;

namespace {

// Each rank trains `net` under a Module for `steps` inner steps, and a shadow replica alongside
// it without any module up to the first landing (`land_at`, where no sync has changed the
// weights yet: DiLoCo's first outer sync, Streaming DiLoCo's first fragment merge). There the
// shadow takes the module's shared state (saved in the landed listener), lands the sync, and
// steps on under a module of its own; at every landing after, and at the end, both replicas'
// weights must be equal bit for bit, and the landing points the same.
template <typename Module, typename Config>
void check_landing(const Config& config, int world, int land_at, int steps) {
  torch::manual_seed(3);
  const auto init = flat_of(*make_net()).clone();
  Batches b(world, steps);
  auto errors = run_threads(world, [&](int rank, Runtime& rt) {
    auto net = make_net(), shadow = make_net();
    load_flat(*net, init);
    load_flat(*shadow, init);
    auto opt = make_inner(*net, false), shadow_opt = make_inner(*shadow, false);
    Module dp(rt, net.ptr(), config);
    std::string shared;
    std::vector<int64_t> landings, shadow_landings;
    for (int s = 0; s < land_at; ++s) {
      train_step(net, *opt, b.at(rank, s));
      dp.step(*opt, [&] {
        landings.push_back(dp.inner_steps());
        comm::StateWriter out(shared);
        dp.save_state(out, StatePart::shared);
      });
      train_step(shadow, *shadow_opt, b.at(rank, s));
      shadow_opt->step();
    }
    REQUIRE(landings == std::vector<int64_t>{land_at});
    // The shadow's own weights survive its module's construction (which takes rank 0's).
    const auto own = flat_of(*shadow).clone();
    Module late(rt, shadow.ptr(), config);
    load_flat(*shadow, own);
    comm::StateReader in(shared, "the landing point's shared state");
    late.load_state(in, StatePart::shared);
    in.expect_end();
    CHECK(late.inner_steps() == land_at);
    late.land_missed_sync();
    CHECK(torch::equal(flat_of(*shadow), flat_of(*net)));
    for (int s = land_at; s < steps; ++s) {
      train_step(net, *opt, b.at(rank, s));
      dp.step(*opt, [&] { landings.push_back(dp.inner_steps()); });
      train_step(shadow, *shadow_opt, b.at(rank, s));
      late.step(*shadow_opt, [&] {
        shadow_landings.push_back(late.inner_steps());
        CHECK(torch::equal(flat_of(*shadow), flat_of(*net)));
      });
    }
    CHECK(std::vector<int64_t>(landings.begin() + 1, landings.end()) == shadow_landings);
    CHECK(shadow_landings.size() >= 2);
    CHECK(torch::equal(flat_of(*shadow), flat_of(*net)));
    CHECK(late.outer_steps() == dp.outer_steps());
  });
  for (auto& e : errors) CHECK(e.empty());
}

}  // namespace

TEST_CASE(
    "a DiLoCo rank that missed an outer sync lands it from a peer's shared state and goes "
    "on bit-identically") {
  DiLoCo c;
  c.inner_steps = 3;
  c.outer_lr = 0.5;
  for (int world : {1, 2}) {
    CAPTURE(world);
    check_landing<DiLoCoModule>(c, world, 3, 10);
  }
}

TEST_CASE(
    "a Streaming DiLoCo rank that missed a fragment's merge lands it from a peer's shared "
    "state, starts the fragment due there, and goes on bit-identically") {
  // h = 4, 2 fragments, delay 2: fragment 0 starts after step 2 and lands after 4, where
  // fragment 1 is due: the landing point lies between the merge and that start.
  StreamingDiLoCo c;
  c.inner_steps = 4;
  c.fragments = 2;
  c.delay = 2;
  c.fragment_update_alpha = 0.5;
  for (int world : {1, 2}) {
    CAPTURE(world);
    check_landing<StreamingDiLoCoModule>(c, world, 4, 13);
  }
}

// The state of a Streaming DiLoCo module saved with a fragment in flight, marked as if that
// fragment's reduction had failed on this rank (the byte after the fragment in flight and its
// step: streaming_diloco.cpp's save_rest).
std::string as_failed(std::string bytes) {
  comm::StateReader in(bytes, "a Streaming DiLoCo state");
  in.string();
  in.value<int64_t>();
  in.value<int64_t>();
  in.value<uint64_t>();
  in.vector<float>();
  in.vector<float>();
  REQUIRE(in.value<int64_t>() >= 0);  // a fragment in flight
  in.value<int64_t>();
  const size_t at = bytes.size() - in.remaining();
  REQUIRE(bytes[at] == 0);
  bytes[at] = 1;
  return bytes;
}

TEST_CASE(
    "a Streaming DiLoCo rank with eager updates whose fragment's reduction failed lands it "
    "from its own provisional step and a peer's shared state, bit-identically") {
  // h = 4, 2 fragments, delay 2: fragment 0 starts after step 2 (its provisional step moves the
  // weights) and lands after 4, fragment 1 after 4 and 6, fragment 0 again after 6 and 8. A
  // shadow replica copies each rank's weights and inner optimizer after step 7, with fragment
  // 0 in flight, and takes the module's state of then marked failed; it trains step 8 as the
  // rank does, loads the shared state of the landing after 8, and lands the sync: its weights
  // must be the rank's after that landing, and both must go on bit-identically.
  StreamingDiLoCo c;
  c.inner_steps = 4;
  c.fragments = 2;
  c.delay = 2;
  c.fragment_update_alpha = 0.5;
  c.eager = true;
  for (int world : {2, 3}) {
    CAPTURE(world);
    torch::manual_seed(3);
    const auto init = flat_of(*make_net()).clone();
    Batches b(world, 16);
    auto errors = run_threads(world, [&](int rank, Runtime& rt) {
      auto net = make_net(), shadow = make_net();
      load_flat(*net, init);
      auto opt = make_inner(*net, false), shadow_opt = make_inner(*shadow, false);
      StreamingDiLoCoModule dp(rt, net.ptr(), c);
      std::string shared, failed;
      torch::Tensor landed;
      for (int s = 0; s < 8; ++s) {
        if (s == 7) {
          // After step 7: the live state of a rank whose reduction of fragment 0 will fail.
          std::string all;
          comm::StateWriter out(all);
          dp.save_state(out, StatePart::all);
          failed = as_failed(all);
          load_flat(*shadow, flat_of(*net));
          torch::serialize::OutputArchive archive;
          opt->save(archive);
          std::ostringstream bytes;
          archive.save_to(bytes);
          torch::serialize::InputArchive in;
          in.load_from(bytes.str().data(), bytes.str().size());
          shadow_opt->load(in);
        }
        train_step(net, *opt, b.at(rank, s));
        dp.step(*opt, [&] {
          if (dp.inner_steps() != 8) return;
          comm::StateWriter out(shared);
          dp.save_state(out, StatePart::shared);
          landed = flat_of(*net).clone();
        });
      }
      REQUIRE(landed.defined());
      train_step(shadow, *shadow_opt, b.at(rank, 7));
      shadow_opt->step();
      const auto live = flat_of(*shadow).clone();
      StreamingDiLoCoModule late(rt, shadow.ptr(), c);
      load_flat(*shadow, live);
      comm::StateReader own(failed, "the failed state");
      late.load_state(own, StatePart::all);
      own.expect_end();
      comm::StateReader in(shared, "the landing point's shared state");
      late.load_state(in, StatePart::shared);
      in.expect_end();
      REQUIRE(late.inner_steps() == 8);
      late.land_missed_sync();
      CHECK(torch::equal(flat_of(*shadow), landed));
      // From there both start fragment 1 (due after step 8) and go on alike.
      late.start_due();
      for (int s = 8; s < 16; ++s) {
        train_step(net, *opt, b.at(rank, s));
        dp.step(*opt);
        train_step(shadow, *shadow_opt, b.at(rank, s));
        late.step(*shadow_opt);
      }
      CHECK(torch::equal(flat_of(*shadow), flat_of(*net)));
    });
    for (auto& e : errors) CHECK(e.empty());
  }
}

TEST_CASE(
    "land_missed_sync with eager updates refuses a module without the failed fragment, "
    "naming it") {
  auto errors = run_threads(1, [](int, Runtime& rt) {
    auto net = make_net();
    StreamingDiLoCo c;
    c.inner_steps = 4;
    c.fragments = 2;
    c.delay = 2;
    c.eager = true;
    StreamingDiLoCoModule dp(rt, net.ptr(), c);
    auto opt = make_inner(*net, false);
    Batches b(1, 4);
    for (int s = 0; s < 4; ++s) {
      train_step(net, *opt, b.at(0, s));
      dp.step(*opt);
    }
    std::string error;
    try {
      dp.land_missed_sync();
    } catch (const comm::Error& e) {
      error = e.what();
    }
    CHECK(error.find("fragment 0's provisional step (after inner step 2) is not in this "
                     "module's state") != std::string::npos);
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE("land_missed_sync refuses a step after which no sync lands, naming it") {
  auto errors = run_threads(1, [](int, Runtime& rt) {
    auto net = make_net();
    StreamingDiLoCo c;
    c.inner_steps = 4;
    c.fragments = 2;
    c.delay = 1;
    StreamingDiLoCoModule dp(rt, net.ptr(), c);
    auto opt = make_inner(*net, false);
    Batches b(1, 2);
    for (int s = 0; s < 2; ++s) {
      train_step(net, *opt, b.at(0, s));
      dp.step(*opt);
    }
    std::string error;
    try {
      dp.land_missed_sync();
    } catch (const comm::Error& e) {
      error = e.what();
    }
    CHECK(error.find("no fragment lands after inner step 2 (h = 4, delay = 1)") !=
          std::string::npos);
  });
  for (auto& e : errors) CHECK(e.empty());
}
