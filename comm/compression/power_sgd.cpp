// PowerSGD (Vogels, Karimireddy, Jaggi 2019), per bucket, as PyTorch's powerSGD_hook does it:
//   M = g + e for each compressed matrix (rows x cols, viewed from the tensor)
//   stage 1: P = M Q for every matrix, and the uncompressed tensors copied beside them;
//            allreduce that one buffer (sum)
//   stage 2: uncompressed tensors := sum * scale; P := orthonormal columns of P (the same on every
//            rank, since P is); Q = M^T P; allreduce the Qs (sum)
//   end:     M := P Q^T * scale; e = M_local - P Q^T / world; Q kept for the next step (warm start)
// With error feedback M is kept in e's place from stage 1 to the end (stage 1 then writes lines it
// has just read, not the bucket's; e holds the memory again once the step ends, and M if the step
// fails on the way). Before start_iter the bucket is allreduced in full and e is not touched. A
// tensor whose gradient lies elsewhere (take_input) is read there: by stage 1 only (with error
// feedback) or throughout (without), which spares copying the gradient in.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "comm/codecs/low_rank.h"
#include "comm/compression/reductions.h"

namespace troupe::comm {

namespace {

class PowerSgdReduction final : public Reduction {
 public:
  PowerSgdReduction(const PowerSGD& config, const BucketBuffer& bucket)
      : config_(config), bucket_(bucket) {
    size_t p_at = 0, q_at = 0;
    for (size_t i = 0; i < bucket.tensors.size(); ++i) {
      const auto& t = bucket.tensors[i];
      const size_t rows = t.rows, cols = t.cols();
      const size_t r = std::min({static_cast<size_t>(config.rank), rows, cols});
      const bool worth = rows > 1 && cols > 1 &&
                         static_cast<double>(rows * cols) >=
                             config.min_compression_rate * static_cast<double>((rows + cols) * r);
      if (!worth) {
        plain_.push_back({i, 0});
        continue;
      }
      Matrix m;
      m.tensor = i;
      m.rows = rows;
      m.cols = cols;
      m.r = r;
      m.p_at = p_at;
      m.q_at = q_at;
      p_at += rows * r;
      q_at += r * cols;
      m.qt.resize(r * cols);
      random_normal(mix_seed(config.seed, static_cast<uint64_t>(bucket.index), i), m.qt.data(),
                    m.qt.size());
      matrices_.push_back(std::move(m));
    }
    for (auto& u : plain_) {
      u.at = p_at;
      p_at += bucket.tensors[u.tensor].count;
    }
    p_.resize(p_at);
    q_.resize(q_at);
    if (config.error_feedback) error_.assign(bucket.count, 0.0f);
    inputs_.assign(bucket.tensors.size(), nullptr);
  }
  std::string name() const override { return "powersgd"; }

  bool take_input(size_t tensor, const void* data) override {
    if (tensor >= inputs_.size() || bucket_.type != DataType::float32) return false;
    inputs_[tensor] = static_cast<const float*>(data);
    return true;
  }

  // The step counter (start_iter) is the module's; the warm-start Qs and the memory are here.
  void save_state(StateWriter& out) const override {
    out.vector(error_);
    save_shared_state(out);
  }

  void load_state(StateReader& in) override {
    auto error = in.vector<float>(error_.size(), "the error-feedback memory");
    auto qs = read_qs(in);
    error_ = std::move(error);
    take_qs(std::move(qs));
  }

  // The warm-start Qs are the allreduced ones, equal on every rank; the memory is this rank's.
  void save_shared_state(StateWriter& out) const override {
    out.value<uint64_t>(matrices_.size());
    for (const auto& m : matrices_) out.vector(m.qt);
  }

  void load_shared_state(StateReader& in) override { take_qs(read_qs(in)); }

