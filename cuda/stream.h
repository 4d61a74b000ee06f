#pragma once
/// Streams, events, pinned host memory and copies: the CUDA runtime calls that the upper layers
/// need to order their work against torch's, without including a CUDA header.
///
/// Like cuda/reduce.h: a plain C++ header with no CUDA types. Streams and events travel as void*
/// (a cudaStream_t, nullptr for the legacy default stream of the current device; a cudaEvent_t).
/// A CUDA failure throws std::runtime_error naming the call; a bad argument throws
/// std::invalid_argument naming it and its value before any CUDA work.
#include <cstddef>

namespace troupe::cuda {

/// CUDA devices visible to this process; 0 (never a throw) without a driver or a device.
int device_count();
/// The calling thread's current device.
int current_device();
/// Makes `device` the calling thread's current device (0 <= device < device_count()).
void set_device(int device);

/// Makes `device` current for a scope and restores the previous device at its end. A negative
/// device leaves the current device alone.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// The device that owns `pointer`, or -1 when it is host memory (pinned or not).
int device_of(const void* pointer);

/// A new stream on the current device that does not synchronise with the legacy default stream
/// (cudaStreamNonBlocking): ordering against other streams is by events only.
void* create_stream();
void destroy_stream(void* stream);
/// Blocks until all work on `stream` has completed.
void synchronize_stream(void* stream);

/// A new event on the current device, without timing (the cheapest kind to record and query).
void* create_event();
void destroy_event(void* event);
/// Captures the work enqueued on `stream` so far: the event completes when that work has.
void record_event(void* event, void* stream);
/// True when the work the event captured has completed (or it was never recorded); false while
/// it is pending. Throws when CUDA reports an error (e.g. a kernel before it faulted).
bool event_done(void* event);
/// Work enqueued on `stream` after this call waits for the event's captured work.
void stream_wait_event(void* stream, void* event);

/// `bytes` of page-locked host memory (portable: usable with every device), for asynchronous
/// copies that overlap with compute. Free with host_free.
void* host_alloc(size_t bytes);
void host_free(void* pointer);

/// Enqueues a copy of `bytes` from device memory to host memory (pinned, for it to be
/// asynchronous) on `stream`.
void copy_to_host_async(void* host, const void* device, size_t bytes, void* stream);
/// Enqueues a copy of `bytes` from host memory to device memory on `stream`.
void copy_to_device_async(void* device, const void* host, size_t bytes, void* stream);
/// Enqueues the zeroing of `bytes` of device memory on `stream`.
void zero_async(void* device, size_t bytes, void* stream);

}  // namespace troupe::cuda
