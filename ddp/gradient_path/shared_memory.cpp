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
// other ranks' memory.
//
// A gradient that backward allocated anew (the user set it to none: LibTorch 2.x's zero_grad())
// is not copied into its bucket when it lies in the rank's region: with
// DdpOptions::gradients_in_shared_memory the region's third part is a GradientArena
// (ddp/gradient_arena.h) from which the trainer thread's allocations of a gradient's size come.
// Every bucket's reduction reads each rank's contributions where that rank's table of sources
// says (comm::LocalSources: one entry per parameter of the bucket, its place in the bucket or its
// gradient's in the arena, written before the bucket is submitted), and writes the result over
// them, in place (LocalSources::in_place): a gradient in the arena stays the parameter's gradient
// and holds the average once the reduction ends (Adoption::reduced_in_place; the module reads it
// there), which spares the reducing rank the fetch of the bucket's lines that a store into them
// would cost. The gradient is kept until the reduction has ended. Ranks decide alone: a rank
// whose gradient is elsewhere copies it and points its entry at the bucket. A dead rank aborts the
// LocalAllreduce: everything pending fails at once. Each reduction's deadline is the step's
// (DdpOptions::stall_timeout, by default the Runtime's collective timeout): a rank that does not
// contribute in time fails it, naming the slot, the ranks and the timeout.
#include <algorithm>
#include <thread>

#include "comm/shm/local_allreduce.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_arena.h"
#include "ddp/gradient_path.h"

namespace troupe {

namespace {

class SharedMemoryBucket : public actors::BucketPath {
 public:
  SharedMemoryBucket(std::shared_ptr<comm::LocalAllreduce> local, const comm::BucketBuffer& buffer,
                     size_t table, bool divide_before)
      : local_(std::move(local)),
        index_(buffer.index),
        offset_(static_cast<size_t>(static_cast<char*>(buffer.data) - local_->data())),
        count_(buffer.count),
        type_(buffer.type),
        divide_before_(divide_before) {
    auto sources = std::make_shared<comm::LocalSources>();
    sources->table = table;
    sources->in_place = true;
    std::vector<std::pair<size_t, size_t>> pieces;
    for (const auto& t : buffer.tensors) pieces.emplace_back(t.offset, t.count);
    std::sort(pieces.begin(), pieces.end());
    for (const auto& [first, count] : pieces) {
      sources->first.push_back(first);
      sources->count.push_back(count);
    }
    sources_ = std::move(sources);
    in_arena_.assign(sources_->first.size(), nullptr);
  }

  size_t table_entries() const { return sources_->first.size(); }

  // On the trainer's thread, before the bucket hears that the gradient is ready (its message
  // orders this before reduce()): the gradient at element `offset` of the bucket lies in the
  // arena, and this rank's contribution is read from there and its result written there.
  // False where no parameter of the bucket starts at `offset` (the caller copies it then).
  bool adopt(int64_t offset, const torch::Tensor& grad) {
    const auto& first = sources_->first;
    const auto at = static_cast<size_t>(offset);
    // The piece that starts there with the gradient's length (an empty parameter may start
    // there too).
    auto i = static_cast<size_t>(std::lower_bound(first.begin(), first.end(), at) - first.begin());
    while (i < first.size() && first[i] == at &&
           sources_->count[i] != static_cast<size_t>(grad.numel()))
      ++i;
    if (i == first.size() || first[i] != at) return false;
    in_arena_[i] = static_cast<const char*>(grad.data_ptr());
    inputs_.push_back(grad);
    return true;
  }

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    (void)self;
    (void)step;  // slots count their own generations
    // This rank's table of sources: each gradient's place in the arena, or in the bucket.
    auto* table = reinterpret_cast<uint64_t*>(local_->data() + sources_->table);
    const size_t elem = comm::element_size(type_);
    for (size_t i = 0; i < in_arena_.size(); ++i) {
      table[i] = in_arena_[i] ? static_cast<uint64_t>(in_arena_[i] - local_->data())
                              : offset_ + sources_->first[i] * elem;
      in_arena_[i] = nullptr;
    }
    // The gradients read where they lie live until the reduction ends.
    auto inputs = std::make_shared<std::vector<torch::Tensor>>(std::move(inputs_));
    inputs_.clear();
    // The same choice as the transport's reductions make from the step's denominator.
    const auto how =
        comm::LocalReduce::scaled(1.0 / denominator, divide_before_, local_->world_size());
    const size_t moved = local_->peer_bytes(count_, type_);
    local_->allreduce(
        index_, offset_, count_, type_, how,
        [done = std::move(done), moved, inputs](const comm::Status& status) {
          inputs->clear();
          done(status, moved, moved);  // written into, read from the others' memory
        },
        sources_);
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
  std::shared_ptr<const comm::LocalSources> sources_;  // the bucket's parameters, by offset
  std::vector<const char*> in_arena_;  // per piece: its gradient in the arena, or null
  std::vector<torch::Tensor> inputs_;  // those gradients, until the next reduce()
};

class SharedMemoryPath : public GradientPath {
 public:
  ~SharedMemoryPath() override {
    if (arena_) arena_->close();
  }

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

