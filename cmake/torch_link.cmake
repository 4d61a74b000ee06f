# troupe_torch_link_options(<LibTorch install prefix>): how an executable that links LibTorch must
# be linked, for troupe's own build (cmake/Dependencies.cmake) and for a consumer of the installed
# package (troupeConfig.cmake) alike. Sets, in the caller's scope:
#   TROUPE_TORCH_LINK_OPTIONS        linker options (usage requirements of troupe_comm)
#   TROUPE_TORCH_WHEEL_LIBRARY_DIRS  the lib folders of the nvidia-* wheels beside a torch wheel's
#                                    LibTorch (empty for any other LibTorch)
#
# 1. The C++ standard library first. LibTorch's binaries are built with a newer GCC than the system
#    they target, whose libstdc++ parts are linked into libtorch_cpu.so statically, and libtorch_cpu
#    exports them (std::filesystem::path, directory_iterator, create_directories, filesystem_error:
#    pytorch/pytorch#133437). The loader looks a symbol up in needed-library order, and an
#    executable lists libtorch_cpu before libstdc++ (the compiler driver adds -lstdc++ last), so
#    every std::filesystem call of the program, and libstdc++'s own, went to LibTorch's copy, built
#    from another GCC's sources than the headers the program was compiled with: g++ 13 programs
#    crashed (SIGSEGV) in every test that made a path, against the torch 2.11 wheel. libstdc++ is
#    made a needed library ahead of all others.
# 2. A torch wheel's CUDA libraries first. libtorch_cuda finds them (the nvidia-* wheels) through its
#    own RUNPATH. An executable that also links a CUDA toolkit's libraries (troupe's kernels; torch's
#    CMake config names the toolkit's libcudart and libnvrtc) gets that toolkit's folder in its
#    RPATH, and the loader, which keeps one library per soname, would give libtorch_cuda the
#    toolkit's libnccl.so.2 or libcudart.so.13 where those are older than the wheel's: "undefined
#    reference to ncclPutSignal" at link time (NCCL 2.28 of CUDA 13.0 against torch 2.15's 2.30), or
#    a missing symbol at run time. The wheels' folders come first, at link time and at run time.
function(troupe_torch_link_options torch_prefix)
  set(options "SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
  get_filename_component(nvidia "${torch_prefix}/../nvidia" ABSOLUTE)
  set(dirs "")
  if(IS_DIRECTORY "${nvidia}")
    file(GLOB dirs LIST_DIRECTORIES true "${nvidia}/*/lib")
    foreach(dir IN LISTS dirs)
      list(APPEND options "LINKER:-rpath-link,${dir}" "LINKER:-rpath,${dir}")
    endforeach()
  endif()
  set(TROUPE_TORCH_LINK_OPTIONS "${options}" PARENT_SCOPE)
  set(TROUPE_TORCH_WHEEL_LIBRARY_DIRS "${dirs}" PARENT_SCOPE)
endfunction()
