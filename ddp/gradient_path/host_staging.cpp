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
// fp16/bf16, sign, 8-bit/4-bit min-max, top-k and PowerSGD have a staging path of their own that
// compresses on the device (device_codecs.h): the bucket is encoded on the copy stream into codes
// in device memory, only the codes this rank sends are staged, the transport path runs the
// algorithm's exchange of codes on the host (comm/compression/coded.h), and what it gathered is
// copied back and decoded into the bucket on the device; PowerSGD does this twice a step (P, then
// Q). The codes cross the bus instead of the float32 bucket, and the encoding and decoding run on
// the GPU, not the CPU.

#include "ddp/cuda_gradients.h"
#include "ddp/distributed_module.h"
#include "ddp/gradient_path.h"

#ifdef TROUPE_HAVE_CUDA
#include "actors/execution_post.h"
#include "ddp/gradient_path/device_codecs.h"
#include "ddp/staging.h"
#endif

namespace troupe {

namespace {

#ifdef TROUPE_HAVE_CUDA

class StagedBucket : public actors::BucketPath, public std::enable_shared_from_this<StagedBucket> {
 public:
  // With `codec`, the mirror stages its codes: each round of the step encodes (or works on the
  // last round's result) before its download, and the last round decodes after its upload; the
  // wrapped path runs the codec's exchange once per round.
  StagedBucket(int index, std::shared_ptr<actors::HostStaging> mirror,
               std::shared_ptr<actors::BucketPath> inner, std::vector<void*> ready_events,
               std::chrono::milliseconds timeout, std::shared_ptr<DeviceCodec> codec = nullptr)
      : index_(index),
        codec_(std::move(codec)),
        mirror_(std::move(mirror)),
        inner_(std::move(inner)),
        ready_events_(std::move(ready_events)),
        timeout_(timeout) {}

  void reduce(const actors::ActorThread& self, uint32_t step, double denominator,
              Done done) override {
    auto run = std::make_shared<Run>();
    run->step = step;
    run->denominator = denominator;
    run->rounds = codec_ ? codec_->rounds(step) : 1;
    run->done = std::move(done);
    download(self, run, 0, ready_events_);
  }

  void abort(const actors::ActorThread& self, const comm::Status& why) override {
    broken_ = why;
    inner_->abort(self, why);
  }

  std::vector<int> waiting_on() override { return inner_->waiting_on(); }

  comm::Reduction* reduction() override { return inner_->reduction(); }

 private:
  // One step's reduction: its rounds run one after the other.
  struct Run {
    uint32_t step = 0;
    double denominator = 1;
    int rounds = 1;
    Done done;
    size_t sent = 0, received = 0;  // over the rounds so far
    void fail(const std::string& why) const { done(comm::Status::failure(why), sent, received); }
  };

  CodecRound round(const Run& run, int index) const {
    return CodecRound{run.step, run.denominator, index};
  }

  // Round `index`: the device work (after `ready`), then the copy to the mirror. May throw.
  void download(const actors::ActorThread& self, const std::shared_ptr<Run>& run, int index,
                const std::vector<void*>& ready) {
    actors::HostStaging::OnStream encode;
    actors::HostStaging::Span span;
    if (codec_) {
      encode = [codec = codec_, r = round(*run, index)](void* stream) { codec->encode(stream, r); };
      span = codec_->sent(round(*run, index));
    }
    // The copy completes on the watcher's thread; the wrapped path starts on the actor's.
    mirror_->download(
        ready, timeout_,
        [self, weak = weak_from_this(), run, index](const std::string& error) {
          self.post([self, weak, run, index, error] {
            if (auto me = weak.lock()) me->exchange(self, run, index, error);
          });
        },
        encode, span);
  }

  // Round `index`'s part of the mirror is in (or `error` says why not): the wrapped path runs the
  // exchange on it, then its result goes back to the device, and the next round follows.
  void exchange(const actors::ActorThread& self, const std::shared_ptr<Run>& run, int index,
                const std::string& error) {
    if (!error.empty()) return run->fail(error);
    if (!broken_.ok()) return run->done(broken_, run->sent, run->received);
    const bool last = index + 1 == run->rounds;
    actors::HostStaging::OnStream decode;
    actors::HostStaging::Span span;
    if (codec_) {
      if (last)
        decode = [codec = codec_, r = round(*run, index)](void* stream) {
          codec->decode(stream, r);
        };
      span = codec_->gathered(round(*run, index));
    }
    const std::string what = "bucket " + std::to_string(index_) + ": ";
    Done upload = [self, weak = weak_from_this(), run, index, last, mirror = mirror_,
                   timeout = timeout_, decode, span,
                   what](const comm::Status& status, size_t sent, size_t received) {
      run->sent += sent;
      run->received += received;
      if (!status.ok()) return run->done(status, run->sent, run->received);
      try {
        mirror->upload(
            timeout,
            [self, weak, run, index, last, what](const std::string& error) {
              if (!error.empty()) return run->fail(error);
              if (last) return run->done(comm::Status::success(), run->sent, run->received);
              self.post([self, weak, run, index, what] {
                auto me = weak.lock();
                if (!me) return;
                try {
                  me->download(self, run, index + 1, {});
                } catch (const std::exception& e) {
                  run->fail(what + e.what());
                }
              });
            },
            decode, span);
      } catch (const std::exception& e) {
        run->fail(what + e.what());
      }
    };
    try {
      if (codec_) codec_->begin_round(index);
      const double exchanged =
          codec_ ? codec_->exchange_denominator(run->denominator) : run->denominator;
      inner_->reduce(self, run->step, exchanged, upload);
    } catch (const std::exception& e) {
      run->fail(what + e.what());
    }
  }

