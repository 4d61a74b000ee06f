#include "algorithms/registry.h"

#include <type_traits>
#include <variant>

#include "algorithms/gossip/decentralized.h"
#include "algorithms/local_update/diloco.h"
#include "algorithms/local_update/sparseloco.h"
#include "algorithms/local_update/streaming_diloco.h"

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

std::unique_ptr<DataParallel> make_data_parallel(Runtime& runtime, ModelRef model,
                                                 const JobAlgorithm& algorithm,
                                                 DdpOptions options) {
  auto module = model.get("make_data_parallel");
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

}  // namespace troupe
