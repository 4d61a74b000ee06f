#!/usr/bin/env bash
# The installed package works for a project outside the tree: installs the build into a scratch
# prefix, configures and builds examples/out_of_tree against it (find_package(troupe),
# troupe::troupe) with the build's compiler and generator, and runs the app alone and as 2 ranks
# under the installed `troupe launch`. Also checks that CUDA and NCCL are optional components: the
# exported targets name NCCL by an imported target, not by this machine's path; the consumer sees
# cuda/nccl exactly when troupe was built with them; a CPU-only troupe (-DTROUPE_WITH_CUDA=OFF)
# gives an app that needs no libcudart or libnccl, and one with NCCL an app that does not link
# libnccl (troupe loads it on first use); an unknown or absent component is refused by
# name. With consumers=examples it builds the examples instead (examples/CMakeLists.txt on its
# own: fashion_mnist, char_lm, dcgan), which proves that they need nothing but the public headers,
# starts each with --help and trains dcgan for 2 steps alone. Registered in tests/CMakeLists.txt
# (label "install": install.out_of_tree, install.examples).
# Arguments, name=value: source, build, work (scratch folder, emptied first), config, generator,
# make_program, cxx, launcher (may be empty); prefix_path (optional: CMAKE_PREFIX_PATH given to the
# consumer, default <work>/prefix; point it elsewhere to see the test fail); consumers (optional:
# out_of_tree, the default, or examples).
set -euo pipefail
launcher="" make_program="" prefix_path="" consumers=out_of_tree
for arg in "$@"; do
  case "$arg" in
    source=* | build=* | work=* | config=* | generator=* | make_program=* | cxx=* | launcher=* | \
      prefix_path=* | consumers=*) declare "${arg%%=*}=${arg#*=}" ;;
    *) echo "out_of_tree_test: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for required in source build work config generator cxx; do
  [ -n "${!required:-}" ] || { echo "out_of_tree_test: $required= is required" >&2; exit 2; }
done
case "$consumers" in
  out_of_tree | examples) ;;
  *) echo "out_of_tree_test: consumers=$consumers (expected out_of_tree or examples)" >&2; exit 2 ;;
esac

started=$SECONDS
step() { echo "== [$((SECONDS - started))s] $*"; }
prefix="$work/prefix" consumer="$work/consumer"
prefix_path="${prefix_path:-$prefix}"
rm -rf "$work"
mkdir -p "$work"

step "cmake --install $build --prefix $prefix"
if ! cmake --install "$build" --prefix "$prefix" --config "$config" >"$work/install.log" 2>&1; then
  cat "$work/install.log"; echo "out_of_tree_test: install failed" >&2; exit 1
fi
echo "$(grep -c '^-- Installing' "$work/install.log") files installed"

# Same compiler and build type as troupe; Ninja when troupe uses it or it is on PATH.
gen_args=(-G "$generator")
if [[ "$generator" == *Ninja* ]]; then
  [ -n "$make_program" ] && gen_args+=(-DCMAKE_MAKE_PROGRAM="$make_program")
elif command -v ninja >/dev/null; then
  gen_args=(-G Ninja)
fi
fail() { echo "out_of_tree_test: $*" >&2; exit 1; }

# Configures a project of examples/ against the prefix (in $consumer) and checks that it found the
# installed troupe; its configure output goes to $work/configure.log too.
configure() {
  step "configure $1 with CMAKE_PREFIX_PATH=$prefix_path"
  cmake -S "$source/$1" -B "$consumer" "${gen_args[@]}" \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE="$config" \
    ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"} \
    -DCMAKE_PREFIX_PATH="$prefix_path" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF | tee "$work/configure.log"
  local found
  found="$(sed -n 's/^troupe_DIR:PATH=//p' "$consumer/CMakeCache.txt")"
  if [ "$found" != "$prefix/lib/cmake/troupe" ] && [ "$found" != "$prefix/lib64/cmake/troupe" ]; then
    fail "the consumer found troupe in '$found', not in $prefix"
  fi
}

# Runs a command as rank 0 of 1: no launcher variables, and its directory listens on a MASTER_PORT
# that nobody listens on, below Linux's ephemeral range.
alone() {
  local port=$((20000 + RANDOM % 10000))
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((20000 + RANDOM % 10000)); done
  (
    for v in $(compgen -e | grep -E '^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|OMPI_COMM_WORLD_.*|SLURM_.*)$' || true); do
      unset "$v"
    done
    MASTER_PORT=$port "$@"
  )
}