  int index_;
  // Before the mirror: destroyed after it, which waits for the copies in flight and so for the
  // codec's kernels around them (on the same streams) before the codec's device memory goes.
  std::shared_ptr<DeviceCodec> codec_;
  std::shared_ptr<actors::HostStaging> mirror_;
  std::shared_ptr<actors::BucketPath> inner_;
  std::vector<void*> ready_events_;
  std::chrono::milliseconds timeout_;
  comm::Status broken_;  // a rank died: set by abort()
};

#endif

class HostStagingPath : public GradientPath {
 public:
  // `on_device`: the path that compresses on the device (see the top).
  HostStagingPath(std::unique_ptr<GradientPath> inner, bool on_device)
      : inner_(std::move(inner)), on_device_(on_device) {}

  std::string name() const override {
    return on_device_ ? "cuda via host staging, compressed on the device" : "cuda via host staging";
  }

  std::string can_serve(const GradientPathContext& context) const override {
    if (!context.cuda) return "the parameters are on the CPU";
#ifndef TROUPE_HAVE_CUDA
    return "troupe was built without CUDA";
#else
    if (!on_device_) return "";
    if (auto why = device_codec_support(*context.algorithm); !why.empty()) return why;
    for (const auto& p : *context.params)
      if (p.scalar_type() != torch::kFloat)
        return "a parameter is " + std::string(c10::toString(p.scalar_type())) + ", not float32";
    return "";
#endif
  }

  void connect(const GradientPathContext& context) override {
    timeout_ = *context.options->stall_timeout;
    device_ = context.cuda->device();
    if (!on_device_) return inner_->connect(context);
    algorithm_ = *context.algorithm;
    rank_ = context.runtime->transport()->rank();
    world_size_ = context.runtime->transport()->world_size();
#ifdef TROUPE_HAVE_CUDA
    // The wrapped path runs each bucket's exchange of codes, made by its codec (bucket() makes
    // the codec just before it asks the wrapped path for the bucket).
    GradientPathContext inner = context;
    inner.make_reduction = [this](const comm::BucketBuffer& host) {
      return next_codec_->host_reduction(host, host.data);
    };
    inner_->connect(inner);
#endif
  }

  void begin_buckets(int count) override { inner_->begin_buckets(count); }

  std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                             std::vector<void*> ready_events) override {
#ifdef TROUPE_HAVE_CUDA
    if (!context_) context_ = std::make_shared<actors::StagingContext>(device_);
    const std::string what = "bucket " + std::to_string(buffer.index);
    comm::BucketBuffer host = buffer;
    if (!on_device_) {
      auto mirror = std::make_shared<actors::HostStaging>(
          context_, buffer.data, buffer.count * comm::element_size(buffer.type), what);
      host.data = mirror->host();
      return std::make_shared<StagedBucket>(buffer.index, mirror, inner_->bucket(host, {}),
                                            std::move(ready_events), timeout_);
    }
    auto codec = make_device_codec(
        algorithm_, buffer, torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device_)),
        rank_, world_size_);
    auto mirror =
        std::make_shared<actors::HostStaging>(context_, codec->area(), codec->area_bytes(), what);
    host.data = mirror->host();
    next_codec_ = codec;
    auto inner = inner_->bucket(host, {});
    next_codec_ = nullptr;
    return std::make_shared<StagedBucket>(buffer.index, mirror, std::move(inner),
                                          std::move(ready_events), timeout_, std::move(codec));
#else
    (void)buffer;
    (void)ready_events;
    throw comm::Error("DistributedModule: a staged CUDA bucket in a troupe built without CUDA");
#endif
  }

 private:
  std::unique_ptr<GradientPath> inner_;
  bool on_device_;
  std::chrono::milliseconds timeout_{60000};
  int device_ = -1;
  // Compressing on the device: the algorithm, this rank's place, and the codec of the bucket
  // being made.
  comm::Compression algorithm_;
  int rank_ = 0;
  int world_size_ = 1;
#ifdef TROUPE_HAVE_CUDA
  std::shared_ptr<DeviceCodec> next_codec_;
  std::shared_ptr<actors::StagingContext> context_;
#endif
};

}  // namespace

std::unique_ptr<GradientPath> make_host_staging_path(std::unique_ptr<GradientPath> inner) {
  return std::make_unique<HostStagingPath>(std::move(inner), /*on_device=*/false);
}

std::unique_ptr<GradientPath> make_device_codec_staging_path(std::unique_ptr<GradientPath> inner) {
  return std::make_unique<HostStagingPath>(std::move(inner), /*on_device=*/true);
}

}  // namespace troupe
