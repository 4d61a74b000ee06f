#pragma once
// Hand-offs that ThreadSanitizer cannot see. CAF is not built with TSan and its mailboxes are
// lock-free, so a message that passes the right to touch memory from one thread to another (a
// bucket's gradients and its algorithm's state: the trainer's hook to the bucket actor, the
// reduction's end back to the trainer) orders nothing that TSan knows of, and it reports races
// that the message prevents. The sender calls handoff_release() before it sends, the receiver
// handoff_acquire() when it takes the message. Without TSan both are nothing.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace troupe::actors {

#if defined(__SANITIZE_THREAD__)
inline char handoff_key;  // one for every such message: it orders more than needed, never less
inline void handoff_release() { __tsan_release(&handoff_key); }
inline void handoff_acquire() { __tsan_acquire(&handoff_key); }
#else
inline void handoff_release() {}
inline void handoff_acquire() {}
#endif

}  // namespace troupe::actors
