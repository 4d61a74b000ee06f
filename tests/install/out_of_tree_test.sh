#!/usr/bin/env bash
# The installed package works for a project outside the tree: installs the build into a scratch
# prefix, configures and builds examples/out_of_tree against it (find_package(troupe),
# troupe::troupe) with the build's compiler and generator, and runs the app alone and as 2 ranks
# under the installed `troupe launch`. Registered in tests/CMakeLists.txt (label "install").
# Arguments, name=value: source, build, work (scratch folder, emptied first), config, generator,
# make_program, cxx, launcher (may be empty); prefix_path (optional: CMAKE_PREFIX_PATH given to the
# consumer, default <work>/prefix; point it elsewhere to see the test fail).
set -euo pipefail
launcher="" make_program="" prefix_path=""
for arg in "$@"; do
  case "$arg" in
    source=* | build=* | work=* | config=* | generator=* | make_program=* | cxx=* | launcher=* | \
      prefix_path=*) declare "${arg%%=*}=${arg#*=}" ;;
    *) echo "out_of_tree_test: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for required in source build work config generator cxx; do
  [ -n "${!required:-}" ] || { echo "out_of_tree_test: $required= is required" >&2; exit 2; }
done

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
step "configure examples/out_of_tree with CMAKE_PREFIX_PATH=$prefix_path"
cmake -S "$source/examples/out_of_tree" -B "$consumer" "${gen_args[@]}" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE="$config" \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"} \
  -DCMAKE_PREFIX_PATH="$prefix_path" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
found="$(sed -n 's/^troupe_DIR:PATH=//p' "$consumer/CMakeCache.txt")"
if [ "$found" != "$prefix/lib/cmake/troupe" ] && [ "$found" != "$prefix/lib64/cmake/troupe" ]; then
  echo "out_of_tree_test: the consumer found troupe in '$found', not in $prefix" >&2; exit 1
fi

step "build"
cmake --build "$consumer"

# Alone: no launcher variables, so rank 0 of 1. Its directory listens on MASTER_PORT: pick one
# that nobody listens on, below Linux's ephemeral range.
step "run $consumer/app (alone)"
port=$((20000 + RANDOM % 10000))
while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((20000 + RANDOM % 10000)); done
(
  for v in $(compgen -e | grep -E '^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|OMPI_COMM_WORLD_.*|SLURM_.*)$' || true); do
    unset "$v"
  done
  MASTER_PORT=$port "$consumer/app"
)

step "run $prefix/bin/troupe launch -n 2 -- app"
"$prefix/bin/troupe" launch -n 2 --timeout 120 -- "$consumer/app"

step "passed"
