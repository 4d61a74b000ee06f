// PowerSGD (Vogels, Karimireddy, Jaggi 2019), per bucket, as PyTorch's powerSGD_hook does it:
//   M = g + e for each compressed matrix (rows x cols, viewed from the tensor)
//   stage 1: P = M Q for every matrix, and the uncompressed tensors copied beside them;
//            allreduce that one buffer (sum)
//   stage 2: uncompressed tensors := sum * scale; P := orthonormal columns of P (the same on every
//            rank, since P is); Q = M^T P; allreduce the Qs (sum)
//   end:     M := P Q^T * scale; e = M_local - P Q^T / world; Q kept for the next step (warm start)
// With error feedback M is kept in e's place from stage 1 on (stage 1 then writes lines it has
// just read, not the bucket's), and stays there after the end: the end writes the bucket only and
// keeps its P and Q, and the next step's stage 1 subtracts P Q^T / world from M as it reads it for
// the sum (low_rank_settle_add_project), which spares a pass that reads and writes the memory.
// save_state() writes the memory settled. Before start_iter the bucket is allreduced in full and
// e is not touched. A
// tensor whose gradient lies elsewhere (take_input) is read there: by stage 1 only (with error
// feedback) or throughout (without), which spares copying the gradient in.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "comm/codecs/low_rank.h"
#include "comm/compression/coded.h"
#include "comm/compression/reductions.h"

namespace troupe::comm {

PowerSgdLayout::PowerSgdLayout(const PowerSGD& config, const BucketBuffer& bucket) {
  for (size_t i = 0; i < bucket.tensors.size(); ++i) {
    const auto& t = bucket.tensors[i];
    const size_t rows = t.rows, cols = t.cols();
    const size_t r = std::min({static_cast<size_t>(config.rank), rows, cols});
    const bool worth = rows > 1 && cols > 1 &&
                       static_cast<double>(rows * cols) >=
                           config.min_compression_rate * static_cast<double>((rows + cols) * r);
    if (!worth) {
      plain.push_back({i, 0});
      continue;
    }
    matrices.push_back({i, rows, cols, r, p_count, q_count});
    p_count += rows * r;
    q_count += r * cols;
  }
  for (auto& u : plain) {
    u.at = p_count;
    p_count += bucket.tensors[u.tensor].count;
  }
}

void power_sgd_qt(const PowerSGD& config, const BucketBuffer& bucket,
                  const PowerSgdLayout::Matrix& m, uint32_t step, float* qt) {
  const uint64_t seed =
      config.warm_start
          ? mix_seed(config.seed, static_cast<uint64_t>(bucket.index), m.tensor)
          : mix_seed(config.seed, static_cast<uint64_t>(bucket.index) << 32 | step, m.tensor);
  random_normal(seed, qt, m.r * m.cols);
}

namespace {

class PowerSgdReduction final : public Reduction {
 public:
  PowerSgdReduction(const PowerSGD& config, const BucketBuffer& bucket)
      : config_(config), bucket_(bucket) {
    const PowerSgdLayout layout(config, bucket);
    for (const auto& l : layout.matrices) {
      Matrix m;
      static_cast<PowerSgdLayout::Matrix&>(m) = l;
      m.qt.resize(m.r * m.cols);
      power_sgd_qt(config, bucket, m, 0, m.qt.data());
      matrices_.push_back(std::move(m));
    }
    plain_ = layout.plain;
    p_.resize(layout.p_count);
    q_.resize(layout.q_count);
    if (config.error_feedback) {
      held_p_.resize(layout.p_count);  // only the memory's deferred update swaps into these
      held_q_.resize(layout.q_count);
      error_.assign(bucket.count, 0.0f);
    }
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
    out.vector(settled_error());
    save_shared_state(out);
  }

