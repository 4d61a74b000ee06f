#pragma once
/// BucketLayout: which parameters share a gradient bucket, and where each one sits in it.
///
/// Parameters are taken in the given order (by default reverse definition order, the order in
/// which backward produces gradients) and appended to the open bucket of their dtype; a bucket is
/// closed when the next parameter would take it past its byte limit (`first_bucket_bytes` for the
/// very first bucket, `bucket_bytes` after). Every parameter starts at a multiple of
/// `align_bytes`. Aggregation::layer gives each parameter its own bucket, Aggregation::model one
/// bucket per dtype. A parameter larger than the limit gets a bucket to itself.
///
/// With the gradient-ready times of an observed step, a bucket that already holds
/// min(`first_bucket_bytes`, 64 KiB) is also closed before a gradient that became ready more than
/// `bucket_split_gap` after the bucket's previous one: backward computes a layer between the
/// two, and the closed bucket reduces meanwhile instead of waiting for it (a 25 MiB bucket that
/// ends with the first layer's bias would otherwise start only when backward ends, and so would a
/// whole model smaller than the first bucket: a small CNN whose fc layer is most of its bytes).
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace troupe {

struct DdpOptions;

/// Below this, a bucket is not closed at a pause in backward (unless first_bucket_bytes is
/// smaller): its reduction is mostly latency, and one more collective costs as much.
inline constexpr size_t kSplitFloorBytes = size_t{64} << 10;

/// One parameter as the layout sees it.
struct ParameterShape {
  int64_t numel;
  c10::ScalarType type;
};

struct BucketLayout {
  struct Bucket {
    c10::ScalarType type = c10::ScalarType::Float;
    std::vector<int> params;       // indices into the parameter list, in bucket order
    std::vector<int64_t> offsets;  // element offset of each of them
    int64_t elements = 0;          // used, padding included
  };
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;      // by parameter index
  std::vector<int64_t> offset_of;  // by parameter index
};

/// Plans the buckets of `params` taken in `order` (empty: reverse definition order).
/// `ready_us`, if not empty, holds each parameter's gradient-ready time in microseconds (any
/// origin; negative: not observed, never split before).
BucketLayout plan_buckets(const std::vector<ParameterShape>& params, const std::vector<int>& order,
                          const DdpOptions& options, const std::vector<int64_t>& ready_us = {});

}  // namespace troupe
