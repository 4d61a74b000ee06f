#include "rank/device.h"

#include <torch/cuda.h>

#include "comm/status.h"

namespace troupe {

std::string check_device_name(const std::string& name) {
  if (name == "cpu" || name == "cuda") return "";
  if (name.size() > 5 && name.size() < 9 && name.compare(0, 5, "cuda:") == 0 &&
      name.find_first_not_of("0123456789", 5) == std::string::npos)
    return "";
  return "'" + name + "' (expected cpu, cuda or cuda:N)";
}

torch::Device training_device(const std::string& name, int local_rank) {
  if (const std::string why = check_device_name(name); !why.empty())
    throw comm::Error("--device " + why);
  if (name == "cpu") return torch::Device(torch::kCPU);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus == 0)
    throw comm::Error("--device " + name +
                      ": this process sees no CUDA device "
                      "(torch::cuda::device_count() is 0; expected a GPU, its driver and a CUDA "
                      "LibTorch, or --device cpu)");
  if (name == "cuda")
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
  const int index = std::stoi(name.substr(5));
  if (index >= gpus)
    throw comm::Error("--device " + name + ": this process sees " + std::to_string(gpus) +
                      " CUDA device(s) (expected cuda:0 .. cuda:" + std::to_string(gpus - 1) + ")");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

std::string gpus_for_nccl(int ranks_on_host, int devices) {
  if (ranks_on_host <= devices) return "";
  return std::to_string(ranks_on_host) + " ranks on this host, " + std::to_string(devices) +
         " CUDA device" + (devices == 1 ? "" : "s") +
         " seen: NCCL needs a GPU of its own for each rank (ranks that share one reduce through "
         "host staging)";
}

}  // namespace troupe
