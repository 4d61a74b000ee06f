#include "ddp/bucket_layout.h"

#include <algorithm>
#include <map>

#include "ddp/options.h"

namespace troupe {

BucketLayout plan_buckets(const std::vector<ParameterShape>& params, const std::vector<int>& order,
                          const DdpOptions& options, const std::vector<int64_t>& ready_us) {
  std::vector<int> sequence = order;
  if (sequence.empty())
    for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) sequence.push_back(i);
  BucketLayout layout;
  layout.bucket_of.assign(params.size(), -1);
  layout.offset_of.assign(params.size(), 0);
  std::map<c10::ScalarType, int> open;  // the bucket being filled, per dtype
  const int64_t gap_us = options.bucket_split_gap.count();
  auto ready = [&](int i) { return ready_us.empty() ? -1 : ready_us[static_cast<size_t>(i)]; };
  // A gap in readiness between the open bucket's last gradient and gradient i.
  auto gap_before = [&](const BucketLayout::Bucket& b, int i) {
    if (gap_us <= 0 || b.params.empty()) return false;
    const int64_t last = ready(b.params.back()), next = ready(i);
    return last >= 0 && next >= 0 && next - last > gap_us;
  };
  const size_t split_floor = std::min(options.first_bucket_bytes, kSplitFloorBytes);
  for (int i : sequence) {
    const auto& p = params[static_cast<size_t>(i)];
    const auto elem = static_cast<int64_t>(c10::elementSize(p.type));
    const int64_t align = std::max<int64_t>(1, static_cast<int64_t>(options.align_bytes) / elem);
    auto aligned = [align](int64_t n) { return (n + align - 1) / align * align; };
    auto it = open.find(p.type);
    bool need_new = it == open.end() || options.aggregation == Aggregation::layer;
    if (!need_new && options.aggregation == Aggregation::bucket) {
      const auto& b = layout.buckets[static_cast<size_t>(it->second)];
      const size_t limit = it->second == 0 ? options.first_bucket_bytes : options.bucket_bytes;
      const auto bytes = static_cast<size_t>((aligned(b.elements) + p.numel) * elem);
      const auto held = static_cast<size_t>(b.elements * elem);
      need_new = (!b.params.empty() && bytes > limit) || (held >= split_floor && gap_before(b, i));
    }
    if (need_new) {
      BucketLayout::Bucket b;
      b.type = p.type;
      layout.buckets.push_back(std::move(b));
      it = open.insert_or_assign(p.type, static_cast<int>(layout.buckets.size()) - 1).first;
    }
    auto& bucket = layout.buckets[static_cast<size_t>(it->second)];
    const int64_t offset = aligned(bucket.elements);
    bucket.params.push_back(i);
    bucket.offsets.push_back(offset);
    bucket.elements = offset + p.numel;
    layout.bucket_of[static_cast<size_t>(i)] = it->second;
    layout.offset_of[static_cast<size_t>(i)] = offset;
  }
  return layout;
}

}  // namespace troupe
