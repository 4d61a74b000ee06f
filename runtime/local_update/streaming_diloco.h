#pragma once
/// Streaming DiLoCo (Douillard et al., arXiv 2501.18512), with eager updates as an option (Kale
/// et al., arXiv 2502.12996): DiLoCo (diloco.h) with the model cut into P fragments that
/// synchronise in turn instead of all at once, and each fragment's reduction left to travel while
/// training goes on.
///
/// ```cpp
/// troupe::StreamingDiLoCo c;  // H = 50, P = 4 fragments, delay 1, alpha 0.5
/// troupe::StreamingDiLoCoModule dp(rt, net, c);
/// for (...) { inner.zero_grad(); loss.backward(); dp.step(inner); }
/// ```
/// The fragments are contiguous slices of the flat parameter vector (runtime/gossip/flat_model.h)
/// of near-equal size, cut at row boundaries (a tensor may span two fragments): so each sync
/// sends about 1/P of the model, whatever the sizes of the tensors. Fragment p synchronises after
/// inner step t when t mod H == floor((p + 1) H / P) mod H, so the last one does so with plain
/// DiLoCo's schedule. At that step every rank computes the fragment's outer gradient
/// (global - local) and hands its reduction (any bucket algorithm: fp16, ByteGrad, top-k...) to
/// a thread of the module, which runs it on its own driver under this module's keys
/// (runtime/module_id.h) while the trainer takes the next `delay` steps; after step t + delay the
/// trainer waits for it (with the collective deadline), steps the fragment's global copy by outer
/// Nesterov SGD and merges: local = alpha local + (1 - alpha) global. docs/algorithms.md gives the
/// rule, eager updates included, and where it departs from the paper.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/data_parallel.h"
#include "runtime/local_update/algorithms.h"

namespace troupe {

/// "streaming_diloco(h=50, fragments=4, delay=1, alpha=0.5, outer_lr=0.7, outer_momentum=0.9,
/// allreduce)" (", heavy ball" and ", eager" where set).
std::string streaming_diloco_name(const StreamingDiLoCo& config);

/// The first and one-past-last element of each fragment of a flat vector holding tensors of
/// `rows[i]` x `cols[i]` elements in order: P near-equal slices cut at row boundaries. Throws
/// comm::Error when there are fewer rows than fragments.
std::vector<std::pair<size_t, size_t>> streaming_fragments(const std::vector<size_t>& rows,
                                                           const std::vector<size_t>& cols,
                                                           int fragments);

class StreamingDiLoCoModule : public DataParallel {
 public:
  /// A collective: every rank wraps the same model with the same config. Throws comm::Error
  /// naming a setting out of range (and what was expected), or a parameter that is not float32.
  StreamingDiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                        StreamingDiLoCo config);
  ~StreamingDiLoCoModule() override;

  /// Steps `inner` (its gradients stay local); then applies the fragment whose delay ends here
  /// and starts the reduction of the fragment whose turn it is: collectives, every rank calls
  /// step() the same number of times.
  void step(torch::optim::Optimizer& inner) override;
  /// Waits for the fragment in flight and applies it now. Idempotent.
  void finish() override;
  std::string algorithm_name() const override;
  /// peak_sync_bytes_sent: the most one fragment's sync sent; last_step_bytes_sent: what the
  /// fragment applied in this step sent.
  CommStats stats() const override;
  /// Fragment synchronisations applied so far (all fragments together).
  int64_t outer_steps() const;
  /// The [first, last) element of each fragment in the flat parameter vector.
  std::vector<std::pair<size_t, size_t>> fragments() const;
  /// Bytes this rank sent for each fragment sync applied so far, in order.
  const std::vector<uint64_t>& sync_bytes_sent() const;
  /// The global weights, outer momentum, step counters, eager updates' memory, each fragment's
  /// reduction state, and a fragment in flight (whose reduction is waited for first: its averaged
  /// outer gradient is saved and applied at its step after a load): a resumed run continues
  /// bit-identically. Every rank saves at the same step.
  void save_state(comm::StateWriter& out) const override;
  void load_state(comm::StateReader& in) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
