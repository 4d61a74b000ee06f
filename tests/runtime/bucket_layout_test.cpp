// The bucket layout: limits, alignment, order, dtypes, and the aggregation modes.
#include "tests/support/torch_doctest.h"

#include "ddp/bucket_layout.h"
#include "ddp/distributed_module.h"

using namespace troupe;

namespace {
const auto kFloat = c10::ScalarType::Float;
const auto kHalf = c10::ScalarType::Half;

DdpOptions small_limits() {
  DdpOptions o;
  o.first_bucket_bytes = 100;
  o.bucket_bytes = 200;
  o.align_bytes = 16;  // 4 floats
  return o;
}
}  // namespace

TEST_CASE("buckets fill in reverse order up to their limits, each parameter aligned") {
  // Six parameters of 10 floats (40 bytes); offsets round up to 4 elements.
  std::vector<ParameterShape> p(6, ParameterShape{10, kFloat});
  auto layout = plan_buckets(p, {}, small_limits());
  REQUIRE(layout.buckets.size() == 2);
  // First bucket (100 bytes): 5 at 0, 4 at 12 (88 bytes); 3 would need 136.
  CHECK((layout.buckets[0].params == std::vector<int>{5, 4}));
  CHECK((layout.buckets[0].offsets == std::vector<int64_t>{0, 12}));
  CHECK(layout.buckets[0].elements == 22);
  // Then 200 bytes: 3, 2, 1, 0 at 0, 12, 24, 36 (184 bytes).
  CHECK((layout.buckets[1].params == std::vector<int>{3, 2, 1, 0}));
  CHECK((layout.buckets[1].offsets == std::vector<int64_t>{0, 12, 24, 36}));
  CHECK((layout.bucket_of == std::vector<int>{1, 1, 1, 1, 0, 0}));
  CHECK(layout.offset_of[1] == 24);
}

TEST_CASE("a given order is followed and a parameter over the limit gets a bucket of its own") {
  std::vector<ParameterShape> p = {{10, kFloat}, {1000, kFloat}, {10, kFloat}};
  auto layout = plan_buckets(p, {0, 1, 2}, small_limits());
  REQUIRE(layout.buckets.size() == 3);
  CHECK((layout.buckets[0].params == std::vector<int>{0}));
  CHECK((layout.buckets[1].params == std::vector<int>{1}));
  CHECK(layout.buckets[1].elements == 1000);
  CHECK((layout.buckets[2].params == std::vector<int>{2}));
}

TEST_CASE("each dtype has its own buckets; by layer one per tensor, by model one per dtype") {
  std::vector<ParameterShape> p = {{10, kFloat}, {10, kHalf}, {10, kFloat}, {10, kHalf}};
  auto layout = plan_buckets(p, {}, small_limits());
  for (auto& b : layout.buckets)
    for (int i : b.params) CHECK((p[static_cast<size_t>(i)].type == b.type));
  CHECK(layout.buckets.size() == 2);

  auto by_layer_options = small_limits();
  by_layer_options.aggregation = Aggregation::layer;
  CHECK(plan_buckets(p, {}, by_layer_options).buckets.size() == 4);

  auto by_model_options = small_limits();
  by_model_options.aggregation = Aggregation::model;
  std::vector<ParameterShape> big(8, ParameterShape{1000, kFloat});
  big.push_back({7, kHalf});
  auto by_model = plan_buckets(big, {}, by_model_options);
  REQUIRE(by_model.buckets.size() == 2);
  CHECK((by_model.buckets[0].type == kHalf));  // reverse order: the half tensor comes first
  CHECK(by_model.buckets[1].params.size() == 8);
}

TEST_CASE(
    "observed ready times split a bucket at a pause in backward once it holds the first bucket's "
    "size") {
  // Reverse order 5..0; first bucket 5, 4 as before. Then 3, 2 (88 bytes), 1 (136 bytes), 0.
  std::vector<ParameterShape> p(6, ParameterShape{10, kFloat});
  // A pause before 1, while the open bucket holds 88 bytes (< 100): no split. A pause before 0,
  // while it holds 136 bytes: split.
  std::vector<int64_t> ready = {11000, 5000, 0, 0, 0, 0};  // pauses of 5 and 6 ms
  auto layout = plan_buckets(p, {}, small_limits(), ready);
  REQUIRE(layout.buckets.size() == 3);
  CHECK((layout.buckets[0].params == std::vector<int>{5, 4}));
  CHECK((layout.buckets[1].params == std::vector<int>{3, 2, 1}));
  CHECK((layout.buckets[2].params == std::vector<int>{0}));
  CHECK(layout.offset_of[0] == 0);

  // Pauses shorter than the gap, a gap of zero, or an unobserved parameter: sizes alone.
  auto longer_gap = small_limits();
  longer_gap.bucket_split_gap = std::chrono::microseconds(5999);
  CHECK(plan_buckets(p, {}, longer_gap, ready).buckets.size() == 3);
  longer_gap.bucket_split_gap = std::chrono::microseconds(6000);
  CHECK(plan_buckets(p, {}, longer_gap, ready).buckets.size() == 2);
  auto no_gap = small_limits();
  no_gap.bucket_split_gap = std::chrono::microseconds(0);
  CHECK(plan_buckets(p, {}, no_gap, ready).buckets.size() == 2);
  std::vector<int64_t> unobserved = {-1, 5000, 0, 0, 0, 0};
  CHECK(plan_buckets(p, {}, small_limits(), unobserved).buckets.size() == 2);
}

TEST_CASE(
    "a model smaller than the first bucket splits at a pause in backward once a bucket holds 64 "
    "KiB") {
  // The Fashion-MNIST CNN: conv1 (3x3, 1 -> 16), conv2 (3x3, 16 -> 32), fc1 (1568 -> 128), fc2
  // (128 -> 10); 828 KB in all, under the default first bucket of 1 MiB. Backward gives fc2's and
  // fc1's gradients within a millisecond, then computes conv2's for 6 ms and conv1's for 6 more.
  const std::vector<ParameterShape> p = {{144, kFloat},  {16, kFloat},     {4608, kFloat},
                                         {32, kFloat},   {200704, kFloat}, {128, kFloat},
                                         {1280, kFloat}, {10, kFloat}};
  const std::vector<int64_t> ready = {12000, 12000, 6000, 6000, 300, 200, 100, 0};
  const DdpOptions defaults;
  auto layout = plan_buckets(p, {}, defaults, ready);
  // fc2 and fc1 (808 KB) reduce while backward computes the convolutions; conv2 (18.6 KB) is below
  // 64 KiB and waits for conv1 in the next bucket.
  REQUIRE(layout.buckets.size() == 2);
  CHECK((layout.buckets[0].params == std::vector<int>{7, 6, 5, 4}));
  CHECK((layout.buckets[1].params == std::vector<int>{3, 2, 1, 0}));
  // Without the observed pauses, or with the gap turned off: one bucket, as PyTorch DDP makes it.
  CHECK(plan_buckets(p, {}, defaults).buckets.size() == 1);
  auto no_gap = defaults;
  no_gap.bucket_split_gap = std::chrono::microseconds(0);
  CHECK(plan_buckets(p, {}, no_gap, ready).buckets.size() == 1);
}