  std::vector<std::function<Schedule()>> stages(const ReduceStep& step) override {
    auto* data = static_cast<float*>(bucket_.data);
    // Where each tensor's values are this step: the bucket, or where take_input said.
    auto inputs = std::make_shared<std::vector<const float*>>(
        std::exchange(inputs_, std::vector<const float*>(bucket_.tensors.size(), nullptr)));
    for (size_t i = 0; i < inputs->size(); ++i)
      if (!(*inputs)[i]) (*inputs)[i] = data + bucket_.tensors[i].offset;
    if (step.step < config_.start_iter)
      return {[this, step, data, inputs] {
        for (size_t i = 0; i < inputs->size(); ++i) {
          const auto& t = bucket_.tensors[i];
          if ((*inputs)[i] != data + t.offset)
            std::memcpy(data + t.offset, (*inputs)[i], t.count * sizeof(float));
        }
        return scaled_allreduce(step, data, bucket_.count, bucket_.type);
      }};
    return {
        [this, step, inputs] {
          for (auto& m : matrices_) {
            const auto& t = bucket_.tensors[m.tensor];
            const float* in = (*inputs)[m.tensor];
            if (!config_.warm_start)
              random_normal(
                  mix_seed(config_.seed, static_cast<uint64_t>(bucket_.index) << 32 | step.step,
                           m.tensor),
                  m.qt.data(), m.qt.size());
            // M = gradient + memory, summed row by row as the projection reads it, into the
            // memory (its lines were just read; the bucket's would first be fetched); without
            // memory M is the gradient, read where it lies.
            if (config_.error_feedback) {
              float* e = error_.data() + t.offset;
              low_rank_add_project_from(in, e, e, m.rows, m.cols, m.qt.data(), m.r,
                                        p_.data() + m.p_at);
            } else {
              low_rank_project(in, m.rows, m.cols, m.qt.data(), m.r, p_.data() + m.p_at);
            }
          }
          for (auto& u : plain_) {
            const auto& t = bucket_.tensors[u.tensor];
            std::memcpy(p_.data() + u.at, (*inputs)[u.tensor], t.count * sizeof(float));
          }
          return allreduce_schedule(step.group, p_.data(), p_.size(), DataType::float32,
                                    ReduceOp::sum, step.collectives);
        },
        [this, step, data, inputs] {
          const auto factor = static_cast<float>(step.scale);
          for (auto& u : plain_) {
            const auto& t = bucket_.tensors[u.tensor];
            const float* from = p_.data() + u.at;
            float* to = data + t.offset;
            for (size_t k = 0; k < t.count; ++k) to[k] = from[k] * factor;
          }
          for (auto& m : matrices_) {
            float* p = p_.data() + m.p_at;
            orthogonalize_columns(p, m.rows, m.r);
            const float* mat = config_.error_feedback
                                   ? error_.data() + bucket_.tensors[m.tensor].offset
                                   : (*inputs)[m.tensor];
            low_rank_back_project(mat, m.rows, m.cols, p, m.r, q_.data() + m.q_at);
          }
          auto schedule = allreduce_schedule(step.group, q_.data(), q_.size(), DataType::float32,
                                             ReduceOp::sum, step.collectives);
          schedule.finally = [this, step, data] { expand(step, data); };
          return schedule;
        },
    };
  }

 private:
  struct Matrix {
    size_t tensor = 0;
    size_t rows = 0, cols = 0, r = 0;
    size_t p_at = 0, q_at = 0;  // offsets in p_ and q_
    std::vector<float> qt;      // r x cols: this matrix's Q, transposed
  };
  struct Plain {
    size_t tensor;
    size_t at;  // offset in p_
  };

  // The Qs save_shared_state wrote, checked against this bucket's matrices; nothing changes yet.
  std::vector<std::vector<float>> read_qs(StateReader& in) const {
    const auto count = in.value<uint64_t>();
    if (count != matrices_.size())
      in.fail(std::to_string(count) + " compressed matrices, expected " +
              std::to_string(matrices_.size()));
    std::vector<std::vector<float>> qs;
    for (const auto& m : matrices_) qs.push_back(in.vector<float>(m.qt.size(), "a Q matrix"));
    return qs;
  }

  void take_qs(std::vector<std::vector<float>> qs) {
    for (size_t i = 0; i < matrices_.size(); ++i) matrices_[i].qt = std::move(qs[i]);
  }

  void expand(const ReduceStep& step, float* data) {
    const float world = static_cast<float>(step.group.world_size);
    const auto factor = static_cast<float>(step.scale);
    for (auto& m : matrices_) {
      const auto& t = bucket_.tensors[m.tensor];
      float* x = data + t.offset;
      const float* p = p_.data() + m.p_at;
      const float* q = q_.data() + m.q_at;
      // With error feedback, in the same pass: the memory, which holds M, becomes
      // M - P Q^T / world, and x becomes P Q^T * factor.
      if (config_.error_feedback)
        low_rank_expand_from_error(p, q, m.rows, m.cols, m.r, factor, 1.0f / (world * factor),
                                   error_.data() + t.offset, x);
      else
        low_rank_expand(p, q, m.rows, m.cols, m.r, factor, x);
      if (config_.warm_start) {
        const float inv = 1.0f / world;
        for (size_t k = 0; k < m.qt.size(); ++k) m.qt[k] = q[k] * inv;
      }
    }
  }

  PowerSGD config_;
  BucketBuffer bucket_;
  std::vector<Matrix> matrices_;
  std::vector<Plain> plain_;
  std::vector<float> p_, q_, error_;
  std::vector<const float*> inputs_;  // per tensor: where take_input said it lies, or null
};

}  // namespace

std::shared_ptr<Reduction> make_power_sgd_reduction(const PowerSGD& config,
                                                    const BucketBuffer& bucket) {
  return std::make_shared<PowerSgdReduction>(config, bucket);
}

}  // namespace troupe::comm
