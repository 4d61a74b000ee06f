#include "rank/torch_stream.h"

#ifdef TROUPE_HAVE_C10_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace troupe {

void* torch_current_stream(int device) {
#ifdef TROUPE_HAVE_C10_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return nullptr;  // the legacy default stream
#endif
}

}  // namespace troupe
