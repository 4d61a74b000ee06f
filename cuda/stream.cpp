#include "cuda/stream.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.h"

namespace troupe::cuda {

namespace {

void require(const void* pointer, const char* function, const char* what) {
  if (pointer == nullptr)
    throw std::invalid_argument(std::string("troupe::cuda::") + function + ": " + what +
                                " is null (expected a handle made by this library)");
}

void require_buffers(const void* dst, const void* src, size_t bytes, const char* function) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr)
    throw std::invalid_argument(std::string("troupe::cuda::") + function + ": null buffer with " +
                                std::to_string(bytes) + " bytes (expected two valid buffers)");
}

}  // namespace

int device_count() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not report it
    return 0;
  }
  return devices;
}

int current_device() {
  int device = 0;
  TROUPE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void set_device(int device) {
  const int count = device_count();
  if (device < 0 || device >= count)
    throw std::invalid_argument("troupe::cuda::set_device: device " + std::to_string(device) +
                                " (expected 0 <= device < " + std::to_string(count) +
                                ", the devices this process sees)");
  TROUPE_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  previous_ = current_device();
  if (previous_ != device) set_device(device);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // a destructor does not throw
}

int device_of(const void* pointer) {
  if (pointer == nullptr) return -1;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged
             ? attributes.device
             : -1;
}

void* create_stream() {
  cudaStream_t stream = nullptr;
  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

void destroy_stream(void* stream) {
  if (stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void synchronize_stream(void* stream) {
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void* create_event() {
  cudaEvent_t event = nullptr;
  TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void destroy_event(void* event) {
  if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void record_event(void* event, void* stream) {
  require(event, "record_event", "event");
  TROUPE_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

bool event_done(void* event) {
  require(event, "event_done", "event");
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) return false;
  cudaGetLastError();
  detail::throw_cuda_error("cudaEventQuery(event)", status);
}

void stream_wait_event(void* stream, void* event) {
  require(event, "stream_wait_event", "event");
  TROUPE_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void* host_alloc(size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("troupe::cuda::host_alloc: 0 bytes (expected > 0)");
  void* pointer = nullptr;
  TROUPE_CUDA_CHECK(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable));
  return pointer;
}

void host_free(void* pointer) {
  if (pointer != nullptr) cudaFreeHost(pointer);
}

void copy_to_host_async(void* host, const void* device, size_t bytes, void* stream) {
  require_buffers(host, device, bytes, "copy_to_host_async");
  if (bytes == 0) return;
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream)));
}

void copy_to_device_async(void* device, const void* host, size_t bytes, void* stream) {
  require_buffers(device, host, bytes, "copy_to_device_async");
  if (bytes == 0) return;
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice,
                                    static_cast<cudaStream_t>(stream)));
}

void zero_async(void* device, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (device == nullptr)
    throw std::invalid_argument("troupe::cuda::zero_async: null device buffer for " +
                                std::to_string(bytes) + " bytes");
  TROUPE_CUDA_CHECK(cudaMemsetAsync(device, 0, bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace troupe::cuda
