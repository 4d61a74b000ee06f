#pragma once
/// Host staging: how a bucket of CUDA gradients is reduced on a job without NCCL (UCX or inproc
/// transports), or with an algorithm NCCL does not run (the compressed ones).
///
/// Each such bucket has a mirror in pinned host memory. When the bucket is full, its gradients are
/// copied there on a copy stream that first waits on the events recorded where each gradient was
/// ready (no synchronisation of torch's stream); when the copy has completed, the bucket runs its
/// usual CPU reduction (comm::Reduction's stages over the transport) on the mirror; then the result
/// is copied back to the device, and only when that copy has completed does the bucket report to
/// the reducer, so step() finds the reduced gradients on the device. Copies complete through an
/// EventWatcher thread (cuda/event_watcher.h), never by blocking an actor.
///
/// Built only with CUDA (TROUPE_HAVE_CUDA).
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda/event_watcher.h"

namespace troupe::actors {

/// What the staged buckets of one module share: their device, a stream for copies to the host,
/// one for copies back (so that one bucket's way back does not wait behind another's way out) and
/// the event watcher.
class StagingContext {
 public:
  explicit StagingContext(int device);
  ~StagingContext();
  StagingContext(const StagingContext&) = delete;
  StagingContext& operator=(const StagingContext&) = delete;

  int device() const { return device_; }
  void* download_stream() const { return download_; }
  void* upload_stream() const { return upload_; }
  cuda::EventWatcher& watcher() { return watcher_; }

 private:
  int device_;
  void* download_ = nullptr;
  void* upload_ = nullptr;
  cuda::EventWatcher watcher_;
};

/// A part of a staged buffer: `bytes` from `offset` (all of it by default).
struct StagingSpan {
  size_t offset = 0;
  size_t bytes = static_cast<size_t>(-1);  // to the end
};

/// The pinned host mirror of one bucket's device buffer, and its two copies.
class HostStaging {
 public:
  using Span = StagingSpan;

  /// `device_data`: the bucket's `bytes` of device memory; `name` ("bucket 3") names it in errors.
  HostStaging(std::shared_ptr<StagingContext> context, void* device_data, size_t bytes,
              std::string name);
  /// Waits (up to 10 s) for a copy still in flight before it frees the mirror.
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  /// The mirror: what the bucket's CPU reduction works on.
  void* host() const { return host_; }
  size_t bytes() const { return bytes_; }

  /// Work a caller enqueues on the copy stream (a cudaStream_t) around a copy: an encoding of the
  /// bucket into the device buffer before the download, a decoding after the upload.
  using OnStream = std::function<void(void* stream)>;

  /// Copies the part `span` of the device buffer (all of it by default) into the same part of the
  /// mirror once every event of `ready` has completed; `done` gets "" when the copy has completed,
  /// or why not (it did not within `timeout`, CUDA failed). `before`, when set, is enqueued after
  /// the waits and before the copy. Throws std::runtime_error when CUDA refuses to enqueue the
  /// copy, std::invalid_argument for a part outside the buffer.
  void download(const std::vector<void*>& ready, std::chrono::milliseconds timeout,
                cuda::EventWatcher::Done done, const OnStream& before = {}, Span span = {});
  /// Copies the part `span` of the mirror back into the device buffer; `done` as for download().
  /// `after`, when set, is enqueued after the copy, and `done` waits for it too. (A compressed
  /// exchange sends one part of its codes and receives another.)
  void upload(std::chrono::milliseconds timeout, cuda::EventWatcher::Done done,
              const OnStream& after = {}, Span span = {});

 private:
  std::shared_ptr<StagingContext> context_;
  void* device_data_;
  size_t bytes_;
  std::string name_;
  void* host_ = nullptr;
  void* downloaded_ = nullptr;  // events
  void* uploaded_ = nullptr;
};

}  // namespace troupe::actors
