#include "ddp/gradient_path.h"

#include "comm/reduce.h"
#include "comm/status.h"

namespace troupe {

// The paths, one per file of ddp/gradient_path/.
std::unique_ptr<GradientPath> make_nccl_path();
std::unique_ptr<GradientPath> make_host_staging_path(std::unique_ptr<GradientPath> inner);
std::unique_ptr<GradientPath> make_device_codec_staging_path(std::unique_ptr<GradientPath> inner);
std::unique_ptr<GradientPath> make_shared_memory_path();
std::unique_ptr<GradientPath> make_transport_path();

std::vector<std::unique_ptr<GradientPath>> gradient_path_candidates() {
  std::vector<std::unique_ptr<GradientPath>> candidates;
  candidates.push_back(make_nccl_path());
  candidates.push_back(make_device_codec_staging_path(make_transport_path()));
  candidates.push_back(make_host_staging_path(make_transport_path()));
  candidates.push_back(make_shared_memory_path());
  candidates.push_back(make_transport_path());
  return candidates;
}

GradientPathChoice choose_gradient_path(std::vector<std::unique_ptr<GradientPath>> candidates,
                                        const GradientPathContext& context) {
  GradientPathChoice choice;
  for (auto& candidate : candidates) {
    std::string why = candidate->can_serve(context);
    if (why.empty()) {
      choice.path = std::move(candidate);
      return choice;
    }
    choice.declined.push_back(candidate->name() + ": " + why);
  }
  std::string reasons;
  for (auto& d : choice.declined) reasons += (reasons.empty() ? "" : "; ") + d;
  throw comm::Error("DistributedModule: no gradient path can reduce this module's buckets (" +
                    (reasons.empty() ? std::string("no candidate") : reasons) + ")");
}

Adoption GradientPath::adopt(int bucket, int64_t offset, const torch::Tensor& grad,
                             const torch::Tensor& view) {
  (void)bucket;
  (void)offset;
  // The bucket is read next by the reduction (another core, or another rank's): written past the
  // caches, the copy reads the gradient once and writes the bucket once.
  comm::stream_copy(view.data_ptr(), grad.data_ptr(), grad.nbytes());
  return Adoption::copied;
}

torch::Tensor GradientPath::bucket_memory(int index, int64_t elements,
                                          const torch::TensorOptions& options) {
  (void)index;
  return torch::zeros({elements}, options);
}

}  // namespace troupe
