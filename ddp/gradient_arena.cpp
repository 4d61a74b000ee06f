#include "ddp/gradient_arena.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>

#include <algorithm>

namespace troupe {

namespace {

constexpr size_t kAlign = 64;

// The arenas that serve allocations or still have memory out, so that a deleter given only a
// pointer finds its arena; an arena leaves once it is closed and all its memory is back.
struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<GradientArena>> arenas;
  c10::Allocator* next = nullptr;  // the allocator LibTorch had before ours
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: deleters may run at exit
  return *r;
}

thread_local std::weak_ptr<GradientArena> this_thread_arena;
thread_local int unserved = 0;  // GradientArena::Unserved guards alive on this thread

// Removes `arena` from the registry if it is closed and has no memory out. Under the registry's
// lock; returns the reference for the caller to drop after unlocking.
std::shared_ptr<GradientArena> take_if_drained(Registry& r, GradientArena* arena) {
  if (!arena->closed() || arena->bytes_in_use() != 0) return nullptr;
  for (auto it = r.arenas.begin(); it != r.arenas.end(); ++it)
    if (it->get() == arena) {
      auto held = *it;
      r.arenas.erase(it);
      return held;
    }
  return nullptr;
}

// Frees memory of either kind: an arena's, or the wrapped allocator's (as its raw deleter).
void free_any(void* p) {
  auto& r = registry();
  std::shared_ptr<GradientArena> drop;  // an arena that leaves: destroyed after the lock
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& arena : r.arenas) {
      if (!arena->holds(p, 1)) continue;
      arena->release(p);
      drop = take_if_drained(r, arena.get());
      return;
    }
  }
  r.next->raw_deleter()(p);
}

class ArenaAllocator final : public c10::Allocator {
 public:
  explicit ArenaAllocator(c10::Allocator* next) : next_(next) {}

  c10::DataPtr allocate(size_t n) override {
    // Backward runs with grad mode off (unless it builds a graph of its own): the forward pass's
    // activations, some of a gradient's size, never take the arena's room.
    if (n >= GradientArena::kMinBytes && unserved == 0 && !c10::GradMode::is_enabled())
      if (auto arena = this_thread_arena.lock())
        if (void* p = arena->try_allocate(n))
          return {p, p, &free_any, c10::Device(c10::DeviceType::CPU)};
    return next_->allocate(n);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return next_->raw_deleter() ? &free_any : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* next_;
};

void install_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& r = registry();
    r.next = c10::GetCPUAllocator();
    static auto* allocator = new ArenaAllocator(r.next);
    // Above LibTorch's own CPU allocator (priority 0).
    c10::SetCPUAllocator(allocator, 100);
  });
}

}  // namespace

GradientArena::GradientArena(char* base, size_t bytes, std::shared_ptr<void> owner,
                             std::vector<size_t> sizes)
    : base_(base), bytes_(bytes), owner_(std::move(owner)), sizes_(std::move(sizes)) {
  if (bytes_ > 0) free_.emplace(0, bytes_);
}

GradientArena::~GradientArena() = default;

std::shared_ptr<GradientArena> GradientArena::create(char* base, size_t bytes,
                                                     std::shared_ptr<void> owner,
                                                     const std::vector<size_t>& sizes) {
  std::vector<size_t> served;
  for (size_t s : sizes)
    if (s >= kMinBytes) served.push_back(s);
  std::sort(served.begin(), served.end());
  served.erase(std::unique(served.begin(), served.end()), served.end());
  // Whole lines only: the first byte aligned, the length cut down to lines.
  const size_t skip = (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
  const size_t usable = bytes > skip ? (bytes - skip) / kAlign * kAlign : 0;
  std::shared_ptr<GradientArena> arena(
      new GradientArena(base + skip, usable, std::move(owner), std::move(served)));
  install_allocator();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.arenas.push_back(arena);
  return arena;
}

GradientArena::Unserved::Unserved() { ++unserved; }
GradientArena::Unserved::~Unserved() { --unserved; }

void GradientArena::serve_this_thread() { this_thread_arena = weak_from_this(); }

void GradientArena::close() {
  auto& r = registry();
  std::shared_ptr<GradientArena> drop;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    {
      std::lock_guard<std::mutex> mine(mutex_);
      closed_ = true;
    }
    drop = take_if_drained(r, this);  // else the last release() takes it
  }
}

bool GradientArena::holds(const void* p, size_t bytes) const {
  const auto* c = static_cast<const char*>(p);
  return c >= base_ && c < base_ + bytes_ && bytes <= static_cast<size_t>(base_ + bytes_ - c);
}

void* GradientArena::try_allocate(size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_ || !std::binary_search(sizes_.begin(), sizes_.end(), n)) return nullptr;
  const size_t want = (n + kAlign - 1) / kAlign * kAlign;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    const size_t at = it->first;
    const size_t left = it->second - want;
    free_.erase(it);
    if (left) free_.emplace(at + want, left);
    used_.emplace(at, want);
    in_use_ += want;
    ++served_;
    return base_ + at;
  }
  ++refused_;
  return nullptr;
}

void GradientArena::release(void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto at = static_cast<size_t>(static_cast<char*>(p) - base_);
  auto used = used_.find(at);
  if (used == used_.end()) return;  // not handed out (cannot happen through free_any)
  size_t start = at;
  size_t length = used->second;
  in_use_ -= length;
  used_.erase(used);
  // Coalesce with the free neighbours on both sides.
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + length) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == start) {
      start = before->first;
      length += before->second;
      free_.erase(before);
    }
  }
  free_.emplace(start, length);
}

bool GradientArena::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

uint64_t GradientArena::served() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return served_;
}

uint64_t GradientArena::refused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

size_t GradientArena::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

}  // namespace troupe
