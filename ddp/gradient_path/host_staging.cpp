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
//
// fp16 and bf16 (HalfPrecision) have a staging path of their own that casts on the device: the
// bucket, times the step's 1 / denominator, is encoded on the copy stream into a half-precision
// image beside it in device memory (cuda/codecs.h, byte for byte comm/codecs/half.h's encoding),
// and only that image is staged; the transport path sums it on the host as a float16 (bfloat16)
// allreduce, the schedule of comm's HalfPrecision reduction; the sum is copied back and decoded
// into the bucket on the device. Half the bytes of staging the float32 bucket cross the bus each
// way, and the casts run on the GPU, not the CPU.
#include <optional>
#include <variant>

#include "ddp/cuda_gradients.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"

#ifdef TROUPE_HAVE_CUDA
#include "actors/execution_post.h"
#include "cuda/codecs.h"
#include "ddp/staging.h"
#endif

namespace troupe {

namespace {

#ifdef TROUPE_HAVE_CUDA

// A cast of a float32 bucket to half precision and back on the device, around its staging.
struct DeviceCast {
  bool bfloat16 = false;
  float* bucket = nullptr;    // the float32 bucket (device memory)
  uint16_t* image = nullptr;  // its half-precision image (device memory), which is staged
  size_t count = 0;

