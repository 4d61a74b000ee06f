// Sign compression: each rank sends one bit per element (and, scaled, one float per tensor);
// the messages are allgathered and every rank decodes and sums all of them.
//   scaled:        rank r sends s_t sign(x_t) with s_t = mean |x_t| per tensor t; result is
//                  scale * sum_r s_rt sign(x_rt). With error feedback x = g + e, e = x - s sign(x).
//   majority vote: rank r sends sign(g); result is sign(sum_r sign(g_r)) in {-1, 0, +1}.
#include <cstring>
#include <vector>

#include "comm/codecs/sign.h"
#include "comm/compression/reductions.h"

namespace troupe::comm {

namespace {

class Sign final : public Reduction {
 public:
  Sign(const SignCompression& config, const BucketBuffer& bucket)
      : config_(config), bucket_(bucket) {
    // Message: one float scale per tensor, then each tensor's bits from a byte boundary.
    size_t bytes = bucket.tensors.size() * sizeof(float);
    for (const auto& t : bucket.tensors) {
      bits_at_.push_back(bytes);
      bytes += sign_bytes(t.count);
    }
    words_ = (bytes + 3) / 4;
    if (config.error_feedback) error_.assign(bucket.count, 0.0f);
  }
  std::string name() const override {
    return config_.mode == SignMode::scaled ? "sign" : "sign(majority vote)";
  }

  void save_state(StateWriter& out) const override { out.vector(error_); }

  void load_state(StateReader& in) override {
    error_ = in.vector<float>(error_.size(), "the error-feedback memory");
  }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    const size_t message = words_ * 4;
    // Sized once; every message is rewritten each step.
    mine_.resize(message);
    all_.resize(message * static_cast<size_t>(step.group.world_size));
    auto* data = static_cast<float*>(bucket_.data);
    return {[this, step, data, message] {
      auto* scales = reinterpret_cast<float*>(mine_.data());
      for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
        const auto& t = bucket_.tensors[i];
        float* x = data + t.offset;
        uint8_t* bits = mine_.data() + bits_at_[i];
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
      auto schedule = allgather_schedule(step.group, mine_.data(), all_.data(), words_,
                                         DataType::int32, step.collectives);
      schedule.finally = [this, step, data, message] { decode(step, data, message); };
      return schedule;
    }};
  }

 private:
  void decode(const ReduceStep& step, float* data, size_t message) {
    const bool vote = config_.mode == SignMode::majority_vote;
    for (size_t i = 0; i < bucket_.tensors.size(); ++i) {
      const auto& t = bucket_.tensors[i];
      float* x = data + t.offset;
      std::memset(x, 0, t.count * sizeof(float));
      for (int r = 0; r < step.group.world_size; ++r) {
        const uint8_t* from = all_.data() + message * static_cast<size_t>(r);
        float s = 1.0f;
        if (!vote) {
          std::memcpy(&s, from + i * sizeof(float), sizeof(float));
          s *= static_cast<float>(step.scale);
        }
        sign_unpack_add(from + bits_at_[i], t.count, s, x);
      }
      if (vote) sign_in_place(x, t.count);
    }
  }

  SignCompression config_;
  BucketBuffer bucket_;
  std::vector<size_t> bits_at_;
  size_t words_ = 0;
  std::vector<float> error_;
  std::vector<uint8_t> mine_, all_;
};

}  // namespace

std::shared_ptr<Reduction> make_sign_reduction(const SignCompression& config,
                                               const BucketBuffer& bucket) {
  return std::make_shared<Sign>(config, bucket);
}

}  // namespace troupe::comm
