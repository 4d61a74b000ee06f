#pragma once
/// Checkpoint: everything one rank needs to continue a run exactly where it stopped, as one byte
/// string (serialize_state / restore_state), one file per rank (save / load), a job's checkpoint of
/// a step that every rank completed (save_step / load_last), or the full model and optimizer from
/// rank 0, for a job of any world size and for plain LibTorch (save_consolidated /
/// load_consolidated).
///
/// ```cpp
/// troupe::Checkpoint checkpoint(rt);
/// checkpoint.module(*net).optimizer(opt).rng().value("epoch", epoch).value("batch", batch)
///     .setting("batch size", batch_size).setting("seed", seed);
/// int64_t step = resuming ? checkpoint.load_last(dir) : 0;  // every rank, collectively
/// ...
/// if (step % 100 == 0) checkpoint.save_step(dir, step);     // between steps, every rank
/// ```
/// A GAN names its parts: `checkpoint.module(*generator, "generator").module(*discriminator,
/// "discriminator").optimizer(g_adam, "generator adam").optimizer(d_adam, "discriminator adam")`.
///
/// A Checkpoint names the parts of the training state; it owns none of them. The parts, in the
/// order they were added:
/// - module(): parameters and buffers by name (checked at restore: names, shapes, dtypes);
/// - optimizer(): a torch::optim optimizer's state (its own save/load, a torch archive);
/// - algorithm(): a wrapper's state across steps, through its save_state/load_state pair
///   (DistributedModule, DataParallel and ModelSwitch, DecentralizedModule, AsynchronousModule,
///   CentralizedOptimizer, FP16Optimizer, optim::PowerSGD): the step counter, error feedback,
///   momentum correction, PowerSGD's Qs, Choco-SGD's public copies, the loss scale, and the inner
///   optimizer of the optimizers that own one;
/// - rng(): torch's default CPU generator;
/// - value(), bytes(): an integer or bytes of the embedder's (the data loader's epoch and batch,
///   its shuffle generator);
/// - setting(): a setting the rest depends on (the batch size, the seed: what orders the data):
///   saved, and required equal at restore, which names both values otherwise.
/// Each part has a name, one per Checkpoint; module() and optimizer() take one for the second of
/// their kind. The state is the same on a save and its restore when the same code built the same
/// parts: the trajectory after a restore is then bit-identical to the one without the interruption
/// (tests/runtime/checkpoint_test.cpp checks it per algorithm family).
///
/// The bytes: a header (magic "TROUPEck", format version, world size, rank, kind, payload length,
/// SHA-256 of the payload), then the payload: the parts, each under its name. restore_state parses
/// the header and every part and checks the checksum, the version, the world size, the rank, the
/// part names, the settings and the module's tensors before it changes anything; a state that fails
/// a check throws comm::Error naming the source (the file) and the problem. The algorithms' own
/// checks (another bucket layout, another algorithm) run as each part is applied, each before that
/// part changes, and the algorithm parts are applied first: one that refuses its state leaves the
/// model, optimizer, generator and values untouched.
///
/// Files are written atomically: a temporary file in the same directory, fsync, rename, fsync of
/// the directory; a crash leaves the previous file or the new one, never half of one. Save and
/// restore between steps only (after step(), before the next backward).
///
/// save / load are local to the rank (no collective): each rank saves and loads its own file,
/// DIR/rank-<r>.troupe, and nothing checks that the ranks' files belong to one step.
///
/// save_step / load_last are the job's (collective: every rank calls them, with a Runtime):
/// - save_step(dir, step) writes DIR/step-<step>/rank-<r>.troupe; once every rank has written its
///   file (a barrier under the Runtime's collective timeout) each rank records the step as complete
///   in DIR/rank-<r>.complete. A job killed during a save leaves the previous complete step the
///   last one. Each rank then removes its files of earlier steps but the previous complete one, and
///   the temporary files its earlier processes left behind; never a later step's folder (another
///   rank may already be saving there).
/// - load_last(dir) finds the last step some rank recorded complete (a record proves every rank
///   wrote that step), checks that every rank holds its file of it, and restores it; it returns the
///   step. Ranks without their file, no record on any rank, another world size or a changed setting
///   are refused by name before anything is restored; then every rank records that step. Folders
///   of later steps (what a killed save left) lose this rank's files, and go once empty.
/// The directory may be shared by the ranks or local to each host.
///
/// save_consolidated / load_consolidated are the model's, for another world size or for LibTorch
/// alone: rank 0 writes each module as DIR/<name>.pt and each optimizer as DIR/<name>.pt
/// (LibTorch's own archives: `torch::load(net, "DIR/module.pt")` reads them), then
/// DIR/consolidated.troupe with their SHA-256 and the values, bytes and settings; the other ranks
/// write nothing, and all return once it is written. Every rank of any world size loads them (the
/// directory must be readable by each). The rank's own parts are not in it: rng(), algorithm() and
/// part() state (error feedback, a step counter) start afresh, so a run resumed from it is not
/// bit-identical to an uninterrupted one. The model is rank 0's: consolidate when the replicas
/// agree (DDP: after any step; local-update algorithms: after an averaging step).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/state.h"

