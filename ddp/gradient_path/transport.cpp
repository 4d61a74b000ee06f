// The transport path: a CPU bucket runs its algorithm over the job's transport.
//
// The algorithm (comm/compression/algorithms.h) makes one comm::Reduction per bucket, which keeps
// the bucket's state across steps (error-feedback memory, PowerSGD's Q) and gives each step's
// stages: local work (compress, decompress) and the collective that follows it. The bucket runs
// them with one comm::Execution over its flat buffer while backward goes on. Over UCX, whose
// callbacks all run on its one progress thread, the execution's steps run right in those
// callbacks, under a lock; over inproc the completions come back to the bucket actor as run
// messages and it drives the steps. Keys are comm::tags::bucket_key (module, step, stage,
// bucket: comm/tags.h), so buckets may start in any order on different ranks and a compressed
// reduction's stages never meet each other's messages. With DdpOptions::hierarchical and several
// hosts, GradientAllReduce reduces by host (comm/collectives/hierarchical.cpp).
//
// A gradient that autograd allocated (set to none before backward) is handed to the bucket's
// reduction where it lies when the reduction can read it there (comm::Reduction::take_input:
// PowerSGD), and kept until that reduction ends; else it is copied into the bucket.
//
// It serves any CPU module; host staging (host_staging.cpp) also runs it on the pinned mirrors of
// CUDA buckets. When a rank dies, what is in flight with live peers gets a grace of a second,
// then the peers it still waits for are failed.
#include <algorithm>
#include <utility>
#include <vector>

#include "actors/execution_post.h"
#include "comm/reduce.h"
#include "comm/tags.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"

namespace troupe {

namespace {

struct TransportSettings {
  std::shared_ptr<comm::Transport> transport;
  comm::CollectiveOptions collectives;
  uint32_t key_prefix = 0;
  bool divide_before = false;
  std::chrono::milliseconds failure_grace{1000};
};

class TransportBucket : public actors::BucketPath,
                        public std::enable_shared_from_this<TransportBucket> {
 public:
  TransportBucket(std::shared_ptr<const TransportSettings> settings,
                  const comm::BucketBuffer& buffer, std::shared_ptr<comm::Reduction> reduction)
      : settings_(std::move(settings)),
        index_(buffer.index),
        tensors_(buffer.tensors),
        reduction_(std::move(reduction)) {
    for (size_t i = 0; i < tensors_.size(); ++i) by_offset_.emplace_back(tensors_[i].offset, i);
    std::sort(by_offset_.begin(), by_offset_.end());
  }

  // On the trainer's thread, before the bucket hears that the gradient is ready (its message
  // orders this before reduce()).
  Adoption adopt(int64_t offset, const torch::Tensor& grad, const torch::Tensor& view) {
    const auto at = static_cast<size_t>(offset);
    const auto it =
        std::lower_bound(by_offset_.begin(), by_offset_.end(), std::make_pair(at, size_t{0}));
    if (it != by_offset_.end() && it->first == at) {
      const size_t i = it->second;
      if (tensors_[i].count == static_cast<size_t>(grad.numel()) &&
          reduction_->take_input(i, grad.data_ptr())) {
        inputs_.push_back(grad);
        return Adoption::read_in_place;
      }
    }
    comm::stream_copy(view.data_ptr(), grad.data_ptr(), grad.nbytes());
    return Adoption::copied;
  }

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    const auto& transport = settings_->transport;
    comm::ReduceStep reduce_step;
    reduce_step.group = comm::Group{transport->rank(), transport->world_size()};
    reduce_step.step = step;
    reduce_step.scale = 1.0 / denominator;
    reduce_step.divide_before = settings_->divide_before;
    reduce_step.collectives = settings_->collectives;
    auto builders = reduction_->stages(reduce_step);
    // The gradients the stages read where they lie live until the execution ends.
    auto inputs = std::make_shared<std::vector<torch::Tensor>>(std::move(inputs_));
    inputs_.clear();
    std::vector<comm::Stage> stages;
    for (size_t i = 0; i < builders.size(); ++i)
      stages.push_back(comm::Stage{
          comm::tags::bucket_key(settings_->key_prefix, step, static_cast<int>(i), index_),
          std::move(builders[i])});
    auto post = self.execution_post(*transport, inline_lock_);
    auto execution = std::make_shared<comm::Execution>(transport, std::move(stages), post);
    // Runs on whichever thread ends the execution: touches only what it captured.
    execution->on_done(
        [done = std::move(done), raw = execution.get(), inputs](const comm::Status& status) {
          inputs->clear();
          done(status, raw->bytes_sent(), raw->bytes_received());
        });
    execution_ = execution;
    locked([&] { execution->start(); });
  }

