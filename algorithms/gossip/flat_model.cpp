#include "algorithms/gossip/flat_model.h"

#include <torch/torch.h>

#include <iostream>

#include "comm/transport/transport.h"
#include "rank/model_check.h"

namespace troupe::gossip {

void survive_peer_loss(Runtime& runtime, uint32_t key_prefix, const std::string& what) {
  auto transport = runtime.transport();
  if (!transport) return;
  const std::string gap = transport->survive_peer_loss(key_prefix);
  if (!gap.empty() && runtime.rank() == 0)
    std::cerr << "troupe: " << what << ": a neighbour that dies may leave this job's other ranks "
              << "unable to hear each other: " << gap << "\n";
}

FlatModel::FlatModel(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, std::string what,
                     bool broadcast)
    : what_(std::move(what)) {
  if (!module) throw comm::Error(what_ + ": the module is null");
  torch::NoGradGuard no_grad;
  std::string mine = "algorithm " + what_ + "\n";
  std::string first_name;
  c10::optional<torch::Device> device;
  int64_t total = 0;
  for (auto& p : module->named_parameters(true)) {
    const auto& t = p.value();
    if (t.scalar_type() != torch::kFloat32)
      throw comm::Error(what_ + ": parameter " + p.key() + " is " +
                        std::string(c10::toString(t.scalar_type())) +
                        ", expected float32 (decentralized algorithms mix float32 weights)");
    if (!t.device().is_cpu() && !t.device().is_cuda())
      throw comm::Error(what_ + ": parameter " + p.key() + " is on " + t.device().str() +
                        ", expected the CPU or a CUDA device");
    if (!device) {
      device = t.device();
      first_name = p.key();
    } else if (t.device() != *device) {
      throw comm::Error(what_ + ": parameter " + p.key() + " is on " + t.device().str() +
                        ", parameter " + first_name + " on " + device->str() +
                        " (expected every parameter on one device)");
    }
    mine += p.key() + " " + shape_of(t) + "\n";
    params_.push_back(t);
    names_.push_back(p.key());
    shapes_.push_back(t.sizes().vec());
    offsets_.push_back(total);
    total += t.numel();
  }
  // Ranks may use different GPUs, but not some the CPU and others a GPU.
  mine += std::string("parameters on ") + (device && device->is_cuda() ? "cuda" : "cpu") + "\n";
  check_same_on_every_rank(runtime.comm(), mine);
  const auto options = torch::TensorOptions().dtype(torch::kFloat32);
  flat_ = torch::empty({total}, options.device(device.value_or(torch::kCPU)));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto slice = flat_.narrow(0, offsets_[i], p.numel());
    slice.copy_(p.reshape({-1}));
    p.set_data(slice.view(p.sizes()));
  }
  if (on_cuda()) {
    mirror_ = torch::empty({total}, options.pinned_memory(true));
    host_ = mirror_.data_ptr<float>();
  } else {
    host_ = flat_.data_ptr<float>();
  }
  if (broadcast && runtime.world_size() > 1) {
    pull();
    runtime.comm().broadcast(host(), count(), comm::DataType::float32, 0);
    push();
  }
}

namespace {

std::string sizes_text(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

}  // namespace

bool FlatModel::reattach() {
  const auto* base = static_cast<const char*>(flat_.data_ptr());
  bool any = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (p.data_ptr() == base + offsets_[i] * static_cast<int64_t>(sizeof(float)) &&
        p.sizes() == c10::IntArrayRef(shapes_[i]))
      continue;
    // Its storage was replaced: it goes back into its slice if it still fits there.
    const std::string where = what_ + ": parameter " + names_[i];
    const std::string when = " (it was replaced after the module was constructed)";
    if (p.sizes() != c10::IntArrayRef(shapes_[i]))
      throw comm::Error(where + " has shape " + sizes_text(p.sizes()) + " now, expected " +
                        sizes_text(shapes_[i]) + when);
    if (p.scalar_type() != torch::kFloat32)
      throw comm::Error(where + " is " + std::string(c10::toString(p.scalar_type())) +
                        " now, expected float32" + when);
    if (p.device() != flat_.device())
      throw comm::Error(where + " is on " + p.device().str() + " now, expected " +
                        flat_.device().str() + when + ": move the model back before the step");
    torch::NoGradGuard no_grad;
    auto slice = flat_.narrow(0, offsets_[i], p.numel());
    slice.copy_(p.reshape({-1}));
    p.set_data(slice.view(p.sizes()));
    any = true;
  }
  return any;
}

void FlatModel::pull() {
  if (on_cuda()) mirror_.copy_(flat_);
}

void FlatModel::push() {
  if (on_cuda()) flat_.copy_(mirror_);
}

void FlatModel::gradients(float* out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto dst = torch::from_blob(out + offsets_[i], {p.numel()}, torch::kFloat32);
    const auto& g = p.grad();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));  // from a CUDA gradient: a synchronous copy to host memory
    } else {
      dst.zero_();
    }
  }
}

void FlatModel::set_gradients(const float* in) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto src = torch::from_blob(const_cast<float*>(in + offsets_[i]), p.sizes(), torch::kFloat32);
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    p.mutable_grad().copy_(src);
  }
}

}  // namespace troupe::gossip
