// comm/transport/nccl/library.h: NCCL loaded on first use, not linked. Runs without a GPU (no
// NCCL function that needs one is called).
#ifdef TROUPE_HAVE_NCCL

#include "comm/transport/nccl/library.h"

#include <dlfcn.h>
#include <doctest/doctest.h>

#include <string>

#include "comm/status.h"

namespace {

using troupe::comm::Error;
using troupe::comm::NcclLibrary;

std::string refusal(void (*attempt)()) {
  try {
    attempt();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool nccl_in_process() {
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (handle != nullptr) dlclose(handle);
  return handle != nullptr;
}

}  // namespace

// First in this file: a process that has asked for no NCCL has none loaded.
TEST_CASE(
    "NCCL is loaded when it is first asked for, not before, and is the version troupe was compiled "
    "against or newer") {
  CHECK_FALSE(nccl_in_process());
  const NcclLibrary& nccl = troupe::comm::nccl_library();
  CHECK(nccl_in_process());
  CHECK((&troupe::comm::nccl_library() == &nccl));  // loaded once
  int version = 0;
  REQUIRE(nccl.GetVersion(&version) == ncclSuccess);
  INFO("loaded NCCL " << version << " from " << nccl.file << ", compiled against "
                      << NCCL_VERSION_CODE);
  CHECK(version >= NCCL_VERSION_CODE);
  CHECK(version / 10000 == NCCL_MAJOR);
  CHECK(std::string(nccl.GetErrorString(ncclInvalidArgument)).find("invalid argument") !=
        std::string::npos);
}

TEST_CASE("a libnccl that cannot be loaded, or lacks a function troupe calls, is refused by name") {
  const std::string missing =
      refusal([] { NcclLibrary::open("/nonexistent/troupe-test/libnccl.so.2"); });
  CHECK(missing.find("cannot load '/nonexistent/troupe-test/libnccl.so.2'") != std::string::npos);
  CHECK(missing.find("No such file") != std::string::npos);

  const std::string not_nccl = refusal([] { NcclLibrary::open("libc.so.6"); });
  CHECK(not_nccl.find("'libc.so.6' has no ncclGetVersion") != std::string::npos);
  CHECK(not_nccl.find("expected NCCL " + std::to_string(NCCL_MAJOR) + ".") != std::string::npos);
}

TEST_CASE("TROUPE_NCCL_LIBRARY chooses the file, and a bad one is named with the variable") {
  const std::string chosen = refusal([] { NcclLibrary::find("/nonexistent/troupe-test/nccl.so"); });
  CHECK(chosen.find("/nonexistent/troupe-test/nccl.so") != std::string::npos);
  CHECK(chosen.find("from TROUPE_NCCL_LIBRARY") != std::string::npos);
  // Unset or empty: the process's own search, which finds the NCCL of the first test case.
  CHECK((NcclLibrary::find(nullptr).GetVersion == troupe::comm::nccl_library().GetVersion));
  CHECK((NcclLibrary::find("").AllReduce == troupe::comm::nccl_library().AllReduce));
  const NcclLibrary named = NcclLibrary::find(troupe::comm::nccl_library().file.c_str());
  CHECK((named.AllReduce == troupe::comm::nccl_library().AllReduce));
}

#endif  // TROUPE_HAVE_NCCL
