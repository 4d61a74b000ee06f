// Sparsification: k coordinates of the bucket per step, with error-feedback memory.
//   top_k:    each rank picks its own k largest |x|; (indices, values) are allgathered and every
//             rank scatter-adds all of them (the sparse exchange: 8k bytes per rank).
//   random_k: every rank draws the same k indices from (seed, step, bucket): only the values
//             travel, in an allreduce.
//   block:    the same k contiguous coordinates on every rank, starting at a shared random offset
//             and wrapping around the end (so no coordinate is left out).
// With error feedback x = g + e and e = x with the sent coordinates zeroed.
// With momentum correction (Lin et al., Deep Gradient Compression): u = m u + g, x = e + u, and
// the sent coordinates of both e and u are zeroed (momentum factor masking); the result is then
// the update direction, to be applied by an optimizer without momentum of its own.
// The exchange alone (coded.h) is top_k's allgather of records with the selection and the
// scatter-adds left to its caller (the GPU's kernels), the records in the caller's memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "comm/codecs/sparse.h"
#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"
#include "comm/status.h"

namespace troupe::comm {

size_t sparse_k(const Sparsification& config, size_t count) {
  const size_t k =
      config.count
          ? std::min(config.count, count)
          : std::max<size_t>(
                1, static_cast<size_t>(std::llround(config.ratio * static_cast<double>(count))));
  return std::min(k, count);
}

namespace {

class Sparse final : public Reduction {
 public:
  // `records` null: the whole reduction on the CPU. Else (top_k only) the exchange of records
  // alone, in `records` (for `world_size` ranks).
  Sparse(const Sparsification& config, const BucketBuffer& bucket, int world_size = 0,
         uint32_t* records = nullptr)
      : config_(config),
        bucket_(bucket),
        k_(sparse_k(config, bucket.count)),
        world_size_(world_size),
        external_(records) {
    if (external_) return;
    const size_t n = bucket.count;
    if (config.error_feedback) error_.assign(n, 0.0f);
    if (config.momentum > 0) velocity_.assign(n, 0.0f);
    indices_.resize(k_);
    values_.resize(k_);
  }
  std::string name() const override { return "sparse"; }
  size_t k() const { return k_; }

  void save_state(StateWriter& out) const override {
    out.vector(error_);
    out.vector(velocity_);
  }

  void load_state(StateReader& in) override {
    auto error = in.vector<float>(error_.size(), "the error-feedback memory");
    auto velocity = in.vector<float>(velocity_.size(), "the momentum-correction velocity");
    error_ = std::move(error);
    velocity_ = std::move(velocity);
  }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    auto* data = static_cast<float*>(bucket_.data);
    if (external_) {
      if (step.group.world_size != world_size_)
        throw Error("top-k exchange of bucket " + std::to_string(bucket_.index) + ": made for " +
                    std::to_string(world_size_) + " ranks, run among " +
                    std::to_string(step.group.world_size));
      return {[this, step] {
        return allgather_schedule(step.group, own_record(step, external_), external_, 2 * k_,
                                  DataType::int32, step.collectives);
      }};
    }
    return {[this, step, data] {
      zero_padding(bucket_);
      const size_t n = bucket_.count;
      if (!velocity_.empty()) {
        const auto m = static_cast<float>(config_.momentum);
        float* u = velocity_.data();
        const float* e = error_.data();
        for (size_t i = 0; i < n; ++i) {
          u[i] = m * u[i] + data[i];
          data[i] = e[i] + u[i];
        }
      } else if (config_.error_feedback) {
        for (size_t i = 0; i < n; ++i) data[i] += error_[i];
      }
      choose(step, data);
      gather(data, indices_.data(), k_, values_.data());
      if (config_.error_feedback) {
        std::memcpy(error_.data(), data, n * sizeof(float));
        for (size_t j = 0; j < k_; ++j) error_[indices_[j]] = 0.0f;
      }
      for (size_t j = 0; j < k_ && !velocity_.empty(); ++j) velocity_[indices_[j]] = 0.0f;
      if (config_.mode == SparseMode::top_k) return exchange_top_k(step, data);
      auto schedule = allreduce_schedule(step.group, values_.data(), k_, DataType::float32,
                                         ReduceOp::sum, step.collectives);
      schedule.finally = [this, step, data] {
        std::memset(data, 0, bucket_.count * sizeof(float));
        scatter_add(indices_.data(), values_.data(), k_, static_cast<float>(step.scale), data);
      };
      return schedule;
    }};
  }

 private:
  void choose(const ReduceStep& step, const float* data) {
    const size_t n = bucket_.count;
    const uint64_t seed = mix_seed(config_.seed, step.step, static_cast<uint64_t>(bucket_.index));
    switch (config_.mode) {
      case SparseMode::top_k:
        top_k(data, n, k_, indices_.data());
        break;
      case SparseMode::random_k:
        random_k(seed, n, k_, indices_.data());
        break;
      case SparseMode::block: {
        const size_t start = static_cast<size_t>(seed % n);
        for (size_t j = 0; j < k_; ++j) indices_[j] = static_cast<uint32_t>((start + j) % n);
        break;
      }
    }
  }

  // This rank's record among every rank's at `all`.
  uint32_t* own_record(const ReduceStep& step, uint32_t* all) const {
    return all + 2 * k_ * static_cast<size_t>(step.group.rank);
  }

  // Record per rank: k uint32 indices, then k float values (both 4-byte words); this rank's is
  // allgathered in place.
  Schedule exchange_top_k(const ReduceStep& step, float* data) {
    const size_t world = static_cast<size_t>(step.group.world_size);
    all_.resize(2 * k_ * world);
    uint32_t* record = own_record(step, all_.data());
    std::memcpy(record, indices_.data(), k_ * sizeof(uint32_t));
    std::memcpy(record + k_, values_.data(), k_ * sizeof(float));
    auto schedule = allgather_schedule(step.group, record, all_.data(), 2 * k_, DataType::int32,
                                       step.collectives);
    schedule.finally = [this, step, data, world] {
      std::memset(data, 0, bucket_.count * sizeof(float));
      for (size_t r = 0; r < world; ++r) {
        const uint32_t* rec = all_.data() + 2 * k_ * r;
        scatter_add(rec, reinterpret_cast<const float*>(rec + k_), k_,
                    static_cast<float>(step.scale), data);
      }
    };
    return schedule;
  }

  Sparsification config_;
  BucketBuffer bucket_;
  size_t k_ = 0;
  int world_size_;
  uint32_t* external_;
  std::vector<float> error_;
  std::vector<float> velocity_;  // momentum correction's u; empty without it
  std::vector<uint32_t> indices_;
  std::vector<float> values_;
  std::vector<uint32_t> all_;
};

}  // namespace

std::shared_ptr<Reduction> make_sparse_reduction(const Sparsification& config,
                                                 const BucketBuffer& bucket) {
  return std::make_shared<Sparse>(config, bucket);
}

std::shared_ptr<Reduction> make_top_k_exchange(const Sparsification& config,
                                               const BucketBuffer& bucket, int world_size,
                                               void* records) {
  if (config.mode != SparseMode::top_k)
    throw Error("sparse exchange of bucket " + std::to_string(bucket.index) +
                ": only top_k exchanges records (random_k and block allreduce their values)");
  if (!records || world_size < 1)
    throw Error("top-k exchange of bucket " + std::to_string(bucket.index) +
                ": needs its records' memory and a world of at least one rank (got " +
                std::to_string(world_size) + ")");
  return std::make_shared<Sparse>(config, bucket, world_size, static_cast<uint32_t*>(records));
}

}  // namespace troupe::comm
