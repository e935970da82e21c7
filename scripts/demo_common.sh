# Sourced by scripts/router_demo.sh and scripts/cluster_demo.sh once DEMO (the demo's name), MODEL, VENV and WORK
# (the folder of its logs) are set: `fail MESSAGE` (the message, each log's last lines, exit 1) and
# `need_model_and_venv` (the checkpoint and `make setup`'s tokenloop are there).

fail() {
    echo "$DEMO: $1" >&2
    for log in "$WORK"/*.log; do [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }; done
    exit 1
}

need_model_and_venv() {
    [ -f "$MODEL/config.json" ] || fail "no model in $MODEL (run \`make model\`)"
    [ -x "$VENV/bin/tokenloop" ] || fail "no $VENV/bin/tokenloop (run \`make setup\`)"
}
