#!/usr/bin/env bash
# Start or stop one reference server in the background, by name, for runs by hand: its process
# id goes to a file of its own and its output to a log, and `start` returns once the server
# answers GET /v1/models (or fails with the log's tail if the server exits first).
#   bash bench/peers/server_ctl.sh start NAME PORT -- COMMAND...   (waits up to TIMEOUT_S, 600)
#   bash bench/peers/server_ctl.sh stop NAME        (SIGTERM to its process group, SIGKILL after 60 s)
#   bash bench/peers/server_ctl.sh status NAME
# e.g. bash bench/peers/server_ctl.sh start vllm 8102 -- bash bench/peers/vllm_serve.sh 8102 --dtype bfloat16
# Files: $PEERS/run/NAME.pid and $PEERS/logs/NAME.log (PEERS defaults to ~/.cache/tessera/peers).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 start NAME PORT -- COMMAND... | stop NAME | status NAME" >&2; exit 2; }
ACTION=$1 NAME=$2
PEERS=${PEERS:-${TESSERA_CACHE:-$HOME/.cache/tessera}/peers}
PIDFILE=$PEERS/run/$NAME.pid
LOG=$PEERS/logs/$NAME.log
mkdir -p "$PEERS/run" "$PEERS/logs"
alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

case "$ACTION" in
  start)
    [ $# -ge 5 ] && [ "$4" = "--" ] || { echo "usage: $0 start NAME PORT -- COMMAND..." >&2; exit 2; }
    PORT=$3; shift 4
    if alive; then echo "$NAME is already running (pid $(cat "$PIDFILE"))" >&2; exit 1; fi
    setsid "$@" > "$LOG" 2>&1 &   # its own process group: stop reaches every process it starts
    echo $! > "$PIDFILE"
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "${TIMEOUT_S:-600}" ]; do
      if curl -sf --noproxy '*' "http://127.0.0.1:$PORT/v1/models" > /dev/null; then
        echo "$NAME up on port $PORT (pid $(cat "$PIDFILE"), $(( $(date +%s) - t0 )) s; log $LOG)"; exit 0
      fi
      if ! alive; then echo "$NAME exited; the end of $LOG:" >&2; tail -20 "$LOG" >&2; rm -f "$PIDFILE"; exit 1; fi
      sleep 1
    done
    echo "$NAME did not answer on port $PORT within ${TIMEOUT_S:-600} s (still running; log $LOG)" >&2; exit 1 ;;
  stop)
    alive || { echo "$NAME is not running"; rm -f "$PIDFILE"; exit 0; }
    PID=$(cat "$PIDFILE")
    kill -TERM -- "-$PID" 2>/dev/null || kill -TERM "$PID"
    for _ in $(seq 60); do
      kill -0 "$PID" 2>/dev/null || { rm -f "$PIDFILE"; echo "$NAME stopped"; exit 0; }
      sleep 1
    done
    kill -KILL -- "-$PID" 2>/dev/null || kill -KILL "$PID" 2>/dev/null || true
    rm -f "$PIDFILE"; echo "$NAME killed after 60 s" ;;
  status)
    if alive; then echo "$NAME running (pid $(cat "$PIDFILE"))"; else echo "$NAME not running"; exit 1; fi ;;
  *) echo "unknown action $ACTION (start, stop, status)" >&2; exit 2 ;;
esac
