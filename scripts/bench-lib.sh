# The server/client runner of scripts/bench-guest, apart so that its retry rule is tested
# on the host (tests/bench_runner.rs). Expects: out (output folder), port, fail, and pin.

# once NAME SERVER_CMD... -- CLIENT_ARGS...: one server/client run; the client's output is
# kept. Fails when either side does.
once() {
  local name=$1; shift
  local -a srv=() ; while [ "$1" != "--" ]; do srv+=("$1"); shift; done; shift
  port=$((port + 1))
  pin 0 timeout 300 "${srv[@]}" -p "$port" > "$out/$name.server.txt" 2>&1 &
  local spid=$! ok=0
  sleep 1
  pin 1 timeout 300 "${srv[@]}" -p "$port" "$@" > "$out/$name.txt" 2>&1 || ok=1
  wait "$spid" || ok=1
  return $ok
}

# pair NAME ...: as once. rfabric's own runs decide the exit status. A reference run
# (perftest, named ib_*) that fails is tried once more, since perftest's server gives up
# on a busy machine ("Correlation coefficient r^2 < 0.9, Can't produce a report"); if it
# fails again it is marked missing in the table, and the exit status stays rfabric's.
pair() {
  local name=$1
  once "$@" && return 0
  case "$name" in
    ib_*)
      echo "reference run $name failed; trying once more: $(tail -1 "$out/$name.server.txt")"
      once "$@" && return 0
      echo "reference run $name failed twice: missing in the table (see $out/$name.failed.txt)"
      mv "$out/$name.txt" "$out/$name.failed.txt"
      ;;
    *)
      echo "FAILED: $name (see $out/$name.txt)"; cat "$out/$name.txt" "$out/$name.server.txt"
      fail=1
      ;;
  esac
}