  void load_state(StateReader& in) override {
    auto error = in.vector<float>(error_.size(), "the error-feedback memory");
    auto qs = read_qs(in);
    error_ = std::move(error);
    unsettled_ = false;
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
            if (!config_.warm_start) power_sgd_qt(config_, bucket_, m, step.step, m.qt.data());
            // M = gradient + memory, summed row by row as the projection reads it, into the
            // memory (its lines were just read; the bucket's would first be fetched); without
            // memory M is the gradient, read where it lies.
            if (config_.error_feedback && unsettled_) {
              // The memory still holds the last step's M: M - P Q^T / world on the way.
              low_rank_settle_add_project(in, error_.data() + t.offset, held_p_.data() + m.p_at,
                                          held_q_.data() + m.q_at, m.r, held_scale_, held_back_,
                                          m.rows, m.cols, m.qt.data(), m.r, p_.data() + m.p_at);
            } else if (config_.error_feedback) {
              float* e = error_.data() + t.offset;
              low_rank_add_project_from(in, e, e, m.rows, m.cols, m.qt.data(), m.r,
                                        p_.data() + m.p_at);
            } else {
              low_rank_project(in, m.rows, m.cols, m.qt.data(), m.r, p_.data() + m.p_at);
            }
          }
          unsettled_ = false;
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
  struct Matrix : PowerSgdLayout::Matrix {  // p_at and q_at: offsets in p_ and q_
    std::vector<float> qt;                  // r x cols: this matrix's Q, transposed
  };
  using Plain = PowerSgdLayout::Plain;  // at: offset in p_

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

  // x := P Q^T * factor. With error feedback the memory, which holds M, is to become
  // M - P Q^T / world: settled by the next step's stage 1 (or by save_state), which P and Q are
  // kept for.
  void expand(const ReduceStep& step, float* data) {
    const float world = static_cast<float>(step.group.world_size);
    const auto factor = static_cast<float>(step.scale);
    for (auto& m : matrices_) {
      const auto& t = bucket_.tensors[m.tensor];
      const float* q = q_.data() + m.q_at;
      low_rank_expand(p_.data() + m.p_at, q, m.rows, m.cols, m.r, factor, data + t.offset);
      if (config_.warm_start) {
        const float inv = 1.0f / world;
        for (size_t k = 0; k < m.qt.size(); ++k) m.qt[k] = q[k] * inv;
      }
    }
    if (config_.error_feedback && !matrices_.empty()) {
      std::swap(p_, held_p_);  // the next stage 1 writes p_ anew
      std::swap(q_, held_q_);
      held_scale_ = factor;
      held_back_ = 1.0f / (world * factor);
      unsettled_ = true;
    }
  }

  // The memory as the next step will read it: with an expansion still to subtract, a copy with
  // it subtracted (low_rank_expand_from_error's arithmetic, which the next stage 1 repeats).
  std::vector<float> settled_error() const {
    std::vector<float> error = error_;
    if (!unsettled_) return error;
    std::vector<float> out;
    for (const auto& m : matrices_) {
      out.resize(m.rows * m.cols);
      low_rank_expand_from_error(held_p_.data() + m.p_at, held_q_.data() + m.q_at, m.rows, m.cols,
                                 m.r, held_scale_, held_back_,
                                 error.data() + bucket_.tensors[m.tensor].offset, out.data());
    }
    return error;
  }

  PowerSGD config_;
  BucketBuffer bucket_;
  std::vector<Matrix> matrices_;
  std::vector<Plain> plain_;
  std::vector<float> p_, q_, error_;
  // The last expansion's P and Q (swapped out of p_ and q_) and its scale and back, while the
  // memory still holds that step's M (unsettled_).
  std::vector<float> held_p_, held_q_;
  float held_scale_ = 1.0f, held_back_ = 1.0f;
  bool unsettled_ = false;
  std::vector<const float*> inputs_;  // per tensor: where take_input said it lies, or null
};

}  // namespace

std::shared_ptr<Reduction> make_power_sgd_reduction(const PowerSGD& config,
                                                    const BucketBuffer& bucket) {
  return std::make_shared<PowerSgdReduction>(config, bucket);
}

}  // namespace troupe::comm