  void abort(const actors::ActorThread& self, const comm::Status& why) override {
    if (!execution_) return;
    bool running = false;
    locked([&] {
      running = !execution_->done();
      if (running) execution_->abort(why);
    });
    if (!running) return;
    self.post_after(settings_->failure_grace, [weak = weak_from_this(), reason = why.message()] {
      if (auto me = weak.lock()) me->fail_silent_peers(reason);
    });
  }

  comm::Reduction* reduction() override { return reduction_.get(); }

  std::vector<int> waiting_on() override {
    std::vector<int> waiting;
    if (execution_)
      locked([&] {
        if (!execution_->done()) waiting = execution_->waiting_on();
      });
    return waiting;
  }

 private:
  // The grace after a failure has passed: the peers still waited for are failed.
  void fail_silent_peers(const std::string& reason) {
    for (int p : waiting_on()) settings_->transport->fail_peer(p, reason);
  }

  // Runs fn with the execution's lock held when it runs inline on the transport's thread.
  template <class F>
  void locked(F&& fn) {
    if (inline_lock_) {
      std::lock_guard<std::mutex> guard(*inline_lock_);
      fn();
    } else {
      fn();
    }
  }

  std::shared_ptr<const TransportSettings> settings_;
  int index_;
  std::vector<comm::TensorSlot> tensors_;
  std::vector<std::pair<size_t, size_t>> by_offset_;  // (offset, index in tensors_), sorted
  std::shared_ptr<comm::Reduction> reduction_;
  std::vector<torch::Tensor> inputs_;  // given to the reduction by adopt() for the next reduce()
  std::shared_ptr<comm::Execution> execution_;
  std::shared_ptr<std::mutex> inline_lock_;
};

class TransportPath : public GradientPath {
 public:
  std::string name() const override { return "cpu"; }

  std::string can_serve(const GradientPathContext& context) const override {
    if (context.cuda)
      return "the parameters are on CUDA (the transport moves host memory; host staging "
             "brings CUDA buckets to it)";
    return "";
  }

  void connect(const GradientPathContext& context) override {
    auto& rt = *context.runtime;
    const auto& opt = *context.options;
    algorithm_ = context.algorithm;
    make_reduction_ = context.make_reduction;
    settings_->transport = rt.transport();
    settings_->collectives = rt.comm().options();
    if (opt.hierarchical) {
      // By host only where that changes anything: several hosts, and some with several ranks.
      auto hosts = rt.real_hosts();
      const int distinct = *std::max_element(hosts.begin(), hosts.end()) + 1;
      if (distinct > 1 && distinct < rt.world_size())
        settings_->collectives.hosts = std::move(hosts);
    }
    settings_->key_prefix = context.key_prefix;
    settings_->divide_before = opt.divide_before && opt.agg_grad;
  }

  void begin_buckets(int count) override { buckets_.assign(static_cast<size_t>(count), nullptr); }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
    (void)ready_events;  // host memory: nothing to wait for on a device
    // Shared: a bucket actor may still be running a message when its module destroys the path.
    auto made = std::make_shared<TransportBucket>(
        settings_, buffer,
        make_reduction_ ? make_reduction_(buffer) : comm::make_reduction(*algorithm_, buffer));
    if (static_cast<size_t>(buffer.index) < buckets_.size())
      buckets_[static_cast<size_t>(buffer.index)] = made;
    return made;
  }

  Adoption adopt(int bucket, int64_t offset, const torch::Tensor& grad,
                 const torch::Tensor& view) override {
    const auto b = static_cast<size_t>(bucket);
    if (b < buckets_.size() && buckets_[b]) return buckets_[b]->adopt(offset, grad, view);
    return GradientPath::adopt(bucket, offset, grad, view);
  }

 private:
  std::vector<std::shared_ptr<TransportBucket>> buckets_;  // the current buckets, by index
  const comm::Compression* algorithm_ = nullptr;
  std::function<std::shared_ptr<comm::Reduction>(const comm::BucketBuffer&)> make_reduction_;
  std::shared_ptr<TransportSettings> settings_ = std::make_shared<TransportSettings>();
};

}  // namespace

std::unique_ptr<GradientPath> make_transport_path() { return std::make_unique<TransportPath>(); }

}  // namespace troupe
