#include "ddp/staging.h"

#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

#include "cuda/stream.h"

namespace troupe::actors {

StagingContext::StagingContext(int device) : device_(device), watcher_(device) {
  cuda::DeviceGuard guard(device);
  download_ = cuda::create_stream();
  try {
    upload_ = cuda::create_stream();
  } catch (...) {
    cuda::destroy_stream(download_);
    throw;
  }
}

StagingContext::~StagingContext() {
  cuda::DeviceGuard guard(device_);
  cuda::destroy_stream(download_);
  cuda::destroy_stream(upload_);
}

namespace {

// `span` with its end resolved, checked to lie inside `bytes`.
HostStaging::Span resolve(HostStaging::Span span, size_t bytes, const std::string& name,
                          const char* which) {
  if (span.bytes == static_cast<size_t>(-1) && span.offset <= bytes)
    span.bytes = bytes - span.offset;
  if (span.offset > bytes || span.bytes > bytes - span.offset)
    throw std::invalid_argument(name + ": the " + which + " part [" + std::to_string(span.offset) +
                                ", +" + std::to_string(span.bytes) + ") is outside its " +
                                std::to_string(bytes) + " bytes");
  return span;
}

}  // namespace

HostStaging::HostStaging(std::shared_ptr<StagingContext> context, void* device_data, size_t bytes,
                         std::string name)
    : context_(std::move(context)),
      device_data_(device_data),
      bytes_(bytes),
      name_(std::move(name)) {
  cuda::DeviceGuard guard(context_->device());
  host_ = cuda::host_alloc(bytes_);
  try {
    downloaded_ = cuda::create_event();
    uploaded_ = cuda::create_event();
  } catch (...) {
    cuda::destroy_event(downloaded_);
    cuda::host_free(host_);
    throw;
  }
}

HostStaging::~HostStaging() {
  // A copy may still be in flight when a module is destroyed in the middle of a step: the mirror
  // is freed only once both copies have completed (events never recorded count as completed).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool idle = false;
  while (true) {
    try {
      idle = cuda::event_done(downloaded_) && cuda::event_done(uploaded_);
    } catch (const std::exception&) {
      idle = true;  // the device failed: nothing will write the mirror any more
    }
    if (idle || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  cuda::destroy_event(downloaded_);
  cuda::destroy_event(uploaded_);
  if (idle) {
    cuda::host_free(host_);
  } else {
    std::cerr << "troupe: " << name_ << ": a copy to or from its pinned host mirror did not "
              << "complete within 10 s; the mirror (" << bytes_ << " bytes) is left allocated\n";
  }
}

void HostStaging::download(const std::vector<void*>& ready, std::chrono::milliseconds timeout,
                           cuda::EventWatcher::Done done, const OnStream& before, Span span) {
  const Span down = resolve(span, bytes_, name_, "downloaded");
  cuda::DeviceGuard guard(context_->device());
  void* stream = context_->download_stream();
  for (void* event : ready) cuda::stream_wait_event(stream, event);
  if (before) before(stream);
  cuda::copy_to_host_async(static_cast<char*>(host_) + down.offset,
                           static_cast<const char*>(device_data_) + down.offset, down.bytes,
                           stream);
  cuda::record_event(downloaded_, stream);
  context_->watcher().watch(downloaded_, name_ + ": copy of the gradients to pinned host memory",
                            timeout, std::move(done));
}

void HostStaging::upload(std::chrono::milliseconds timeout, cuda::EventWatcher::Done done,
                         const OnStream& after, Span span) {
  const Span up = resolve(span, bytes_, name_, "uploaded");
  cuda::DeviceGuard guard(context_->device());
  void* stream = context_->upload_stream();
  cuda::copy_to_device_async(static_cast<char*>(device_data_) + up.offset,
                             static_cast<const char*>(host_) + up.offset, up.bytes, stream);
  if (after) after(stream);
  cuda::record_event(uploaded_, stream);
  context_->watcher().watch(uploaded_, name_ + ": copy of the reduced gradients to the device",
                            timeout, std::move(done));
}

}  // namespace troupe::actors
