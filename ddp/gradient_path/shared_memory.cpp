// The shared-memory path: CPU buckets of a job whose ranks are all on one host are reduced
// straight from and into every rank's memory (comm/shm/local_allreduce.h), without the transport,
// which would also copy every byte into and out of its queues.
//
// It serves GradientAllReduce over CPU parameters when DdpOptions::shared_memory is on (the
// default), there are at least two ranks and every rank is on one real host (Runtime::real_hosts():
// one host name and one kernel and /dev/shm; namespaces that share a name are not fooled). At
// connect (a collective, after the model check, which compares the option) every rank maps a
// comm::LocalAllreduce region; the buckets are laid out in it at the same offsets on every rank.
// The region has two halves and each build of the buckets takes the other one, so the rebuild
// after step 1 copies the gradients across without overlap. A full bucket submits its slot (its
// index); each rank sums its share of the bucket from every rank's memory and writes the result
// into all of them. bytes_sent / bytes_received count the share written into and read from the
// other ranks' memory. A dead rank aborts the LocalAllreduce: everything pending fails at once.
// Each reduction's deadline is the step's (DdpOptions::stall_timeout, by default the Runtime's
// collective timeout): a rank that does not contribute in time fails it, naming the slot, the
// ranks and the timeout.
#include <algorithm>

#include "comm/shm/local_allreduce.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"

namespace troupe {

namespace {

class SharedMemoryBucket : public actors::BucketPath {
 public:
  SharedMemoryBucket(std::shared_ptr<comm::LocalAllreduce> local, const comm::BucketBuffer& buffer,
                     bool divide_before)
      : local_(std::move(local)),
        index_(buffer.index),
        offset_(static_cast<size_t>(static_cast<char*>(buffer.data) - local_->data())),
        count_(buffer.count),
        type_(buffer.type),
        divide_before_(divide_before) {}

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    (void)self;
    (void)step;  // slots count their own generations
    // The same choice as the transport's reductions make from the step's denominator.
    const auto how =
        comm::LocalReduce::scaled(1.0 / denominator, divide_before_, local_->world_size());
    const size_t moved = local_->peer_bytes(count_, type_);
    local_->allreduce(index_, offset_, count_, type_, how,
                      [done = std::move(done), moved](const comm::Status& status) {
                        done(status, moved, moved);  // written into, read from the others' memory
                      });
  }

  void abort(const actors::ActorThread& self, const comm::Status& why) override {
    (void)self;
    local_->abort(why);
  }

  std::vector<int> waiting_on() override { return local_->waiting_on(index_); }

 private:
  std::shared_ptr<comm::LocalAllreduce> local_;
  int index_;
  size_t offset_;  // of the bucket in the shared region: the same on every rank
  size_t count_;
  comm::DataType type_;
  bool divide_before_;
};

class SharedMemoryPath : public GradientPath {
 public:
  std::string name() const override { return "cpu via shared memory"; }

  std::string can_serve(const GradientPathContext& context) const override {
    const auto& opt = *context.options;
    const auto& rt = *context.runtime;
    if (!opt.shared_memory) return "DdpOptions::shared_memory is off";
    if (context.cuda) return "the parameters are on CUDA (shared memory holds CPU buckets)";
    if (!std::holds_alternative<GradientAllReduce>(*context.algorithm))
      return comm::algorithm_name(*context.algorithm) +
             " is not GradientAllReduce (the only "
             "algorithm it runs)";
    if (rt.world_size() < 2) return "one rank";
    // Only when every rank really shares this host and its /dev/shm, not merely its host name.
    const auto& real = rt.real_hosts();
    for (size_t r = 0; r < real.size(); ++r)
      if (real[r] != 0)
        return "rank " + std::to_string(r) + " is not on rank 0's host (host '" + rt.hosts()[r] +
               "', another kernel or /dev/shm than rank 0's '" + rt.hosts()[0] + "')";
    return "";
  }

  void connect(const GradientPathContext& context) override {
    const auto& opt = *context.options;
    divide_before_ = opt.divide_before && opt.agg_grad;
    // Room for any layout: every parameter padded to align_bytes, every bucket to a 64-byte line.
    align_ = std::max<size_t>(opt.align_bytes, 64);
    size_t bytes = 0;
    for (auto& p : *context.params)
      bytes +=
          (static_cast<size_t>(p.numel()) * p.element_size() + 2 * align_ - 1) / align_ * align_;
    half_bytes_ = (bytes + align_ + 4095) / 4096 * 4096;
    try {
      local_ = comm::LocalAllreduce::connect(context.runtime->comm(), 2 * half_bytes_,
                                             *opt.stall_timeout);
    } catch (const comm::Error& e) {  // every rank throws (connect agrees on failures)
      throw comm::Error(
          "DistributedModule: shared memory for the buckets (" + std::to_string(2 * half_bytes_) +
              " bytes per rank): " + e.what() +
              " (enlarge /dev/shm, or set DdpOptions::shared_memory = false to reduce "
              "through the transport)",
          e.peer());
    }
  }

  void begin_buckets(int count) override {
    (void)count;
    cursor_ = static_cast<size_t>(half_) * half_bytes_;
    half_end_ = cursor_ + half_bytes_;
    half_ ^= 1;
  }

  torch::Tensor bucket_memory(int index, int64_t elements,
                              const torch::TensorOptions& options) override {
    cursor_ = (cursor_ + align_ - 1) / align_ * align_;
    const size_t bytes = static_cast<size_t>(elements) * options.dtype().itemsize();
    if (cursor_ + bytes > half_end_)
      throw comm::Error("DistributedModule: bucket " + std::to_string(index) + " (" +
                        std::to_string(bytes) + " bytes at " + std::to_string(cursor_) +
                        ") does not fit the shared region's half ending at " +
                        std::to_string(half_end_));
    auto flat = torch::from_blob(
        local_->data() + cursor_, {elements}, [keep = local_](void*) {}, options);
    flat.zero_();
    cursor_ += bytes;
    return flat;
  }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
    (void)ready_events;
    return std::make_shared<SharedMemoryBucket>(local_, buffer, divide_before_);
  }

 private:
  std::shared_ptr<comm::LocalAllreduce> local_;
  bool divide_before_ = false;
  size_t align_ = 64;
  size_t half_bytes_ = 0;
  int half_ = 0;  // the half the next build of the buckets takes
  size_t cursor_ = 0;
  size_t half_end_ = 0;
};

}  // namespace

std::unique_ptr<GradientPath> make_shared_memory_path() {
  return std::make_unique<SharedMemoryPath>();
}

}  // namespace troupe
