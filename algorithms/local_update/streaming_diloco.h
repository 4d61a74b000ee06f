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
/// The fragments are contiguous slices of the flat parameter vector
/// (algorithms/gossip/flat_model.h) of near-equal size, cut at row boundaries (a tensor may span
/// two fragments): so each sync sends about 1/P of the model, whatever the sizes of the tensors.
/// Fragment p synchronises after inner step t when t mod H == floor((p + 1) H / P) mod H, so the
/// last one does so with plain DiLoCo's schedule. At that step every rank computes the fragment's
/// outer gradient (global - local) and hands its reduction (any bucket algorithm: fp16, ByteGrad,
/// top-k...) to a thread of the module, which runs it on its own driver under this module's keys
/// (rank/module_id.h) while the trainer takes the next `delay` steps; after step t + delay the
/// trainer waits for it (with the collective deadline), steps the fragment's global copy by outer
/// Nesterov SGD and merges: local = alpha local + (1 - alpha) global. docs/algorithms.md gives the
/// rule, eager updates included, and where it departs from the paper.
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "algorithms/local_update/algorithms.h"
#include "algorithms/local_update/local_update_module.h"

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

/// step() applies the fragment whose delay ends there and starts the reduction of the fragment
/// whose turn it is. stats(): peak_sync_bytes_sent is the most one fragment's sync sent,
/// last_step_bytes_sent what the fragment applied in this step sent. The state holds the outer
/// momentum, eager updates' memory (this rank's outer gradient, the others' average and the
/// provisional weights of each fragment's last sync, and the average every rank received with
/// its world), each fragment's reduction state, and a fragment in flight (whose reduction is
/// waited for first: its averaged outer gradient is saved and applied at its step after a load;
/// one whose reduction failed on this rank is saved marked so, and only land_missed_sync lands
/// it) besides local_update_module.h's. Every rank saves at the same step.
class StreamingDiLoCoModule : public LocalUpdateModule {
 public:
  /// A collective: every rank wraps the same model with the same config. Throws comm::Error
  /// naming a setting out of range (and what was expected), or a parameter that is not float32.
  StreamingDiLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module,
                        StreamingDiLoCo config);

  /// Waits for the fragment in flight and applies it now. Idempotent.
  void finish() override;
  /// The [first, last) element of each fragment in the flat parameter vector.
  std::vector<std::pair<size_t, size_t>> fragments() const;
  /// Bytes this rank sent for each fragment sync applied so far, in order.
  const std::vector<uint64_t>& sync_bytes_sent() const;

 private:
  struct Impl;
  Impl& impl() const;
};

}  // namespace troupe
