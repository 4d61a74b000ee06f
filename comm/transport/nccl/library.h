#pragma once
// NCCL, loaded on first use. troupe's libraries and programs do not link libnccl: a CPU program
// of a troupe built with NCCL needs none, and only a CUDA communicator loads it. A process holds
// one libnccl.so.2 (the dynamic loader keeps one object per soname): where LibTorch's CUDA build
// has loaded its own, troupe uses that one.
#include <nccl.h>

#include <string>

namespace troupe::comm {

// The NCCL functions troupe calls, without their "nccl" prefix.
#define TROUPE_NCCL_FUNCTIONS(X) \
  X(GetVersion)                  \
  X(GetUniqueId)                 \
  X(GetErrorString)              \
  X(GetLastError)                \
  X(CommInitRankConfig)          \
  X(CommSplit)                   \
  X(CommGetAsyncError)           \
  X(CommFinalize)                \
  X(CommDestroy)                 \
  X(CommAbort)                   \
  X(AllReduce)                   \
  X(RedOpCreatePreMulSum)        \
  X(RedOpDestroy)                \
  X(Broadcast)                   \
  X(AllGather)                   \
  X(ReduceScatter)               \
  X(GroupStart)                  \
  X(GroupEnd)                    \
  X(Send)                        \
  X(Recv)

/// One loaded libnccl: a pointer for each function troupe calls (`library.AllReduce(...)` is
/// ncclAllReduce of that library).
struct NcclLibrary {
#define TROUPE_NCCL_MEMBER(name) decltype(&::nccl##name) name = nullptr;
  TROUPE_NCCL_FUNCTIONS(TROUPE_NCCL_MEMBER)
#undef TROUPE_NCCL_MEMBER
  std::string file;  // as given to the dynamic loader

  /// Opens `file` (a path, or a name the dynamic loader searches for) and finds every function.
  /// Throws comm::Error naming the file and the loader's reason, or the first missing function.
  /// The library stays loaded for the life of the process.
  static NcclLibrary open(const std::string& file);
  /// `chosen` (TROUPE_NCCL_LIBRARY's value) when it is set and not empty. Otherwise the
  /// libnccl.so.2 this process has loaded already (LibTorch's, if any); else the one troupe was
  /// built against, then libnccl.so.2 as the dynamic loader finds it (LD_LIBRARY_PATH, the
  /// program's run path, the system's). Throws comm::Error saying what was tried and how to point
  /// troupe at an NCCL.
  static NcclLibrary find(const char* chosen);
};

/// The environment variable that names the libnccl to load instead of the loader's libnccl.so.2.
inline constexpr const char* kNcclLibraryVariable = "TROUPE_NCCL_LIBRARY";

/// The process's NCCL: NcclLibrary::find(getenv(TROUPE_NCCL_LIBRARY)) on the first call. When
/// none loads, this and every later call throw the same comm::Error.
const NcclLibrary& nccl_library();

}  // namespace troupe::comm
