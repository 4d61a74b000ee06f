// A program that links LibTorch runs its own toolchain's libstdc++, not the copy of libstdc++'s
// std::filesystem that libtorch_cpu.so exports (cmake/torch_link.cmake): with LibTorch's copy
// first in the lookup order, programs built with g++ 13 crashed in every std::filesystem path.
#include <dlfcn.h>

#include <string>

#include "tests/support/torch_doctest.h"

namespace {

// The file of the library that defines `symbol` as `handle` looks it up ("" if none does):
// RTLD_DEFAULT for the program's global lookup.
std::string library_of(const char* symbol, void* handle = RTLD_DEFAULT) {
  void* address = dlsym(handle, symbol);
  if (!address) return "";
  Dl_info info{};
  if (!dladdr(address, &info) || !info.dli_fname) return "(unknown)";
  return info.dli_fname;
}

}  // namespace

TEST_CASE(
    "std::filesystem in a program that links LibTorch is libstdc++'s own, not LibTorch's copy") {
  void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(torch_cpu != nullptr);  // this program links LibTorch
  const char* symbols[] = {
      "_ZNSt10filesystem7__cxx114path14_M_split_cmptsEv",  // path(...)
      "_ZNSt10filesystem18create_directoriesERKNS_7__cxx114pathERSt10error_code",
      "_ZNSt10filesystem19temp_directory_pathB5cxx11Ev",
      "_ZNKSt10filesystem7__cxx1116filesystem_error4whatEv",
  };
  int exported_by_torch = 0;
  for (const char* symbol : symbols) {
    CAPTURE(symbol);
    if (library_of(symbol, torch_cpu).find("libtorch_cpu") != std::string::npos)
      ++exported_by_torch;
    const std::string library = library_of(symbol);
    CHECK(library.find("libstdc++") != std::string::npos);
  }
  // LibTorch 2.15 exports every one of them; should a later one stop, the check still holds.
  MESSAGE("LibTorch exports " << exported_by_torch << " of " << std::size(symbols));
  dlclose(torch_cpu);
}