  void encode(float scale, void* stream) const {
    if (bfloat16)
      cuda::encode_bfloat16(bucket, count, scale, image, stream);
    else
      cuda::encode_half(bucket, count, scale, image, stream);
  }
  void decode(void* stream) const {
    if (bfloat16)
      cuda::decode_bfloat16(image, count, 1.0f, bucket, stream);
    else
      cuda::decode_half(image, count, 1.0f, bucket, stream);
  }
};

class StagedBucket : public actors::BucketPath, public std::enable_shared_from_this<StagedBucket> {
 public:
  // With `cast`, the mirror stages cast->image, and the step's scale is applied by the encoding
  // (before the cast, against overflow, as comm's HalfPrecision does): the wrapped path sums.
  StagedBucket(int index, std::shared_ptr<actors::HostStaging> mirror,
               std::shared_ptr<actors::BucketPath> inner, std::vector<void*> ready_events,
               std::chrono::milliseconds timeout, std::optional<DeviceCast> cast = std::nullopt)
      : index_(index),
        mirror_(std::move(mirror)),
        inner_(std::move(inner)),
        ready_events_(std::move(ready_events)),
        timeout_(timeout),
        cast_(cast) {}

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    actors::HostStaging::OnStream encode;
    if (cast_) {
      encode = [cast = *cast_, scale = static_cast<float>(1.0 / denominator)](void* stream) {
        cast.encode(scale, stream);
      };
      denominator = 1.0;
    }
    // The copy completes on the watcher's thread; the wrapped path starts on the actor's.
    mirror_->download(
        ready_events_, timeout_,
        [self, weak = weak_from_this(), step, denominator, done](const std::string& error) {
          self.post([self, weak, step, denominator, done, error] {
            if (auto me = weak.lock()) me->reduce_mirror(self, step, denominator, done, error);
          });
        },
        encode);
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
    actors::HostStaging::OnStream decode;
    if (cast_) decode = [cast = *cast_](void* stream) { cast.decode(stream); };
    Done upload = [index = index_, mirror = mirror_, timeout = timeout_, decode, done](
                      const comm::Status& status, size_t sent, size_t received) {
      if (!status.ok()) return done(status, sent, received);
      try {
        mirror->upload(
            timeout,
            [done, sent, received](const std::string& error) {
              done(error.empty() ? comm::Status::success() : comm::Status::failure(error), sent,
                   received);
            },
            decode);
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
  std::optional<DeviceCast> cast_;
  comm::Status broken_;  // a rank died: set by abort()
};

#endif

// The element where a bucket's half-precision image starts in its device allocation (after the
// float32 bucket, on a 256-byte boundary).
int64_t image_at(int64_t elements) { return (elements + 63) / 64 * 64; }

class HostStagingPath : public GradientPath {
 public:
  // `cast_on_device`: the path for HalfPrecision that casts on the device (see the top).
  HostStagingPath(std::unique_ptr<GradientPath> inner, bool cast_on_device)
      : inner_(std::move(inner)), cast_on_device_(cast_on_device) {}

  std::string name() const override {
    return cast_on_device_ ? "cuda via host staging, half precision cast on the device"
                           : "cuda via host staging";
  }

  std::string can_serve(const GradientPathContext& context) const override {
    if (!context.cuda) return "the parameters are on the CPU";
#ifndef TROUPE_HAVE_CUDA
    return "troupe was built without CUDA";
#else
    if (!cast_on_device_) return "";
    if (!std::holds_alternative<comm::HalfPrecision>(*context.algorithm))
      return "the algorithm is not fp16 or bf16";
    for (const auto& p : *context.params)
      if (p.scalar_type() != torch::kFloat)
        return "a parameter is " + std::string(c10::toString(p.scalar_type())) + ", not float32";
    return "";
#endif
  }

  void connect(const GradientPathContext& context) override {
    timeout_ = *context.options->stall_timeout;
    device_ = context.cuda->device();
    if (!cast_on_device_) return inner_->connect(context);
    // The staged images are summed as they are: a plain allreduce of float16 (bfloat16) over
    // every rank at once, as comm's HalfPrecision reduction runs it (never by host).
    cast_ = std::get<comm::HalfPrecision>(*context.algorithm);
    inner_options_ = *context.options;
    inner_options_.hierarchical = false;
    GradientPathContext inner = context;
    inner.algorithm = &sum_;
    inner.options = &inner_options_;
    inner_->connect(inner);
  }

  void begin_buckets(int count) override {
    allocations_.assign(static_cast<size_t>(count), torch::Tensor());
    inner_->begin_buckets(count);
  }

  // With the cast: the bucket's float32 elements, then its half-precision image, in one
  // allocation (the bucket is a view of its start, which keeps the whole alive).
  torch::Tensor bucket_memory(int index, int64_t elements,
                              const torch::TensorOptions& options) override {
    if (!cast_on_device_) return GradientPath::bucket_memory(index, elements, options);
    auto all = torch::zeros({image_at(elements) + (elements + 1) / 2}, options);
    if (static_cast<size_t>(index) < allocations_.size())
      allocations_[static_cast<size_t>(index)] = all;
    return all.narrow(0, 0, elements);
  }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
#ifdef TROUPE_HAVE_CUDA
    if (!context_) context_ = std::make_shared<actors::StagingContext>(device_);
    const std::string what = "bucket " + std::to_string(buffer.index);
    comm::BucketBuffer host = buffer;
    std::optional<DeviceCast> cast;
    void* staged = buffer.data;
    size_t bytes = buffer.count * comm::element_size(buffer.type);
    if (cast_on_device_) {
      const auto b = static_cast<size_t>(buffer.index);
      if (b >= allocations_.size() || !allocations_[b].defined() ||
          allocations_[b].data_ptr() != buffer.data)
        throw comm::Error("DistributedModule: " + what +
                          " is not the memory its gradient path allocated for it");
      auto* bucket = static_cast<float*>(buffer.data);
      cast = DeviceCast{
          cast_.bfloat16, bucket,
          reinterpret_cast<uint16_t*>(bucket + image_at(static_cast<int64_t>(buffer.count))),
          buffer.count};
      staged = cast->image;
      bytes = buffer.count * sizeof(uint16_t);
      host.type = cast_.bfloat16 ? comm::DataType::bfloat16 : comm::DataType::float16;
    }
    auto mirror = std::make_shared<actors::HostStaging>(context_, staged, bytes, what);
    host.data = mirror->host();
    return std::make_shared<StagedBucket>(buffer.index, mirror, inner_->bucket(host, {}),
                                          std::move(ready_events), timeout_, cast);
#else
    (void)buffer;
    (void)ready_events;
    throw comm::Error("DistributedModule: a staged CUDA bucket in a troupe built without CUDA");
#endif
  }

 private:
  std::unique_ptr<GradientPath> inner_;
  bool cast_on_device_;
  std::chrono::milliseconds timeout_{60000};
  int device_ = -1;
  // With the cast: what the wrapped path runs on the images, and each bucket's allocation.
  comm::HalfPrecision cast_;
  comm::Compression sum_ = comm::GradientAllReduce{};
  DdpOptions inner_options_;
  std::vector<torch::Tensor> allocations_;
#ifdef TROUPE_HAVE_CUDA
  std::shared_ptr<actors::StagingContext> context_;
#endif
};

}  // namespace

std::unique_ptr<GradientPath> make_host_staging_path(std::unique_ptr<GradientPath> inner) {
  return std::make_unique<HostStagingPath>(std::move(inner), /*cast_on_device=*/false);
}

std::unique_ptr<GradientPath> make_device_cast_staging_path(std::unique_ptr<GradientPath> inner) {
  return std::make_unique<HostStagingPath>(std::move(inner), /*cast_on_device=*/true);
}

}  // namespace troupe
