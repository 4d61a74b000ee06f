#pragma once
/// The device a rank trains on, as the examples' and `troupe bench ddp`'s --device names it:
/// "cpu", "cuda" (GPU local-rank modulo the GPUs the process sees: one GPU per rank of a host, as
/// with torchrun's LOCAL_RANK) or "cuda:N".
#include <torch/types.h>

#include <string>

namespace troupe {

/// "" when `name` is cpu, cuda or cuda:N (N of at most 3 digits), else
/// "'NAME' (expected cpu, cuda or cuda:N)": for a command line's check.
std::string check_device_name(const std::string& name);

/// The device `name` (checked by check_device_name) means for the rank of local rank `local_rank`.
/// Throws comm::Error naming --device, the value and the devices the process sees where there is
/// no CUDA device, or no device N.
torch::Device training_device(const std::string& name, int local_rank);

/// "" when `ranks_on_host` ranks of one host can each have a CUDA device of their own among the
/// `devices` that its processes see, else why not ("2 ranks on this host, 1 GPU: ..."). NCCL
/// refuses two ranks on one GPU, so such a job reduces its CUDA tensors through host staging
/// (Runtime::nccl_available() says no).
std::string gpus_for_nccl(int ranks_on_host, int devices);

}  // namespace troupe
