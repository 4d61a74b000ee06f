#pragma once
/// The layout of a message tag, in one place. A transport carries 48-bit tags (UCX puts the
/// source rank above them, comm/transport/ucx/transport.cpp); the collectives give each running
/// collective a 32-bit key and each of its messages a 16-bit sub-tag; the key's top bits name the
/// module, so the modules of a Runtime never meet each other's messages:
///
///     tag  (48 bits)  = key << 16 | sub
///     key  (32 bits)  = module << 28 | the module's own 28 bits:
///         bucket reductions (ddp/gradient_path/transport.cpp): step << 16 | stage << 12 | bucket
///         gossip rounds and streams (actors/peer_link.cpp, actors/background.cpp): round or seq
///     module 0 is the Communicator's own collectives (keys 1 .. kFirstUserKey - 1); modules
///     1 .. kMaxModules are the Runtime's live modules (Runtime::next_module_id).
///
/// Step, round and sequence numbers wrap: two messages meet only if one is a whole wrap
/// (4096 steps, 2^28 rounds) behind the other on the same module, bucket and stage.
#include <cstdint>

namespace troupe::comm {

/// A message tag. Only the low kTagBits bits are carried; higher bits must be zero.
using Tag = uint64_t;
constexpr int kTagBits = 48;
constexpr Tag kTagMask = (Tag{1} << kTagBits) - 1;

namespace tags {

constexpr int kSubBits = 16;    // a collective's messages (Op::sub)
constexpr int kKeyBits = 32;    // a collective invocation
constexpr int kModuleBits = 4;  // the module, at the top of the key
constexpr int kModuleShift = kKeyBits - kModuleBits;
constexpr int kStepBits = 12;  // a bucket reduction's step, wrapping
constexpr int kStepShift = 16;
constexpr int kStageBits = 4;  // its stage (compress, exchange, ...)
constexpr int kStageShift = 12;
constexpr int kBucketBits = 12;  // its bucket

constexpr uint32_t kModuleMask = (uint32_t{1} << kModuleBits) - 1;
constexpr uint32_t kStepMask = (uint32_t{1} << kStepBits) - 1;
constexpr uint32_t kStageMask = (uint32_t{1} << kStageBits) - 1;
constexpr uint32_t kBucketMask = (uint32_t{1} << kBucketBits) - 1;
/// The bits below the module: a gossip round or stream sequence number, wrapping.
constexpr uint32_t kRoundMask = (uint32_t{1} << kModuleShift) - 1;

/// Modules 1..kMaxModules may be alive at once in one Runtime (0 is the Communicator's).
constexpr int kMaxModules = static_cast<int>(kModuleMask);
/// The most buckets a module may have, and stages a reduction of one bucket.
constexpr int kMaxBuckets = static_cast<int>(kBucketMask) + 1;
constexpr int kMaxStages = static_cast<int>(kStageMask) + 1;

static_assert(kSubBits + kKeyBits <= kTagBits, "a key and a sub-tag must fit in a transport tag");
static_assert(kStepShift + kStepBits == kModuleShift, "the step sits right below the module");
static_assert(kStageShift + kStageBits == kStepShift, "the stage sits right below the step");
static_assert(kBucketBits == kStageShift, "the bucket takes the key's low bits");
static_assert(kModuleShift + kModuleBits == kKeyBits, "the module takes the key's top bits");

/// The key bits of module `module` (1..kMaxModules).
constexpr uint32_t module_prefix(int module) {
  return (static_cast<uint32_t>(module) & kModuleMask) << kModuleShift;
}
/// The key of one stage of one bucket's reduction in one step.
constexpr uint32_t bucket_key(uint32_t prefix, uint32_t step, int stage, int bucket) {
  return prefix | (step & kStepMask) << kStepShift |
         (static_cast<uint32_t>(stage) & kStageMask) << kStageShift |
         (static_cast<uint32_t>(bucket) & kBucketMask);
}
/// The key of a gossip round, or of a message of a stream, numbered `n`.
constexpr uint32_t round_key(uint32_t prefix, uint64_t n) {
  return prefix | (static_cast<uint32_t>(n) & kRoundMask);
}
/// The tag of message `sub` of the collective `key`.
constexpr Tag tag_of(uint32_t key, uint32_t sub = 0) {
  return static_cast<Tag>(key) << kSubBits | (sub & ((uint32_t{1} << kSubBits) - 1));
}

/// A reachability probe and its answer (Transport::probe): the two highest tags of key 0, which
/// no collective takes.
constexpr Tag kProbeTag = tag_of(0, 0xfffe);
constexpr Tag kProbeAnswerTag = tag_of(0, 0xffff);

static_assert(tag_of(0xffffffffu, 0xffffu) == kTagMask,
              "the widest tag fills the transport's bits");
static_assert(bucket_key(module_prefix(kMaxModules), kStepMask, kMaxStages - 1, kMaxBuckets - 1) ==
                  0xffffffffu,
              "the key fields do not overlap and fill 32 bits");

}  // namespace tags

}  // namespace troupe::comm