namespace troupe {

class Runtime;

/// What restore_state requires of the state besides its integrity. The elastic heal of a rank from
/// a live peer takes the peer's state (another rank's), possibly of the old world size.
struct RestoreChecks {
  bool same_rank = true;
  bool same_world = true;
};

class Checkpoint {
 public:
  /// The format version this build writes and reads. 2 (2026-11-24): Streaming DiLoCo's state holds
  /// each fragment's failed flag, last average and its world (elastic eager updates), so a version
  /// 1 file is refused by its version rather than misread. 3 (2026-11-26): an optimizer's state
  /// names the LibTorch version that wrote it.
  static constexpr uint32_t kVersion = 3;

  /// For rank runtime.rank() of runtime.world_size(); the job's saves and loads (save_step,
  /// load_last, save_consolidated) run their collectives on runtime.comm().
  explicit Checkpoint(Runtime& runtime);
  /// Without a Runtime: the job-level calls work for world size 1 only.
  Checkpoint(int rank, int world_size);

  /// Parameters and buffers of `module` (kept by reference: it must outlive the Checkpoint).
  Checkpoint& module(torch::nn::Module& module, const std::string& name = "module");
  /// A torch::optim optimizer's state (momentum buffers, Adam's moments, step counts).
  Checkpoint& optimizer(torch::optim::Optimizer& optimizer, const std::string& name = "optimizer");
  /// A wrapper's state: anything with `void save_state(comm::StateWriter&) const` and `void
  /// load_state(comm::StateReader&)`.
  template <class Stateful>
  Checkpoint& algorithm(Stateful& stateful, const std::string& name = "algorithm") {
    return part(
        name, [&stateful](comm::StateWriter& out) { stateful.save_state(out); },
        [&stateful](comm::StateReader& in) { stateful.load_state(in); });
  }
  /// torch's default CPU generator (dropout, randperm, torch::rand...).
  Checkpoint& rng();
  /// An integer of the embedder's (the loader's epoch, the batch index).
  Checkpoint& value(const std::string& name, int64_t& value);
  /// Bytes of the embedder's (a shuffle generator's state, a config).
  Checkpoint& bytes(const std::string& name, std::string& bytes);
  /// A setting this run's state depends on (the batch size, the seed): saved, and at restore the
  /// saved value must equal `value`, else the restore is refused naming both ("saved with batch
  /// size 64, this run has 32").
  Checkpoint& setting(const std::string& name, int64_t value);
  Checkpoint& setting(const std::string& name, const std::string& value);
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

  /// The job's checkpoint of `step` (>= 0), on every rank: see above. Throws comm::Error naming the
  /// file or the ranks that failed; a rank that throws leaves the previous complete step.
  void save_step(const std::string& dir, int64_t step);
  /// Restores the last step every rank completed in `dir`, on every rank, and returns it.
  int64_t load_last(const std::string& dir);
  /// The step the ranks' records in `dir` name as the last complete one (this rank's view: its own
  /// record), or nullopt when this rank has none. Local, no collective.
  static std::optional<int64_t> last_complete_step(const std::string& dir, int rank);
  /// DIR/step-<step>/rank-<rank>.troupe.
  static std::string file_of_step(const std::string& dir, int64_t step, int rank);

  /// The full model and optimizers from rank 0 (see above); every rank calls it.
  void save_consolidated(const std::string& dir) const;
  /// Loads what save_consolidated wrote, on any rank of any world size.
  void load_consolidated(const std::string& dir);

 private:
  // When a part's bytes are applied: the parts whose own checks run as they apply (algorithms)
  // first, then the optimizers' archives, then what was checked in full beforehand.
  enum class Stage { checks_as_it_applies = 0, optimizer = 1, checked = 2 };

  // What a part holds: the consolidated checkpoint keeps the model's kinds and the embedder's.
  enum class Kind { module, optimizer, value, setting, rank_local };

  Checkpoint& add(const std::string& name, std::function<void(comm::StateWriter&)> save,
                  std::function<std::function<void()>(comm::StateReader&)> prepare, Stage stage,
                  Kind kind, void* target = nullptr);
  // restore_state in two halves: every check (nothing changes), then the change.
  std::vector<std::function<void()>> prepare_restore(const std::string& bytes,
                                                     const std::string& source,
                                                     RestoreChecks checks) const;
  void apply(const std::vector<std::function<void()>>& commits) const;
  std::vector<int64_t> gather(int64_t mine, const std::string& what) const;

  struct Part {
    std::string name;
    std::function<void(comm::StateWriter&)> save;
    // Reads and checks the part's bytes; returns what applies them (run once every part passed).
    std::function<std::function<void()>(comm::StateReader&)> prepare;
    Stage stage;
    Kind kind;
    void* target;  // the module or optimizer (module and optimizer parts)
  };
  Runtime* runtime_ = nullptr;
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
