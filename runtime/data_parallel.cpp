#include "runtime/data_parallel.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "runtime/gossip/decentralized.h"
#include "runtime/local_update/diloco.h"
#include "runtime/local_update/sparseloco.h"
#include "runtime/local_update/streaming_diloco.h"
#include "runtime/model_check.h"

namespace troupe {

namespace {

/// A DistributedModule as a DataParallel.
class BucketParallel : public DataParallel {
 public:
  BucketParallel(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                 comm::Compression algorithm, DdpOptions options)
      : ddp_(runtime, std::move(module), std::move(algorithm), std::move(options)) {}

  void step(torch::optim::Optimizer& optimizer) override {
    ddp_.step(optimizer);
    const auto& s = ddp_.last_step();
    ++totals_.steps;
    totals_.bytes_sent += s.bytes_sent;
    totals_.last_step_bytes_sent = s.bytes_sent;
    totals_.bytes_received += s.bytes_received;
    totals_.comm_wait_sec += s.comm_wait_sec;
  }
  std::string algorithm_name() const override { return ddp_.algorithm_name(); }
  CommStats stats() const override { return totals_; }
  void save_state(comm::StateWriter& out) const override {
    ddp_.save_state(out);
    out.value(totals_.steps);
  }
  void load_state(comm::StateReader& in) override {
    ddp_.load_state(in);
    totals_.steps = in.value<uint64_t>();
  }

 private:
  DistributedModule ddp_;
  CommStats totals_;
};

}  // namespace

void DataParallel::save_state(comm::StateWriter&) const {
  throw comm::Error(algorithm_name() + ": this algorithm cannot save its state (no checkpoint)");
}

void DataParallel::load_state(comm::StateReader&) {
  throw comm::Error(algorithm_name() + ": this algorithm cannot load a state (no checkpoint)");
}

std::unique_ptr<DataParallel> make_data_parallel(Runtime& runtime,
                                                 std::shared_ptr<torch::nn::Module> module,
                                                 const JobAlgorithm& algorithm,
                                                 DdpOptions options) {
  return std::visit(
      [&](const auto& a) -> std::unique_ptr<DataParallel> {
        using A = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<A, comm::Compression>) {
          return std::make_unique<BucketParallel>(runtime, std::move(module), a,
                                                  std::move(options));
        } else if constexpr (std::is_same_v<A, Decentralized> ||
                             std::is_same_v<A, LowPrecisionDecentralized>) {
          return std::make_unique<DecentralizedModule>(runtime, std::move(module), a);
        } else if constexpr (std::is_same_v<A, DiLoCo>) {
          return std::make_unique<DiLoCoModule>(runtime, std::move(module), a);
        } else if constexpr (std::is_same_v<A, SparseLoCo>) {
          return std::make_unique<SparseLoCoModule>(runtime, std::move(module), a);
        } else if constexpr (std::is_same_v<A, StreamingDiLoCo>) {
          return std::make_unique<StreamingDiLoCoModule>(runtime, std::move(module), a);
        } else {
          return std::make_unique<AsynchronousModule>(runtime, std::move(module), a);
        }
      },
      algorithm);
}

void average_module(Runtime& runtime, torch::nn::Module& module) {
  if (runtime.world_size() == 1) return;
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_type;
  for (auto& p : module.parameters())
    if (p.is_floating_point()) by_type[p.scalar_type()].push_back(p);
  for (auto& b : module.buffers())
    if (b.is_floating_point()) by_type[b.scalar_type()].push_back(b);
  for (auto& [type, tensors] : by_type) {
    std::vector<torch::Tensor> flat;
    for (auto& t : tensors) flat.push_back(t.reshape({-1}));
    auto all = torch::cat(flat).to(torch::kCPU);  // the transport moves host memory
    runtime.comm().allreduce(all.data_ptr(), static_cast<size_t>(all.numel()),
                             comm_type(type, "a parameter or buffer"), comm::ReduceOp::avg);
    int64_t at = 0;
    for (auto& t : tensors) {
      t.copy_(all.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
  }
}

double consensus_distance(Runtime& runtime, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  for (auto& p : module.parameters())
    if (p.is_floating_point())  // on the host: the transport moves host memory
      flat.push_back(p.detach().to(torch::kCPU, torch::kFloat64).reshape({-1}));
  if (flat.empty()) return 0;
  auto x = torch::cat(flat).contiguous();
  auto mean = x.clone();
  auto& comm = runtime.comm();
  comm.allreduce(mean.data_ptr<double>(), static_cast<size_t>(mean.numel()),
                 comm::DataType::float64, comm::ReduceOp::avg);
  double distance = (x - mean).norm().item<double>();
  comm.allreduce(&distance, 1, comm::DataType::float64, comm::ReduceOp::avg);
  return distance;
}

}  // namespace troupe
