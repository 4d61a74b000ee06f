# Sourced by the bench/netbed_*.sh scripts (it sources bench/common.sh): what they share on the
# test bed of emulated hosts (scripts/netbed, docs/netbed.md). The script sets `root` first.
source "$root/bench/common.sh"

# netbed_settings DEFAULT_RATES: reads HOSTS (default 4), RATES (default DEFAULT_RATES) and ROUNDS
# (default 1) into hosts, rates (an array) and rounds, sets python and netbed, and dies, naming
# the setting, unless they are usable, torch.distributed imports and the bed can be made here.
netbed_settings() {
  python="${TROUPE_PYTHON:-$root/.venv/bin/python}"  # the torch troupe is built against
  netbed="$root/scripts/netbed"
  hosts=${HOSTS:-4}
  read -r -a rates <<<"${RATES:-$1}"
  rounds=${ROUNDS:-1}
  need_positive_int HOSTS "$hosts"
  need_positive_int ROUNDS "$rounds"
  need_torch "$python"
  "$netbed" check >/dev/null
}

# sent_mb BYTES_FILE [DECIMALS]: what each host sent over its link during a run (the `bytes` file
# netbed run writes), in MB (1e6), as "a/b/c/d"; "?" when the file is missing.
sent_mb() {
  awk -v d="${2:-0}" '{printf "%s%.*f", (NR > 1 ? "/" : ""), d, $6 / 1e6}' "$1" 2>/dev/null || echo "?"
}
