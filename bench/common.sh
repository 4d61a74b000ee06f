# Sourced by the bench/*.sh scripts: the checks they make before running anything.
# The sourcing script sets `script` (its name, for messages) first.

die() { echo "${script:-bench}: $*" >&2; exit 1; }

# need_positive_int WHAT VALUE: dies naming WHAT and VALUE unless VALUE is an integer >= 1.
need_positive_int() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 '$2': expected a positive integer"
}

# need_troupe BINARY: dies unless BINARY is an executable troupe with a `bench ddp` subcommand
# (CLI11 lists subcommands in `bench --help`; an unknown one would only fail minutes later).
need_troupe() {
  [[ -x "$1" ]] || die "troupe binary '$1' not found or not executable;" \
                       "build it first (cmake --build build) or set TROUPE_BIN"
  "$1" bench --help 2>&1 | grep -Eq '^[[:space:]]+ddp([[:space:]]|$)' ||
    die "'$1 bench' has no 'ddp' subcommand (see '$1 bench --help');" \
        "build a troupe that has it or set TROUPE_BIN"
}

# need_torch PYTHON: dies unless PYTHON imports torch.distributed.
need_torch() {
  "$1" -c 'import torch.distributed' 2>/dev/null ||
    die "$1 does not import torch.distributed: run scripts/setup (it puts the torch wheel in .venv), or set TROUPE_PYTHON to a Python with torch"
}
