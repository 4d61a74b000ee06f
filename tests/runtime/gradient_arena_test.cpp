// GradientArena (ddp/gradient_arena.h) over ordinary memory: which allocations it serves (the
// sizes it was given, on the threads it serves, with grad mode off as in backward, outside
// Unserved guards, while it has room and is open), that what it hands out is freed back into it,
// and that memory handed out outlives close() and the arena's last handle.
#include "tests/support/torch_doctest.h"

#include <memory>
#include <thread>
#include <vector>

#include "ddp/gradient_arena.h"

using namespace troupe;

namespace {

constexpr int64_t kServed = 65536;  // float32 elements: 256 KiB, a size the arena serves

struct Memory {
  std::vector<char> bytes;
  explicit Memory(size_t n) : bytes(n) {}
};

bool inside(const GradientArena& arena, const torch::Tensor& t) {
  return arena.holds(t.data_ptr(), t.nbytes());
}

}  // namespace

TEST_CASE(
    "a gradient arena serves the calling thread's allocations of its sizes while it has room, "
    "and nothing else") {
  // Room for two allocations of the served size, plus the alignment's slack: the region starts
  // one byte past a 64-byte line, so the arena skips 63 bytes and keeps two allocations' worth
  // whatever the heap's alignment (a region that happened to start on a line kept 64 bytes more:
  // the check below failed now and then).
  auto memory = std::make_shared<Memory>(2 * kServed * 4 + 128);
  char* line =
      memory->bytes.data() + (64 - reinterpret_cast<uintptr_t>(memory->bytes.data()) % 64) % 64;
  auto arena = GradientArena::create(line + 1, 2 * kServed * 4 + 64, memory,
                                     {kServed * 4, 1000, kServed * 4});
  CHECK(arena->bytes() == 2 * kServed * 4);
  // Not yet serving this thread.
  torch::NoGradGuard as_in_backward;
  auto before = torch::empty({kServed});
  CHECK_FALSE(inside(*arena, before));
  arena->serve_this_thread();
  {
    torch::AutoGradMode as_in_forward(true);  // activations stay out
    CHECK_FALSE(inside(*arena, torch::empty({kServed})));
  }
  auto a = torch::empty({kServed});
  auto b = torch::ones({kServed});
  CHECK(inside(*arena, a));
  CHECK(inside(*arena, b));
  CHECK(b.sum().item<float>() == static_cast<float>(kServed));
  CHECK(arena->served() == 2);
  CHECK(arena->bytes_in_use() == 2 * kServed * 4);
  // Full: the next one comes from LibTorch's allocator, and is counted as refused.
  auto c = torch::empty({kServed});
  CHECK_FALSE(inside(*arena, c));
  CHECK(arena->refused() == 1);
  // Other sizes, small sizes it was given (below kMinBytes), other threads, Unserved guards.
  CHECK_FALSE(inside(*arena, torch::empty({kServed + 16})));
  CHECK_FALSE(inside(*arena, torch::empty({250})));
  a.reset();  // freed back: room for one again
  CHECK(arena->bytes_in_use() == kServed * 4);
  torch::Tensor other_thread;
  std::thread([&] {
    torch::NoGradGuard off;
    other_thread = torch::empty({kServed});
  }).join();
  CHECK_FALSE(inside(*arena, other_thread));
  {
    const GradientArena::Unserved guard;
    CHECK_FALSE(inside(*arena, torch::empty({kServed})));
  }
  auto d = torch::zeros({kServed});
  CHECK(inside(*arena, d));
  CHECK(arena->refused() == 1);  // the declined sizes and threads were never its to refuse
  CHECK(arena->served() == 3);
  // Freed pieces coalesce: both gone, one piece of twice the size would fit again.
  b.reset();
  d.reset();
  CHECK(arena->bytes_in_use() == 0);
  auto e = torch::empty({kServed});
  auto f = torch::empty({kServed});
  CHECK(inside(*arena, e));
  CHECK(inside(*arena, f));

  // Closed, it serves nothing more; what it handed out stays usable after its last handle is
  // dropped, and is freed into it when the tensors go.
  arena->close();
  CHECK_FALSE(inside(*arena, torch::empty({kServed})));
  std::weak_ptr<Memory> memory_alive = memory;
  std::weak_ptr<GradientArena> arena_alive = arena;
  arena.reset();
  memory.reset();
  CHECK_FALSE(arena_alive.expired());  // kept while e and f are out
  e.fill_(2.0f);
  f.fill_(3.0f);
  CHECK((e + f).sum().item<float>() == 5.0f * kServed);
  e.reset();
  CHECK_FALSE(memory_alive.expired());
  f.reset();
  CHECK(arena_alive.expired());
  CHECK(memory_alive.expired());
}
