#pragma once
/// Checkpoint: everything one rank needs to continue a run exactly where it stopped, as one byte
/// string (serialize_state / restore_state) or one file per rank (save / load).
///
/// ```cpp
/// troupe::optim::CentralizedSGD opt(rt, net, troupe::optim::CentralizedSgdOptions(0.1));
/// int64_t epoch = 0, batch = 0;
/// troupe::Checkpoint checkpoint(rt);
/// checkpoint.module(*net).algorithm(opt).rng().value("epoch", epoch).value("batch", batch);
/// if (resuming) checkpoint.load(dir);        // DIR/rank-<r>.troupe
/// ...
/// if (step % 100 == 0) checkpoint.save(dir);  // between steps, on every rank
/// ```
/// A Checkpoint names the parts of the training state; it owns none of them. The parts, in the
/// order they were added:
/// - module(): parameters and buffers by name (checked at restore: names, shapes, dtypes);
/// - optimizer(): a torch::optim optimizer's state (its own save/load, a torch archive);
/// - algorithm(): a wrapper's state across steps, through its save_state/load_state pair
///   (DistributedModule, DataParallel and ModelSwitch, DecentralizedModule, AsynchronousModule,
///   CentralizedOptimizer, FP16Optimizer, optim::PowerSGD): the step counter, error feedback,
///   momentum correction, PowerSGD's Qs, Choco-SGD's public copies, the loss scale, and the
///   inner optimizer of the optimizers that own one;
/// - rng(): torch's default CPU generator;
/// - value(): an integer or bytes of the embedder's (the data loader's epoch and batch, its
///   shuffle generator).
/// The state is the same on a save and its restore when the same code built the same parts: the
/// trajectory after a restore is then bit-identical to the one without the interruption
/// (tests/runtime/checkpoint_test.cpp checks it per algorithm family).
///
/// The bytes: a header (magic "TROUPEck", format version, world size, rank, payload length,
/// SHA-256 of the payload), then the payload: the parts, each under its name. restore_state
/// parses the header and every part and checks the checksum, the version, the world size, the
/// rank, the part names, and the module's tensors before it changes anything; a state that fails
/// a check throws comm::Error naming the source (the file) and the problem. The algorithms' own
/// checks (another bucket layout, another algorithm) run as each part is applied, each before
/// that part changes, and the algorithm parts are applied first: one that refuses its state
/// leaves the model, optimizer, generator and values untouched.
///
/// Files are written atomically: a temporary file in the same directory, fsync, rename, fsync of
/// the directory; a crash leaves the previous checkpoint or the new one, never half of one.
/// Save and restore between steps only (after step(), before the next backward); they are local
/// to the rank (no collective), so each rank saves and loads its own file.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/state.h"

namespace troupe {

class Runtime;

/// What restore_state requires of the state besides its integrity. The elastic heal of a rank
/// from a live peer takes the peer's state (another rank's), possibly of the old world size.
struct RestoreChecks {
  bool same_rank = true;
  bool same_world = true;
};

class Checkpoint {
 public:
  /// The format version this build writes and reads. 2 (2026-11-24): Streaming DiLoCo's state
  /// holds each fragment's failed flag, last average and its world (elastic eager updates), so a
  /// version 1 file is refused by its version rather than misread. 3 (2026-11-26): an optimizer's
  /// state names the LibTorch version that wrote it.
  static constexpr uint32_t kVersion = 3;

  /// For rank runtime.rank() of runtime.world_size().
  explicit Checkpoint(Runtime& runtime);
  Checkpoint(int rank, int world_size);

  /// Parameters and buffers of `module` (kept by reference: it must outlive the Checkpoint).
  Checkpoint& module(torch::nn::Module& module);
  /// A torch::optim optimizer's state (momentum buffers, Adam's moments, step counts).
  Checkpoint& optimizer(torch::optim::Optimizer& optimizer);
  /// A wrapper's state: anything with `void save_state(comm::StateWriter&) const` and
  /// `void load_state(comm::StateReader&)`.
  template <class Stateful>
  Checkpoint& algorithm(Stateful& stateful, const std::string& name = "algorithm") {
    return part(name, [&stateful](comm::StateWriter& out) { stateful.save_state(out); },
                [&stateful](comm::StateReader& in) { stateful.load_state(in); });
  }
  /// torch's default CPU generator (dropout, randperm, torch::rand...).
  Checkpoint& rng();
  /// An integer of the embedder's (the loader's epoch, the batch index).
  Checkpoint& value(const std::string& name, int64_t& value);
  /// Bytes of the embedder's (a shuffle generator's state, a config).
  Checkpoint& bytes(const std::string& name, std::string& bytes);
  /// Any other part: `save` appends its state, `load` reads it back (and checks it first).
  Checkpoint& part(const std::string& name, std::function<void(comm::StateWriter&)> save,
                   std::function<void(comm::StateReader&)> load);

  /// The whole state of this rank, header and checksum included.
  std::string serialize_state() const;
  /// Restores every part from `bytes` (what serialize_state made). `source` names the bytes in
  /// errors (a file, "rank 1's state").
  void restore_state(const std::string& bytes, const std::string& source = "checkpoint state",
                     RestoreChecks checks = {});

  /// Writes serialize_state() to file_of(dir, rank) atomically, creating `dir` if needed.
  void save(const std::string& dir) const;
  /// Restores this rank's file of `dir`. Throws comm::Error naming the file when it is missing,
  /// unreadable, truncated, corrupt, of another version, world size or rank.
  void load(const std::string& dir);
  /// DIR/rank-<rank>.troupe.
  static std::string file_of(const std::string& dir, int rank);

 private:
  // When a part's bytes are applied: the parts whose own checks run as they apply (algorithms)
  // first, then the optimizers' archives, then what was checked in full beforehand.
  enum class Stage { checks_as_it_applies = 0, optimizer = 1, checked = 2 };

  Checkpoint& add(const std::string& name, std::function<void(comm::StateWriter&)> save,
                  std::function<std::function<void()>(comm::StateReader&)> prepare, Stage stage);

  struct Part {
    std::string name;
    std::function<void(comm::StateWriter&)> save;
    // Reads and checks the part's bytes; returns what applies them (run once every part passed).
    std::function<std::function<void()>(comm::StateReader&)> prepare;
    Stage stage;
  };
  int rank_;
  int world_;
  std::vector<Part> parts_;
};

/// A torch::optim optimizer's state as bytes (the LibTorch version, then its save() into a torch
/// archive) and back; used by the optimizers that own an inner one. load_optimizer throws
/// comm::Error naming `in.what()`, and both versions when another LibTorch wrote the state.
void save_optimizer(const torch::optim::Optimizer& optimizer, comm::StateWriter& out);
void load_optimizer(torch::optim::Optimizer& optimizer, comm::StateReader& in);

/// A hash of every parameter's bytes, in order (SHA-256, hex): equal on two runs whose parameters
/// are bit-identical.
std::string parameter_checksum(torch::nn::Module& module);

}  // namespace troupe
