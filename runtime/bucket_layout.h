#pragma once
/// BucketLayout: which parameters share a gradient bucket, and where each one sits in it.
///
/// Parameters are taken in the given order (by default reverse definition order, the order in
/// which backward produces gradients) and appended to the open bucket of their dtype; a bucket is
/// closed when the next parameter would take it past its byte limit (`first_bucket_bytes` for the
/// very first bucket, `bucket_bytes` after). Every parameter starts at a multiple of
/// `align_bytes`. Aggregation::layer gives each parameter its own bucket, Aggregation::model one
/// bucket per dtype. A parameter larger than the limit gets a bucket to itself.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace troupe {

struct DdpOptions;

/// One parameter as the layout sees it.
struct ParameterShape {
  int64_t numel;
  c10::ScalarType type;
};

struct BucketLayout {
  struct Bucket {
    c10::ScalarType type = c10::ScalarType::Float;
    std::vector<int> params;        // indices into the parameter list, in bucket order
    std::vector<int64_t> offsets;   // element offset of each of them
    int64_t elements = 0;           // used, padding included
  };
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;       // by parameter index
  std::vector<int64_t> offset_of;   // by parameter index
};

/// Plans the buckets of `params` taken in `order` (empty: reverse definition order).
BucketLayout plan_buckets(const std::vector<ParameterShape>& params, const std::vector<int>& order,
                          const DdpOptions& options);

}  // namespace troupe
