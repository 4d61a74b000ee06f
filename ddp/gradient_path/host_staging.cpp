// The host-staging path: a CUDA bucket is reduced in pinned host memory by another path (the
// transport's), for jobs without NCCL (UCX or inproc), algorithms NCCL does not run (the
// compressed ones) and DdpOptions::stage_through_host.
//
// Each bucket has a mirror in pinned host memory (ddp/staging.h). When the bucket is full, its
// gradients are copied there on a copy stream that first waits on the events recorded where each
// gradient became ready (ddp/cuda_gradients.h; no synchronisation of torch's stream); when the
// copy has completed, the wrapped path reduces the mirror as it would a CPU bucket; then the
// result is copied back to the device, and only when that copy has completed does the reduction
// end, so step() finds the reduced gradients on the device. A module's mirrors share a
// StagingContext (a stream each way and an event watcher thread): copies complete through the
// watcher, never by blocking an actor.
#include "ddp/cuda_gradients.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"

#ifdef TROUPE_HAVE_CUDA
#include "actors/execution_post.h"
#include "ddp/staging.h"
#endif

namespace troupe {

namespace {

#ifdef TROUPE_HAVE_CUDA

class StagedBucket : public actors::BucketPath, public std::enable_shared_from_this<StagedBucket> {
 public:
  StagedBucket(int index, std::shared_ptr<actors::HostStaging> mirror,
               std::shared_ptr<actors::BucketPath> inner, std::vector<void*> ready_events,
               std::chrono::milliseconds timeout)
      : index_(index),
        mirror_(std::move(mirror)),
        inner_(std::move(inner)),
        ready_events_(std::move(ready_events)),
        timeout_(timeout) {}

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    // The copy completes on the watcher's thread; the wrapped path starts on the actor's.
    mirror_->download(
        ready_events_, timeout_,
        [self, weak = weak_from_this(), step, denominator, done](const std::string& error) {
          self.post([self, weak, step, denominator, done, error] {
            if (auto me = weak.lock()) me->reduce_mirror(self, step, denominator, done, error);
          });
        });
  }

  void abort(const actors::ActorThread& self, const comm::Status& why) override {
    broken_ = why;
    inner_->abort(self, why);
  }

  std::vector<int> waiting_on() override { return inner_->waiting_on(); }

  comm::Reduction* reduction() override { return inner_->reduction(); }

 private:
  // The gradients are in the mirror (or `error` says why not): reduce it, then copy it back.
  void reduce_mirror(const actors::ActorThread& self, uint32_t step, double denominator,
                     const Done& done, const std::string& error) {
    if (!error.empty()) return done(comm::Status::failure(error), 0, 0);
    if (!broken_.ok()) return done(broken_, 0, 0);
    Done upload = [index = index_, mirror = mirror_, timeout = timeout_, done](
                      const comm::Status& status, size_t sent, size_t received) {
      if (!status.ok()) return done(status, sent, received);
      try {
        mirror->upload(timeout, [done, sent, received](const std::string& error) {
          done(error.empty() ? comm::Status::success() : comm::Status::failure(error), sent,
               received);
        });
      } catch (const std::exception& e) {
        done(comm::Status::failure("bucket " + std::to_string(index) + ": " + e.what()), sent,
             received);
      }
    };
    try {
      inner_->reduce(self, step, denominator, upload);
    } catch (const std::exception& e) {
      done(comm::Status::failure("bucket " + std::to_string(index_) + ": " + e.what()), 0, 0);
    }
  }

  int index_;
  std::shared_ptr<actors::HostStaging> mirror_;
  std::shared_ptr<actors::BucketPath> inner_;
  std::vector<void*> ready_events_;
  std::chrono::milliseconds timeout_;
  comm::Status broken_;  // a rank died: set by abort()
};

#endif

class HostStagingPath : public GradientPath {
 public:
  explicit HostStagingPath(std::unique_ptr<GradientPath> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return "cuda via host staging"; }

  std::string can_serve(const GradientPathContext& context) const override {
    if (!context.cuda) return "the parameters are on the CPU";
#ifndef TROUPE_HAVE_CUDA
    return "troupe was built without CUDA";
#else
    return "";
#endif
  }

  void connect(const GradientPathContext& context) override {
    timeout_ = *context.options->stall_timeout;
    device_ = context.cuda->device();
    inner_->connect(context);
  }

  void begin_buckets(int count) override { inner_->begin_buckets(count); }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
#ifdef TROUPE_HAVE_CUDA
    if (!context_) context_ = std::make_shared<actors::StagingContext>(device_);
    const size_t bytes = buffer.count * comm::element_size(buffer.type);
    auto mirror = std::make_shared<actors::HostStaging>(context_, buffer.data, bytes,
                                                        "bucket " + std::to_string(buffer.index));
    comm::BucketBuffer host = buffer;
    host.data = mirror->host();
    return std::make_shared<StagedBucket>(buffer.index, mirror, inner_->bucket(host, {}),
                                          std::move(ready_events), timeout_);
#else
    (void)buffer;
    (void)ready_events;
    throw comm::Error("DistributedModule: a staged CUDA bucket in a troupe built without CUDA");
#endif
  }

 private:
  std::unique_ptr<GradientPath> inner_;
  std::chrono::milliseconds timeout_{60000};
  int device_ = -1;
#ifdef TROUPE_HAVE_CUDA
  std::shared_ptr<actors::StagingContext> context_;
#endif
};

}  // namespace

std::unique_ptr<GradientPath> make_host_staging_path(std::unique_ptr<GradientPath> inner) {
  return std::make_unique<HostStagingPath>(std::move(inner));
}

}  // namespace troupe
