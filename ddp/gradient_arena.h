#pragma once
/// GradientArena: the gradients autograd allocates, put in shared memory from the start, so that
/// the other ranks of the host read them where they lie instead of this rank copying them into
/// its buckets first.
///
/// With LibTorch 2.x's zero_grad() (set to none) every backward pass allocates a fresh tensor for
/// each gradient, in ordinary memory, and the shared-memory path had to copy it into the bucket
/// that the other ranks read (31.6 MB a step for the 7.9M-parameter MLP: 3-4.5 ms of a core). An
/// arena is a range of the rank's shared region (comm::LocalAllreduce::data()) from which it
/// serves, on the threads it was told to serve and while grad mode is off (backward runs so; the
/// forward pass's activations, some of a gradient's size, stay out), the CPU allocations whose
/// size is that of one of the module's gradients (at least kMinBytes): autograd's gradient then
/// lies in shared memory, and the path hands the bucket's reduction its place
/// (comm::LocalSources) instead of copying.
///
/// The arena works through the process's CPU allocator: the first arena wraps the allocator
/// LibTorch had (c10::GetCPUAllocator()) in one that asks the calling thread's arena first and
/// passes everything else on unchanged; it stays installed for the life of the process. An
/// allocation the arena cannot serve (no room: at most twice the gradients' bytes are kept) goes
/// to the wrapped allocator, and the path copies that gradient as before. Memory the arena handed
/// out stays valid while its tensors live, after close() and after the module is gone (the arena
/// keeps its region mapped until then).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace troupe {

class GradientArena : public std::enable_shared_from_this<GradientArena> {
 public:
  /// Allocations smaller than this are never served (their copy costs little).
  static constexpr size_t kMinBytes = size_t{64} << 10;

  /// The arena over `bytes` bytes at `base` (aligned to 64), which `owner` keeps mapped, serving
  /// allocations of exactly one of `sizes` bytes (those below kMinBytes are dropped).
  static std::shared_ptr<GradientArena> create(char* base, size_t bytes,
                                               std::shared_ptr<void> owner,
                                               const std::vector<size_t>& sizes);
  ~GradientArena();
  GradientArena(const GradientArena&) = delete;
  GradientArena& operator=(const GradientArena&) = delete;

  /// From now on the calling thread's CPU allocations of a served size, made with grad mode off,
  /// come from this arena while it has room (the thread's previous arena, if any, no longer
  /// serves it).
  void serve_this_thread();
  /// While one lives, the calling thread's allocations come from no arena: around the optimizer's
  /// step, whose state (momentum, Adam's moments: a gradient's size each, kept for good) would
  /// otherwise fill the arena and leave no room for the gradients.
  class Unserved {
   public:
    Unserved();
    ~Unserved();
    Unserved(const Unserved&) = delete;
    Unserved& operator=(const Unserved&) = delete;
  };

  /// Serves no allocation after this (from any thread).
  void close();
  bool closed() const;

  /// Whether the `bytes` bytes at `p` lie in the arena.
  bool holds(const void* p, size_t bytes) const;
  char* base() const { return base_; }
  size_t bytes() const { return bytes_; }

  /// Allocations served since create(), allocations of a served size refused for want of room,
  /// and the bytes handed out now.
  uint64_t served() const;
  uint64_t refused() const;
  size_t bytes_in_use() const;

  // For the process's allocator (gradient_arena.cpp): memory for `n` bytes, or null.
  void* try_allocate(size_t n);
  void release(void* p);

 private:
  GradientArena(char* base, size_t bytes, std::shared_ptr<void> owner, std::vector<size_t> sizes);

  char* base_;
  size_t bytes_;
  std::shared_ptr<void> owner_;
  std::vector<size_t> sizes_;  // sorted, distinct
  mutable std::mutex mutex_;
  std::map<size_t, size_t> free_;  // offset -> bytes, coalesced
  std::map<size_t, size_t> used_;  // offset -> bytes
  bool closed_ = false;
  uint64_t served_ = 0;
  uint64_t refused_ = 0;
  size_t in_use_ = 0;
};

}  // namespace troupe
