// The NCCL path: a CUDA bucket is reduced by one NCCL allreduce on the device.
//
// It serves GradientAllReduce over CUDA parameters when the Runtime has an NCCL unique id from
// rank 0 and a GPU for each rank of a host (Runtime::nccl_available(), the same answer on every
// rank of alike hosts; ranks that share a GPU take host staging) and
// DdpOptions::stage_through_host is off. At connect (a collective, after the model check, which
// compares the path) the module takes its own communicator, split from the Runtime's, so that two
// modules' buckets never interleave differently on different ranks. NCCL matches operations by
// the order ranks issue them, and buckets fill in different orders on different ranks, so the
// buckets are issued in bucket order (NcclOrder): a bucket that fills early waits for the
// ones before it. Each allreduce runs on the communicator's stream after the events recorded
// where the bucket's gradients became ready (ddp/cuda_gradients.h); the communicator's
// completion callback ends the reduction. An average by the world size is NCCL's avg, any other
// denominator its pre-multiplied sum. A dead rank aborts the communicator, which fails what is in
// flight at once, and lets the buckets still waiting for their turn through to fail.
#include "ddp/cuda_gradients.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"
#include "ddp/gradient_path/nccl_order.h"

#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/communicator.h"
#endif

namespace troupe {

namespace {

#ifdef TROUPE_HAVE_NCCL

class NcclBucket : public actors::BucketPath {
 public:
  // Weak: the path owns the communicator and destroys it before the module's CUDA events.
  NcclBucket(std::weak_ptr<comm::NcclCommunicator> nccl, std::shared_ptr<NcclOrder> order,
             const comm::BucketBuffer& buffer, std::vector<void*> ready_events, int world,
             bool divide_before)
      : nccl_(std::move(nccl)),
        order_(std::move(order)),
        index_(buffer.index),
        data_(buffer.data),
        count_(buffer.count),
        type_(buffer.type),
        ready_events_(std::move(ready_events)),
        world_(world),
        divide_before_(divide_before) {}

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    (void)self;
    (void)step;
    const size_t bytes = count_ * comm::element_size(type_);
    // A ring's share; NCCL does not report what it moved.
    const size_t moved = world_ > 1 ? bytes * 2 * static_cast<size_t>(world_ - 1) / world_ : 0;
    comm::Callback finished = [done = std::move(done), moved](const comm::Status& status) {
      done(status, moved, moved);
    };
    order_->submit(index_, [nccl = nccl_, data = data_, count = count_, type = type_,
                            events = ready_events_, denominator, index = index_, world = world_,
                            before = divide_before_, finished]() {
      auto communicator = nccl.lock();
      try {
        if (!communicator)
          throw comm::Error("bucket " + std::to_string(index) +
                            ": its module's NCCL communicator is gone");
        if (denominator == 1.0)
          communicator->allreduce(data, data, count, type, comm::ReduceOp::sum, events, finished);
        else if (denominator == world && !before)
          communicator->allreduce(data, data, count, type, comm::ReduceOp::avg, events, finished);
        else
          communicator->allreduce_scaled(data, data, count, type, 1.0 / denominator, events,
                                         finished);
      } catch (const std::exception& e) {
        finished(comm::Status::failure(e.what()));
      }
    });
  }

  void abort(const actors::ActorThread& self, const comm::Status& why) override {
    (void)self;
    if (auto nccl = nccl_.lock()) nccl->abort(why.message());
    order_->release();
  }

  std::vector<int> waiting_on() override { return {}; }  // NCCL does not say

 private:
  std::weak_ptr<comm::NcclCommunicator> nccl_;
  std::shared_ptr<NcclOrder> order_;
  int index_;
  void* data_;  // device memory
  size_t count_;
  comm::DataType type_;
  std::vector<void*> ready_events_;
  int world_;
  bool divide_before_;
};

#endif

class NcclPath : public GradientPath {
 public:
  std::string name() const override { return "cuda via nccl"; }

  std::string can_serve(const GradientPathContext& context) const override {
    if (!context.cuda) return "the parameters are on the CPU";
#ifndef TROUPE_HAVE_NCCL
    return "troupe was built without NCCL";
#else
    if (!std::holds_alternative<GradientAllReduce>(*context.algorithm))
      return comm::algorithm_name(*context.algorithm) +
             " is not GradientAllReduce (the only "
             "algorithm it runs)";
    if (context.options->stage_through_host) return "DdpOptions::stage_through_host is on";
    if (!context.runtime->nccl_available())
      return "the Runtime has no NCCL (rank 0 published no unique id: RuntimeOptions::nccl off, "
             "no GPU on rank 0, or its libnccl refused; or this host's ranks outnumber its GPUs, "
             "which NCCL cannot share)";
    return "";
#endif
  }

  void connect(const GradientPathContext& context) override {
#ifdef TROUPE_HAVE_NCCL
    world_ = context.runtime->world_size();
    divide_before_ = context.options->divide_before && context.options->agg_grad;
    nccl_ = context.runtime->nccl(context.cuda->device())->split(*context.options->stall_timeout);
#else
    (void)context;
#endif
  }

  void begin_buckets(int count) override { order_ = std::make_shared<NcclOrder>(count); }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
#ifdef TROUPE_HAVE_NCCL
    if (!nccl_)
      throw comm::Error("DistributedModule: bucket " + std::to_string(buffer.index) +
                        " on the NCCL path before the module's communicator exists");
    return std::make_shared<NcclBucket>(nccl_, order_, buffer, std::move(ready_events), world_,
                                        divide_before_);
#else
    (void)buffer;
    (void)ready_events;
    throw comm::Error("DistributedModule: an NCCL bucket in a troupe built without NCCL");
#endif
  }

 private:
  std::shared_ptr<comm::NcclCommunicator> nccl_;
  std::shared_ptr<NcclOrder> order_;
  // Read only where NCCL is built in (clang warns of unused private fields otherwise).
  [[maybe_unused]] int world_ = 1;
  [[maybe_unused]] bool divide_before_ = false;
};

}  // namespace

std::unique_ptr<GradientPath> make_nccl_path() { return std::make_unique<NcclPath>(); }

}  // namespace troupe
