// fp16 / bf16 compression: scale, cast, allreduce in half precision, cast back.
#include <vector>

#include "comm/codecs/half.h"
#include "comm/compression/reductions.h"

namespace troupe::comm {

namespace {

class Half final : public Reduction {
 public:
  Half(const HalfPrecision& config, const BucketBuffer& bucket)
      : config_(config), bucket_(bucket), wire_(bucket.count) {}
  std::string name() const override { return config_.bfloat16 ? "bf16" : "fp16"; }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    return {[this, step] {
      auto* data = static_cast<float*>(bucket_.data);
      const auto scale = static_cast<float>(step.scale);
      // The scale goes first, before the cast: the sum of scaled values stays in range.
      if (config_.bfloat16)
        encode_bfloat16(data, bucket_.count, scale, wire_.data());
      else
        encode_half(data, bucket_.count, scale, wire_.data());
      const DataType type = config_.bfloat16 ? DataType::bfloat16 : DataType::float16;
      auto schedule = allreduce_schedule(step.group, wire_.data(), bucket_.count, type,
                                         ReduceOp::sum, step.collectives);
      schedule.finally = [this, data] {
        if (config_.bfloat16)
          decode_bfloat16(wire_.data(), bucket_.count, 1.0f, data);
        else
          decode_half(wire_.data(), bucket_.count, 1.0f, data);
      };
      return schedule;
    }};
  }

 private:
  HalfPrecision config_;
  BucketBuffer bucket_;
  std::vector<uint16_t> wire_;
};

}  // namespace

std::shared_ptr<Reduction> make_half_reduction(const HalfPrecision& config,
                                               const BucketBuffer& bucket) {
  return std::make_shared<Half>(config, bucket);
}

}  // namespace troupe::comm