if [ "$consumers" = examples ]; then
  configure examples
  step "build fashion_mnist, char_lm and dcgan"
  cmake --build "$consumer"
  for program in fashion_mnist char_lm dcgan; do
    step "$program --help"
    "$consumer/$program" --help >"$work/$program-help.log" || {
      cat "$work/$program-help.log"; fail "$consumer/$program --help failed"
    }
    head -n 1 "$work/$program-help.log"
  done
  step "run $consumer/dcgan alone: 2 steps on random images"
  alone "$consumer/dcgan" --steps 2 --batch 8 --data "$work/no-fashion-mnist"
  step "passed"
  exit 0
fi

config_dir="$(ls -d "$prefix"/lib*/cmake/troupe | head -n 1)"
have_cuda="$(sed -n 's/^set(troupe_HAVE_CUDA \(.*\))$/\1/p' "$config_dir/troupeConfig.cmake")"
have_nccl="$(sed -n 's/^set(troupe_HAVE_NCCL \(.*\))$/\1/p' "$config_dir/troupeConfig.cmake")"
echo "installed troupe: CUDA ${have_cuda:-?}, NCCL ${have_nccl:-?}"
[ -n "$have_cuda" ] && [ -n "$have_nccl" ] || fail "no troupe_HAVE_CUDA/NCCL in $config_dir/troupeConfig.cmake"
step "the exported targets name no library of this machine's CUDA or NCCL by path"
if grep -nE '/[^";]*lib(nccl|cudart)[^";]*' "$config_dir"/troupeTargets*.cmake; then
  fail "the exported targets above name libnccl/libcudart by path (expected the imported targets NCCL::nccl, CUDA::cudart)"
fi

# A find_package(troupe) that must fail, and the message it must give; it fails before the
# dependencies are looked for, so a project without languages will do.
refuses() {
  local components="$1" expected="$2" dir="$work/components"
  rm -rf "$dir"; mkdir -p "$dir/src"
  printf 'cmake_minimum_required(VERSION 3.20)\nproject(c LANGUAGES NONE)\nfind_package(troupe REQUIRED COMPONENTS %s)\n' \
    "$components" >"$dir/src/CMakeLists.txt"
  if cmake -S "$dir/src" -B "$dir/build" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$dir/log" 2>&1; then
    cat "$dir/log"; fail "find_package(troupe COMPONENTS $components) succeeded (expected a refusal)"
  fi
  grep -q "$expected" <(tr -s ' \n' ' ' <"$dir/log") || {
    cat "$dir/log"; fail "find_package(troupe COMPONENTS $components) did not say '$expected'"
  }
}
step "find_package(troupe COMPONENTS cudaa) is refused, naming the component"
refuses cudaa "troupe has no component 'cudaa' (expected cuda or nccl)"
if [ "$have_cuda" != ON ]; then
  step "find_package(troupe COMPONENTS cuda) of a troupe without CUDA is refused, saying why"
  refuses cuda "was built without CUDA"
fi

configure examples/out_of_tree
truth() { [ "$1" = ON ] && echo TRUE || echo FALSE; }
components="troupe components: cuda=$(truth "$have_cuda") nccl=$(truth "$have_nccl")"
grep -qF -- "$components" "$work/configure.log" || fail "the consumer did not report '$components'"

step "build"
cmake --build "$consumer"

step "the app's libraries"
needed="$(readelf -d "$consumer/app" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p' | tr '\n' ' ')"
echo "$needed"
if [ "$have_cuda" != ON ] && grep -qE 'lib(cudart|nccl|cuda)\.' <<<"$needed"; then
  fail "the app of a troupe built without CUDA needs a CUDA library: $needed"
fi
# NCCL is loaded when a CUDA communicator is first made (comm/transport/nccl/library.h), never
# linked: the CPU app needs no libnccl of its own, nor a driver (libcuda).
if grep -qE 'lib(nccl|cuda)\.' <<<"$needed"; then
  fail "the CPU app links libnccl or libcuda directly (expected NCCL loaded on first use): $needed"
fi

step "run $consumer/app (alone)"
alone "$consumer/app"

step "run $prefix/bin/troupe launch -n 2 -- app"
"$prefix/bin/troupe" launch -n 2 --timeout 120 -- "$consumer/app"

step "passed"
