# Sourced by scripts/router_demo.sh and scripts/cluster_demo.sh once DEMO (the demo's name), MODEL, VENV and WORK
# (the folder of its logs) are set: `fail MESSAGE` (the message, each log's last lines, exit 1),
# `need_model_and_venv` (the checkpoint and `make setup`'s tokenloop are there) and `stop_processes PID...`.

fail() {
    echo "$DEMO: $1" >&2
    for log in "$WORK"/*.log; do [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }; done
    exit 1
}

need_model_and_venv() {
    [ -f "$MODEL/config.json" ] || fail "no model in $MODEL (run \`make model\`)"
    [ -x "$VENV/bin/tokenloop" ] || fail "no $VENV/bin/tokenloop (run \`make setup\`)"
}

# SIGTERM to each PID (empty ones skipped), then up to 20 s for each to exit before SIGKILL
stop_processes() {
    local pid
    for pid in "$@"; do [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "$@"; do
        [ -n "$pid" ] || continue
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
}