  // The region: two halves for the buckets (each build of the buckets takes the other one, so
  // the rebuild after step 1 copies the gradients across without overlap), two for the tables of
  // sources (8 bytes per parameter), then the arena.
  void connect(const GradientPathContext& context) override {
    const auto& opt = *context.options;
    divide_before_ = opt.divide_before && opt.agg_grad;
    // Room for any layout: every parameter padded to align_bytes, every bucket to a 64-byte line.
    align_ = std::max<size_t>(opt.align_bytes, 64);
    size_t bytes = 0;
    size_t arena_bytes = 0;
    std::vector<size_t> sizes;
    for (auto& p : *context.params) {
      const size_t n = static_cast<size_t>(p.numel()) * p.element_size();
      bytes += (n + 2 * align_ - 1) / align_ * align_;
      sizes.push_back(n);
      // Room for each gradient twice: the one being reduced and the next one (or a temporary of
      // autograd's of the same size).
      if (n >= GradientArena::kMinBytes) arena_bytes += 2 * ((n + 63) / 64 * 64);
    }
    half_bytes_ = round_page(bytes + align_);
    table_half_bytes_ = round_page(8 * context.params->size() + 64 * context.params->size());
    const bool arena = opt.gradients_in_shared_memory && opt.gradient_as_bucket_view && arena_bytes;
    arena_bytes = arena ? round_page(arena_bytes) : 0;
    const size_t region = 2 * half_bytes_ + 2 * table_half_bytes_ + arena_bytes;
    try {
      local_ = comm::LocalAllreduce::connect(context.runtime->comm(), region, *opt.stall_timeout);
    } catch (const comm::Error& e) {  // every rank throws (connect agrees on failures)
      throw comm::Error(
          "DistributedModule: shared memory for the buckets (" + std::to_string(region) +
              " bytes per rank): " + e.what() +
              " (enlarge /dev/shm, or set DdpOptions::shared_memory = false to reduce "
              "through the transport)",
          e.peer());
    }
    if (arena) {
      arena_ = GradientArena::create(local_->data() + region - arena_bytes, arena_bytes,
                                     local_->region_keeper(), sizes);
      arena_->serve_this_thread();  // the module is made on the trainer's thread, as a rule
      served_thread_ = std::this_thread::get_id();
    }
  }

  void begin_buckets(int count) override {
    cursor_ = static_cast<size_t>(half_) * half_bytes_;
    half_end_ = cursor_ + half_bytes_;
    table_cursor_ = 2 * half_bytes_ + static_cast<size_t>(half_) * table_half_bytes_;
    half_ ^= 1;
    buckets_.assign(static_cast<size_t>(count), nullptr);
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
    auto bucket =
        std::make_shared<SharedMemoryBucket>(local_, buffer, table_cursor_, divide_before_);
    table_cursor_ += (8 * bucket->table_entries() + 63) / 64 * 64;
    const auto b = static_cast<size_t>(buffer.index);
    if (b < buckets_.size()) buckets_[b] = bucket;
    return bucket;
  }

  Adoption adopt(int bucket, int64_t offset, const torch::Tensor& grad,
                 const torch::Tensor& view) override {
    const auto b = static_cast<size_t>(bucket);
    if (arena_) {
      // Backward runs on the trainer's thread: served once it is known (not per gradient).
      if (std::this_thread::get_id() != served_thread_) {
        arena_->serve_this_thread();
        served_thread_ = std::this_thread::get_id();
      }
      if (b < buckets_.size() && buckets_[b] && arena_->holds(grad.data_ptr(), grad.nbytes()) &&
          buckets_[b]->adopt(offset, grad))
        return Adoption::reduced_in_place;
    }
    return GradientPath::adopt(bucket, offset, grad, view);
  }

 private:
  static size_t round_page(size_t n) { return (n + 4095) / 4096 * 4096; }

  std::shared_ptr<comm::LocalAllreduce> local_;
  std::shared_ptr<GradientArena> arena_;  // null without DdpOptions::gradients_in_shared_memory
  std::thread::id served_thread_;         // the thread the arena serves
  bool divide_before_ = false;
  size_t align_ = 64;
  size_t half_bytes_ = 0;
  size_t table_half_bytes_ = 0;
  int half_ = 0;  // the half the next build of the buckets takes
  size_t cursor_ = 0;
  size_t half_end_ = 0;
  size_t table_cursor_ = 0;
  std::vector<std::shared_ptr<SharedMemoryBucket>> buckets_;  // this build's, by index
};

}  // namespace

std::unique_ptr<GradientPath> make_shared_memory_path() {
  return std::make_unique<SharedMemoryPath>();
}

}  // namespace troupe
