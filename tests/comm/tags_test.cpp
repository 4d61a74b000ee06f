// The tag layout (comm/tags.h): each field lands in its own bits, and wraps inside them.
#include <doctest/doctest.h>

#include "comm/collectives/communicator.h"
#include "comm/tags.h"

using namespace troupe::comm;

TEST_CASE("a bucket key keeps module, step, stage and bucket in their own bits") {
  const uint32_t key = tags::bucket_key(tags::module_prefix(5), 4095, 3, 4095);
  CHECK((key >> 28) == 5u);
  CHECK(((key >> 16) & 0xfffu) == 4095u);
  CHECK(((key >> 12) & 0xfu) == 3u);
  CHECK((key & 0xfffu) == 4095u);
  // The step wraps inside its 12 bits instead of reaching the module's.
  CHECK(tags::bucket_key(tags::module_prefix(1), 4096, 0, 0) == tags::module_prefix(1));
}

TEST_CASE("a round key wraps below the module and a tag puts the key above the sub-tag") {
  const uint32_t prefix = tags::module_prefix(tags::kMaxModules);
  CHECK(tags::round_key(prefix, (uint64_t{1} << 28) + 7) == (prefix | 7u));
  CHECK(tags::tag_of(0x12345678u, 0xabcdu) == 0x12345678abcdull);
  CHECK((tags::tag_of(0xffffffffu, 0xffffu) & ~kTagMask) == 0);
  // The Communicator's own keys stay below every module's.
  CHECK(kFirstUserKey == tags::module_prefix(1));
}
