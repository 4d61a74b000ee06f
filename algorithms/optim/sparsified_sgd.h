#pragma once
/// Sparsified SGD with memory (Stich, Cordonnier, Jaggi 2018; mlbench-core's SparsifiedSGD): each
/// step applies only k coordinates of each parameter's update and keeps the rest in a memory that
/// is added to the next step's update, so nothing is lost, only delayed.
///
/// Per parameter tensor p (flattened, d elements, k of them kept):
///   v = memory + lr * (grad + weight_decay * p)
///   c = comp_k(v)        top_k: the k largest |v|; random_k: k indices drawn from a generator
///                        seeded with (seed, step, parameter index); block: k contiguous
///                        coordinates from a random offset, wrapping past the end
///   p -= c               (CentralizedSparsifiedSGD: p -= (1/W) sum_r c_r, below)
///   memory = v - c
/// A parameter without a gradient counts as a zero gradient (its memory still drains).
///
/// Estimated weights (the paper's averaged iterate, mlbench's get_estimated_weights): after step t
/// (t = 0, 1, ...) with parameters x_t, x_bar = sum_t w_t x_t / sum_t w_t, w_t = (a + t)^2,
/// a = the defaults' average_shift (else max(1, d/k) over the whole model).
///
/// Parameters must be contiguous float32 CPU tensors (the selection runs on the comm/ kernels).
/// save/load (a torch archive: torch::save, Checkpoint::optimizer) keep each parameter's memory and
/// estimated weights, the step counter and the averaging sums; the options are the constructor's.
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/compression/algorithms.h"

namespace troupe {
class Runtime;
}

namespace troupe::optim {

/// Options of SparsifiedSGD and CentralizedSparsifiedSGD (builder style, as SGDOptions).
/// k per parameter tensor = count (capped at its elements) if count > 0, else
/// max(1, round(ratio * elements)).
struct SparsifiedSgdOptions : public torch::optim::OptimizerCloneableOptions<SparsifiedSgdOptions> {
  SparsifiedSgdOptions(double lr);  // NOLINT: implicit, as torch::optim::SGDOptions
  TORCH_ARG(double, lr);
  TORCH_ARG(double, weight_decay) = 0;
  /// 0 < ratio <= 1 (used when count is 0).
  TORCH_ARG(double, ratio) = 0.01;
  TORCH_ARG(size_t, count) = 0;
  TORCH_ARG(comm::SparseMode, mode) = comm::SparseMode::top_k;
  /// Seed of random_k and block (every rank of a CentralizedSparsifiedSGD may use the same).
  TORCH_ARG(uint64_t, seed) = 0;
  /// a of the averaging weights (a + t)^2; 0 means max(1, d / k).
  TORCH_ARG(double, average_shift) = 0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Throws comm::Error naming the first option out of range: lr > 0, weight_decay >= 0,
/// 0 < ratio <= 1 unless count > 0, average_shift >= 0.
void validate(const SparsifiedSgdOptions& options);

/// The state of one parameter: its memory (what was not applied yet) and its estimated weights.
struct SparsifiedSgdParamState
    : public torch::optim::OptimizerCloneableParamState<SparsifiedSgdParamState> {
  TORCH_ARG(torch::Tensor, memory);
  TORCH_ARG(torch::Tensor, estimated_weights);
};

/// Sparsified SGD with memory on one process (the update is applied locally).
class SparsifiedSGD : public torch::optim::Optimizer {
 public:
  /// Throws comm::Error for an option out of range or a parameter that is not a contiguous float32
  /// CPU tensor.
  SparsifiedSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                SparsifiedSgdOptions defaults);
  SparsifiedSGD(std::vector<torch::Tensor> params, SparsifiedSgdOptions defaults);

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Throws comm::Error when the archive holds another number of parameters or other shapes.
  void load(torch::serialize::InputArchive& archive) override;

  /// The averaged iterate, one copy per parameter (same shapes, parameter order); before the first
  /// step, copies of the parameters.
  std::vector<torch::Tensor> estimated_weights() const;
  /// Each parameter's memory (copies).
  std::vector<torch::Tensor> memory() const;
  /// The shift a of the averaging weights (a + t)^2.
  double average_shift() const { return shift_; }
  /// Coordinates applied per step, summed over the parameters (k of the whole model).
  size_t kept_per_step() const { return kept_; }
  /// Steps taken so far.
  uint64_t steps() const { return steps_; }

 protected:
  /// One parameter's compressed update c: values at indices (uint32), k of them.
  struct Sparse {
    torch::Tensor param;
    std::vector<uint32_t> indices;
    std::vector<float> values;
  };
  /// Applies this step's compressed updates (in parameter order) to the parameters.
  virtual void apply(std::vector<Sparse>& updates);
  /// The parameters of every group, in order.
  std::vector<torch::Tensor> all_params() const;
  /// Sets the estimated weights to the parameters (after they were replaced).
  void reset_estimated_weights();

 private:
  SparsifiedSgdParamState& state_of(const torch::Tensor& p);
  void compress(std::vector<Sparse>& updates);
  void update_average();

  uint64_t steps_ = 0;
  size_t kept_ = 0;
  double shift_ = 1;
  double weight_sum_ = 0;
};

/// Sparsified SGD with memory over all ranks (mlbench-core's centralised SparsifiedSGD): every
/// rank compresses its own update c_r as above (memory stays local), the (indices, values) records
/// are allgathered in step(), and every rank applies p -= (1/W) sum_r c_r, in rank order, so that
/// all ranks keep identical parameters.
///
/// Use it WITHOUT a DistributedModule: it does its own communication, with local gradients.
/// ```cpp
/// using troupe::optim::SparsifiedSgdOptions;
/// troupe::optim::CentralizedSparsifiedSGD opt(rt, net->parameters(),
///                                            SparsifiedSgdOptions(0.1).ratio(0.01));
/// opt.zero_grad();
/// loss.backward();
/// opt.step();   // compress, allgather, apply: a blocking collective on every rank
/// ```
/// The constructor is a collective too: it checks that every rank has the same parameter count,
/// elements and k (naming the first rank that differs), and broadcasts rank 0's parameters.
class CentralizedSparsifiedSGD : public SparsifiedSGD {
 public:
  CentralizedSparsifiedSGD(Runtime& runtime,
                           std::vector<torch::optim::OptimizerParamGroup> param_groups,
                           SparsifiedSgdOptions defaults);
  CentralizedSparsifiedSGD(Runtime& runtime, std::vector<torch::Tensor> params,
                           SparsifiedSgdOptions defaults);

 protected:
  void apply(std::vector<Sparse>& updates) override;

 private:
  Runtime& runtime_;
  std::vector<uint32_t> record_, all_;
};

}  // namespace troupe::optim
