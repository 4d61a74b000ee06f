#pragma once
/// torch's current CUDA stream: where autograd, the optimizer and torch's copies enqueue their
/// kernels, so the stream that troupe's CUDA events are recorded on when a tensor is ready.
///
/// With LibTorch's c10_cuda (the torch wheel; TROUPE_HAVE_C10_CUDA) it is c10's current stream
/// of the device. Without it (Debian's CPU LibTorch, where troupe is still built with CUDA) it is
/// the legacy default stream (nullptr), which torch uses unless a caller sets another.
namespace troupe {

/// cudaStream_t as void*. Only meaningful in a troupe built with CUDA (TROUPE_HAVE_CUDA).
void* torch_current_stream(int device);

}  // namespace troupe
