// NCCL loaded with dlopen on first use (library.h).
#include "comm/transport/nccl/library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <optional>
#include <vector>

#include "comm/status.h"

namespace troupe::comm {

namespace {

std::string loader_error() {
  const char* why = dlerror();
  return why != nullptr ? why : "unknown reason";
}

}  // namespace

NcclLibrary NcclLibrary::find(const char* chosen) {
  if (chosen != nullptr && *chosen != '\0') {
    try {
      return open(chosen);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (from " + kNcclLibraryVariable +
                  "; expected the path of a libnccl.so.2, or unset it to use the loader's "
                  "libnccl.so.2)");
    }
  }
  // One libnccl.so.2 per process: the one already loaded (LibTorch's CUDA build loads its own)
  // is the only one to use. A path of another file would load a second copy beside it.
  if (void* loaded = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD)) {
    dlclose(loaded);
    return open("libnccl.so.2");
  }
  // Else the one whose nccl.h troupe was compiled with, then the loader's search.
  std::vector<std::string> candidates;
#ifdef TROUPE_NCCL_BUILT_AGAINST
  candidates.emplace_back(TROUPE_NCCL_BUILT_AGAINST);
#endif
  candidates.emplace_back("libnccl.so.2");
  std::string tried;
  for (const std::string& file : candidates) {
    try {
      return open(file);
    } catch (const Error& e) {
      tried += std::string(tried.empty() ? "" : "; ") + e.what();
    }
  }
  throw Error(tried +
              ". troupe loads NCCL when a CUDA communicator is first made: install it (torch's "
              "CUDA wheel brings the nvidia-nccl wheel; the CUDA toolkit has one), put its "
              "folder on LD_LIBRARY_PATH, or set " +
              kNcclLibraryVariable + " to its libnccl.so.2");
}

NcclLibrary NcclLibrary::open(const std::string& file) {
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) throw Error("NCCL: cannot load '" + file + "': " + loader_error());
  NcclLibrary library;
  library.file = file;
  std::string missing;
#define TROUPE_NCCL_FIND(name)                                                            \
  if (missing.empty()) {                                                                  \
    library.name = reinterpret_cast<decltype(library.name)>(dlsym(handle, "nccl" #name)); \
    if (library.name == nullptr) missing = "nccl" #name;                                  \
  }
  TROUPE_NCCL_FUNCTIONS(TROUPE_NCCL_FIND)
#undef TROUPE_NCCL_FIND
  if (!missing.empty()) {
    dlclose(handle);
    throw Error("NCCL: '" + file + "' has no " + missing + " (expected NCCL " +
                std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) +
                " or newer, the version troupe was compiled against)");
  }
  return library;  // the handle stays open: the functions are used until the process ends
}

const NcclLibrary& nccl_library() {
  struct Loaded {
    std::optional<NcclLibrary> library;
    std::string error;
  };
  static const Loaded loaded = [] {
    try {
      return Loaded{NcclLibrary::find(std::getenv(kNcclLibraryVariable)), ""};
    } catch (const Error& e) {
      return Loaded{std::nullopt, e.what()};
    }
  }();
  if (!loaded.library) throw Error(loaded.error);
  return *loaded.library;
}

}  // namespace troupe::comm
