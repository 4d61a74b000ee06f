// Sign compression: each rank sends one bit per element (and, scaled, one float per tensor);
// the messages are allgathered and every rank decodes and sums all of them.
//   scaled:        rank r sends s_t sign(x_t) with s_t = mean |x_t| per tensor t; result is
//                  scale * sum_r s_rt sign(x_rt). With error feedback x = g + e, e = x - s sign(x).
//   majority vote: rank r sends sign(g); result is sign(sum_r sign(g_r)) in {-1, 0, +1}.
// The exchange alone (coded.h) is the same reduction with the encoding and decoding left to its
// caller (the GPU's kernels) and the messages in the caller's memory.
#include <cstring>
#include <vector>

#include "comm/codecs/sign.h"
#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"
#include "comm/status.h"

namespace troupe::comm {

SignMessage::SignMessage(const BucketBuffer& bucket) {
  bytes = bucket.tensors.size() * sizeof(float);
  for (const auto& t : bucket.tensors) {
    bits_at.push_back(bytes);
    bytes += sign_bytes(t.count);
  }
  bytes = (bytes + 3) / 4 * 4;
}

namespace {

class Sign final : public Reduction {
 public:
  // `messages` null: the reduction encodes and decodes on the CPU, its messages in its own
  // memory. Else only the exchange, in `messages` (for `world_size` ranks).
  Sign(const SignCompression& config, const BucketBuffer& bucket, int world_size = 0,
       uint8_t* messages = nullptr)
      : config_(config),
        bucket_(bucket),
        message_(bucket),
        world_size_(world_size),
        external_(messages) {
    if (config.error_feedback && !external_) error_.assign(bucket.count, 0.0f);
  }
  std::string name() const override {
    return config_.mode == SignMode::scaled ? "sign" : "sign(majority vote)";
  }

  void save_state(StateWriter& out) const override { out.vector(error_); }

  void load_state(StateReader& in) override {
    error_ = in.vector<float>(error_.size(), "the error-feedback memory");
  }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    const size_t message = message_.bytes;
    uint8_t* all = external_;
    if (external_) {
      if (step.group.world_size != world_size_)
        throw Error("sign exchange of bucket " + std::to_string(bucket_.index) + ": made for " +
                    std::to_string(world_size_) + " ranks, run among " +
                    std::to_string(step.group.world_size));
    } else {
      all_.resize(message * static_cast<size_t>(step.group.world_size));  // sized once
      all = all_.data();
    }
    uint8_t* mine = all + message * static_cast<size_t>(step.group.rank);
    return {[this, step, all, mine, message] {
      if (!external_) encode(mine);
      auto schedule =
          allgather_schedule(step.group, mine, all, message / 4, DataType::int32, step.collectives);
      if (!external_) schedule.finally = [this, step, all, message] { decode(step, all, message); };
      return schedule;
    }};
  }

 private:
  // This rank's message from the bucket (and the error memory, which it updates).
  void encode(uint8_t* mine) {
    auto* data = static_cast<float*>(bucket_.data);
    auto* scales = reinterpret_cast<float*>(mine);
    for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
      const auto& t = bucket_.tensors[i];
      float* x = data + t.offset;
      uint8_t* bits = mine + message_.bits_at[i];
      float* e = config_.error_feedback ? error_.data() + t.offset : nullptr;
      if (e)
        for (size_t k = 0; k < t.count; ++k) x[k] += e[k];
      const float s = config_.mode == SignMode::scaled ? mean_abs(x, t.count) : 1.0f;
      scales[i] = s;
      sign_pack(x, t.count, bits);
      if (e) {
        // e = x - s sign(x): what this step's message does not carry.
        sign_unpack(bits, t.count, -s, e);
        for (size_t k = 0; k < t.count; ++k) e[k] += x[k];
      }
    }
  }

  // The bucket from every rank's message.
  void decode(const ReduceStep& step, const uint8_t* all, size_t message) {
    auto* data = static_cast<float*>(bucket_.data);
    const bool vote = config_.mode == SignMode::majority_vote;
    for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
      const auto& t = bucket_.tensors[i];
      float* x = data + t.offset;
      std::memset(x, 0, t.count * sizeof(float));
      for (int r = 0; r < step.group.world_size; ++r) {
        const uint8_t* from = all + message * static_cast<size_t>(r);
        float s = 1.0f;
        if (!vote) {
          std::memcpy(&s, from + i * sizeof(float), sizeof(float));
          s *= static_cast<float>(step.scale);
        }
        sign_unpack_add(from + message_.bits_at[i], t.count, s, x);
      }
      if (vote) sign_in_place(x, t.count);
    }
  }

  SignCompression config_;
  BucketBuffer bucket_;
  SignMessage message_;
  int world_size_;
  uint8_t* external_;
  std::vector<float> error_;
  std::vector<uint8_t> all_;
};

}  // namespace

std::shared_ptr<Reduction> make_sign_reduction(const SignCompression& config,
                                               const BucketBuffer& bucket) {
  return std::make_shared<Sign>(config, bucket);
}

std::shared_ptr<Reduction> make_sign_exchange(const SignCompression& config,
                                              const BucketBuffer& bucket, int world_size,
                                              void* messages) {
  if (!messages || world_size < 1)
    throw Error("sign exchange of bucket " + std::to_string(bucket.index) +
                ": needs its messages' memory and a world of at least one rank (got " +
                std::to_string(world_size) + ")");
  return std::make_shared<Sign>(config, bucket, world_size, static_cast<uint8_t*>(messages));
}

}  // namespace troupe::comm
