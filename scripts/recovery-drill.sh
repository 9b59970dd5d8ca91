#!/usr/bin/env bash
# Recovery drill: proves that a troupe team loses and repeats no message while its processes are
# killed. It starts a team of 4 teammates on the replay provider (a generated cassette, no
# network), floods them from several concurrent `lead send` loops, and meanwhile `kill -9`s random
# workers and the `lead run` supervisor itself (restarting it). Then it checks from the
# transcripts that every id `lead send` returned was consumed exactly once, by its recipient; that
# no request is left pending; and that no process of the team outlived `lead stop`.
#
# With --redis it does the same to a team spread over two hosts (issue 15): it starts its own
# redis-server (AUTH, appendonly, appendfsync always) on a free loopback port, two supervisors
# (`lead run --host a` and `--host b`, each with its own team dir and working dir, sharing only
# Redis), places t1 and t2 on host a and t3 and t4 on host b, kills workers on both hosts and
# the supervisors in turn, and restarts redis-server (kill -9) --redis-restarts times.
#
# stdout gets exactly one line:  sent=N consumed=N duplicates=0 lost=0 kills=K lead_kills=L
# (consumed counts the drill's messages only, not the spawn tasks or the team stop's requests).
# Exit 0 when all checks pass, 1 with a one-line reason on stderr when one fails, 2 on bad usage.
# Progress goes to stderr.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/recovery-drill.sh [--kills N] [--lead-kills L] [--senders S] [--messages M]
                                 [--think-ms MS] [--bin DIR] [--keep]
                                 [--redis [--redis-restarts R]]
  --kills N       kill -9 of a random live worker, N times (default 20)
  --lead-kills L  kill -9 of the `lead run` supervisor, then start a new one, L times (default 1)
  --senders S     concurrent shell senders (default 3)
  --messages M    messages per sender (default 300)
  --think-ms MS   how long each replayed model call takes (default 50), so that many kills land
                  inside an activation rather than on an idle worker
  --bin DIR       where `lead` and `worker` are (default target/release if it has both, else
                  target/debug)
  --keep          keep the temporary team dir (it is kept anyway when a check fails)
  --redis         two hosts sharing a Redis bus (needs redis-server and redis-cli on PATH)
  --redis-restarts R  kill -9 and restart of redis-server during the flood (default 1)
Prints one summary line: sent=N consumed=N duplicates=0 lost=0 kills=K lead_kills=L
EOF
}

die_usage() {
  echo "recovery-drill: $1" >&2
  usage >&2
  exit 2
}

KILLS=20 LEAD_KILLS=1 SENDERS=3 MESSAGES=300 THINK_MS=50 BIN="" KEEP=0 REDIS=0 REDIS_RESTARTS=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kills) KILLS=${2-}; shift 2 || die_usage "--kills needs a value" ;;
    --lead-kills) LEAD_KILLS=${2-}; shift 2 || die_usage "--lead-kills needs a value" ;;
    --senders) SENDERS=${2-}; shift 2 || die_usage "--senders needs a value" ;;
    --messages) MESSAGES=${2-}; shift 2 || die_usage "--messages needs a value" ;;
    --think-ms) THINK_MS=${2-}; shift 2 || die_usage "--think-ms needs a value" ;;
    --bin) BIN=${2-}; shift 2 || die_usage "--bin needs a value" ;;
    --keep) KEEP=1; shift ;;
    --redis) REDIS=1; shift ;;
    --redis-restarts) REDIS_RESTARTS=${2-}; shift 2 || die_usage "--redis-restarts needs a value" ;;
    -h | --help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done
for v in KILLS LEAD_KILLS SENDERS MESSAGES THINK_MS REDIS_RESTARTS; do
  if ! [[ ${!v} =~ ^[0-9]+$ ]]; then
    flag=${v,,}
    die_usage "--${flag//_/-} must be a non-negative integer, not '${!v}'"
  fi
done
[[ $SENDERS -ge 1 ]] || die_usage "--senders must be at least 1"
[[ $REDIS == 1 ]] || REDIS_RESTARTS=0

ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z $BIN ]]; then
  for d in "$ROOT/target/release" "$ROOT/target/debug"; do
    if [[ -x $d/lead && -x $d/worker ]]; then BIN=$d; break; fi
  done
  [[ -n $BIN ]] || { echo "recovery-drill: no lead and worker in target/release or target/debug; run cargo build --release" >&2; exit 2; }
fi
[[ -x $BIN/lead && -x $BIN/worker ]] || { echo "recovery-drill: no lead and worker binaries in $BIN" >&2; exit 2; }
BIN=$(cd "$BIN" && pwd)
command -v python3 >/dev/null || { echo "recovery-drill: python3 is required" >&2; exit 2; }
if [[ $REDIS == 1 ]]; then
  for c in redis-server redis-cli; do
    command -v $c >/dev/null || { echo "recovery-drill: --redis needs $c on PATH" >&2; exit 2; }
  done
fi

NAMES=(t1 t2 t3 t4)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/troupe-drill.XXXXXX")
# One host (no name) on the files; hosts a and b on Redis, each with its own team dir and
# working dir. TEAM (host a's) is where the CLI runs from.
if [[ $REDIS == 1 ]]; then HOSTS=(a b); else HOSTS=(""); fi
TEAMS=() WORKS=()
for h in "${HOSTS[@]}"; do
  TEAMS+=("$TMP/${h:-one}/team")
  WORKS+=("$TMP/${h:-one}/work")
  mkdir -p "$TMP/${h:-one}/work"
done
TEAM=${TEAMS[0]}
mkdir -p "$TMP/sent" "$TMP/bin"
# The drill runs copies: a `cargo build` during the drill (another shell on the same tree) must
# not mix two builds in one team. `lead run` starts the `worker` next to its own binary.
cp "$BIN/lead" "$BIN/worker" "$TMP/bin/"
LEAD=$TMP/bin/lead
WORKER=$TMP/bin/worker
# Every drill message carries this tag, so the checks can tell them from the spawn tasks and the
# team stop's shutdown requests.
TAG="drill-$(basename "$TMP")"
START=$SECONDS

log() { echo "recovery-drill: $*" >&2; }
# A check failed during the drill: say why on stderr and exit 1 (the team dir is kept).
fail() {
  FAILED=1
  echo "recovery-drill: FAIL: $*" >&2
  exit 1
}
bc_sub() { python3 -c 'import sys; print(float(sys.argv[1]) - float(sys.argv[2]))' "$1" "$2"; }

LEAD_PIDS=()
REDIS_PID=""
SENDER_PIDS=()
HELPER_PID=""
FAILED=0

# Ends every process this drill started: the senders, the supervisor (which takes its workers
# with it), and whatever still names the team dir (orphaned workers), each by its pid.
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  local p
  for p in "${SENDER_PIDS[@]}" $HELPER_PID; do
    kill -9 "$p" 2>/dev/null && wait "$p" 2>/dev/null
  done
  local running=0
  for p in "${LEAD_PIDS[@]}"; do
    [[ -n $p ]] && kill -0 "$p" 2>/dev/null && running=1
  done
  if [[ $running == 1 ]]; then
    "$LEAD" --team-dir "$TEAM" stop --timeout 15 >/dev/null 2>&1 || true
    for p in "${LEAD_PIDS[@]}"; do [[ -n $p ]] && kill -9 "$p" 2>/dev/null; done
  fi
  for p in $(team_pids); do kill -9 "$p" 2>/dev/null || true; done
  [[ -n $REDIS_PID ]] && kill -9 "$REDIS_PID" 2>/dev/null
  wait 2>/dev/null || true
  if [[ $KEEP == 1 || $FAILED == 1 || $rc != 0 ]]; then
    log "team dir kept: $TMP"
  else
    rm -rf "$TMP"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Whether the command line of process $1 names one of the team dirs.
names_a_team() {
  local t
  for t in "${TEAMS[@]}"; do
    grep -qF -- "$t" "/proc/$1/cmdline" 2>/dev/null && return 0
  done
  return 1
}

# Live (not zombie) processes whose command line names a team dir.
team_pids() {
  local d pid state
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    names_a_team "$pid" || continue
    state=$(sed -e 's/^.*) //' "$d/stat" 2>/dev/null | cut -c1) || continue
    [[ -n $state && $state != Z ]] && echo "$pid"
  done
  return 0
}

# --- the no-network provider ---------------------------------------------------------------------
unset ANTHROPIC_API_KEY OPENAI_API_KEY OPENAI_BASE_URL ANTHROPIC_BASE_URL MODEL_ID \
  TROUPE_RECORD TROUPE_REPLAY_PROGRESS TROUPE_TEAM_DIR NOTIFY_SOCKET
export TROUPE_PROVIDER=replay TROUPE_CASSETTE=$TMP/cassette.jsonl TROUPE_REPLAY_PACE_MS=$THINK_MS
# One model call per drained batch: at most one per message, plus the spawn task, the team stop's
# shutdown request, and a margin.
CALLS=$((SENDERS * MESSAGES + 100))
python3 - "$TROUPE_CASSETTE" "$CALLS" "${NAMES[@]}" <<'EOF'
import json, sys
path, calls, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
resp = {"content": [{"type": "text", "text": "ack"}], "stop_reason": "end_turn"}
with open(path, "w") as f:
    for n in names:
        for seq in range(calls):
            f.write(json.dumps({"agent": n, "seq": seq, "response": resp}) + "\n")
EOF

# --- the bus (with --redis) -----------------------------------------------------------------------
REDIS_DIR=$TMP/redis
# redis-cli as the default user (the troupe user may not PING).
admin_cli() { redis-cli -p "$REDIS_PORT" --user default --pass "$ADMIN_PASSWORD" --no-auth-warning "$@"; }
# The server's ACL log of refused commands and keys goes to $TMP/acl-denied: a refusal means
# the troupe user's command list below lacks a command that troupe sends, also where troupe only
# logged the error and carried on. Not counted: failed logins, and the client library's CLIENT
# SETINFO at connect (Redis 7.2+), whose refusal it ignores. Read before each kill, since the
# log lives in the server's memory.
keep_acl_denials() {
  admin_cli --json acl log 2>/dev/null | python3 -c '
import json, sys
text = sys.stdin.read().strip()
for entry in (json.loads(text) if text else []):
    e = dict(zip(entry[0::2], entry[1::2])) if isinstance(entry, list) else entry
    if e.get("reason") != "auth" and e.get("object") != "client|setinfo":
        print(" ".join(f"{k}={e[k]}" for k in ("reason", "context", "object", "username") if k in e))
' >>"$TMP/acl-denied" || true
}
start_redis() {
  redis-server "$REDIS_DIR/redis.conf" </dev/null >/dev/null 2>&1 &
  REDIS_PID=$!
  local deadline=$((SECONDS + 10))
  until admin_cli ping 2>/dev/null | grep -q PONG; do
    if [[ $SECONDS -ge $deadline ]]; then
      fail "redis-server not up within 10 s (see $REDIS_DIR/redis.log)"
    fi
    sleep 0.02
  done
}
if [[ $REDIS == 1 ]]; then
  mkdir -p "$REDIS_DIR"
  REDIS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  TROUPE_BUS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  ADMIN_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  # The default user keeps its rights under a password of its own: Redis 7.0 replays its
  # append-only log's transactions as the default user. The troupe user gets the rights
  # docs/redis.md gives: its keys, no channel, exactly the commands troupe sends
  # (tests/support/redis_server.rs, TROUPE_ACL, says which is for what).
  cat >"$REDIS_DIR/redis.conf" <<EOF
port $REDIS_PORT
bind 127.0.0.1
dir $REDIS_DIR
logfile $REDIS_DIR/redis.log
appendonly yes
appendfsync always
save ""
user default on >$ADMIN_PASSWORD ~* &* +@all
user troupe on >$TROUPE_BUS_PASSWORD resetkeys ~troupe:* resetchannels -@all +auth +select +get +mget +set +del +exists +pexpire +sadd +smembers +sismember +zadd +zrem +zrank +zcard +zrangebyscore +zremrangebyscore +time +xadd +xrange +xrevrange +xread +xdel +xlen +incrby +decrby +evalsha +script|load
EOF
  export TROUPE_BUS="redis://troupe@127.0.0.1:$REDIS_PORT/0?team=drill" TROUPE_BUS_PASSWORD
  start_redis
fi

# kill -9 of redis-server, and a new one on the same files (its append-only log brings back what
# it acknowledged).
restart_redis() {
  keep_acl_denials
  kill -9 "$REDIS_PID"
  wait "$REDIS_PID" 2>/dev/null || true
  start_redis
  REDIS_RESTARTS_DONE=$((REDIS_RESTARTS_DONE + 1))
  log "redis restart $REDIS_RESTARTS_DONE: redis-server killed with SIGKILL and up again"
}

lead() { "$LEAD" --team-dir "$TEAM" "$@"; }

# Starts the `lead run` of host index $1 in the background and waits until its lead.lock says it
# is ready.
start_lead() {
  local i=$1 host_args=()
  [[ -n ${HOSTS[$i]} ]] && host_args=(--host "${HOSTS[$i]}")
  (cd "${WORKS[$i]}" && exec "$LEAD" --team-dir "${TEAMS[$i]}" run --workdir "${WORKS[$i]}" \
    --restart-delay 0.05 --restart-delay-max 0.5 --max-restarts 1000000 \
    --stop-timeout 2 --kill-grace 2 "${host_args[@]}") </dev/null >>"$TMP/lead-run-$i.log" 2>&1 &
  LEAD_PIDS[$i]=$!
  local pid=$! deadline=$((SECONDS + 30)) text
  while :; do
    text=$(cat "${TEAMS[$i]}/lead.lock" 2>/dev/null || true)
    [[ $text == "$pid ready"* ]] && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      fail "lead run exited during start-up (see $TMP/lead-run-$i.log)"
    fi
    if [[ $SECONDS -ge $deadline ]]; then
      fail "lead run not ready within 30 s"
    fi
    sleep 0.01
  done
}

# --- the team ------------------------------------------------------------------------------------
for ((j = 0; j < ${#NAMES[@]}; j++)); do
  # On two hosts: the first half on a, the rest on b.
  place=()
  [[ $REDIS == 1 ]] && place=(--host "${HOSTS[$((j * ${#HOSTS[@]} / ${#NAMES[@]}))]}")
  lead spawn "${NAMES[$j]}" --role drill --prompt "Acknowledge every message." "${place[@]}" >/dev/null
done
for ((i = 0; i < ${#HOSTS[@]}; i++)); do start_lead "$i"; done
log "team of ${#NAMES[@]} up on ${#HOSTS[@]} host(s) (supervisors ${LEAD_PIDS[*]}, binaries from $BIN), dir $TMP"

# --- the flood -----------------------------------------------------------------------------------
# Sender I sends M messages to random teammates; every id `lead send` returned goes to
# sent/I as "ID NAME". A failed send is retried (a new message, a new id); after 5 failures the
# message counts as not sent (sent/I.failed). The senders keep pace with the kills (the file
# `progress` counts the kills done): message K waits until (K-1)/M of them are done, so that
# every kill, the last ones too, lands in traffic rather than on a team that went quiet.
EVENTS=$((KILLS + LEAD_KILLS + REDIS_RESTARTS))
# On a bus a send may meet redis-server restarting: it is retried for longer.
TRIES=5
[[ $REDIS == 1 ]] && TRIES=100
echo 0 >"$TMP/progress"
sender() {
  local i=$1 k try out id to done=0
  RANDOM=$((BASHPID + i * 7919))
  for ((k = 1; k <= MESSAGES; k++)); do
    while ((done * MESSAGES < (k - 1) * EVENTS)); do
      read -r done <"$TMP/progress" || done=0
      ((done * MESSAGES >= (k - 1) * EVENTS)) || sleep 0.01
    done
    to=${NAMES[RANDOM % ${#NAMES[@]}]}
    for ((try = 1; try <= TRIES; try++)); do
      if out=$("$LEAD" --team-dir "$TEAM" send "$to" "$TAG s$i m$k" --json 2>>"$TMP/sent/$i.err"); then
        id=${out#*\"id\":\"}
        id=${id%%\"*}
        if [[ $id =~ ^[0-9a-f-]{36}$ ]]; then
          echo "$id $to" >>"$TMP/sent/$i"
          break
        fi
        echo "unparsable output of lead send: $out" >>"$TMP/sent/$i.err"
      fi
      [[ $try == "$TRIES" ]] && echo "s$i m$k $to" >>"$TMP/sent/$i.failed"
      sleep 0.05
    done
  done
  date +%s.%N >"$TMP/sent/$i.done"
}
for ((i = 1; i <= SENDERS; i++)); do
  : >"$TMP/sent/$i"
  sender "$i" &
  SENDER_PIDS+=($!)
done
FLOOD_START=$(date +%s.%N)

# --- the kills -----------------------------------------------------------------------------------
# The live workers of the team, from `lead status --json`, each checked in /proc (our worker
# binary, its command line names this team dir, not a zombie) so that a stale pid hits nothing
# else.
live_workers() {
  local p state
  for p in $(lead status --json 2>/dev/null | grep -o '"pid":[0-9]\+' | cut -d: -f2); do
    is_live_worker "$p" && echo "$p"
  done
  return 0
}
is_live_worker() {
  local state
  names_a_team "$1" || return 1
  [[ $(readlink "/proc/$1/exe" 2>/dev/null) == "$WORKER" ]] || return 1
  state=$(sed -e 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
  [[ -n $state && $state != Z ]]
}
random_worker() {
  local pids
  mapfile -t pids < <(live_workers)
  [[ ${#pids[@]} -gt 0 ]] || return 1
  echo "${pids[RANDOM % ${#pids[@]}]}"
}

# kill -9 of the supervisor while every teammate has a live worker (waited for, bounded), so that
# the kill leaves orphans: they must die of PDEATHSIG, and the new supervisor must find their
# members dead and restart them.
# On two hosts the supervisors are killed in turn, each with its own host's workers as orphans
# (its successor waits for the dead one's lease to lapse).
kill_lead() {
  local i=$((LEAD_KILLS_DONE % ${#HOSTS[@]}))
  local old=${LEAD_PIDS[$i]} orphans=() deadline=$((SECONDS + 10)) p want
  want=$((${#NAMES[@]} / ${#HOSTS[@]}))
  while :; do
    orphans=()
    for p in $(live_workers); do
      grep -qF -- "${TEAMS[$i]}" "/proc/$p/cmdline" 2>/dev/null && orphans+=("$p")
    done
    [[ ${#orphans[@]} -ge $want || $SECONDS -ge $deadline ]] && break
    sleep 0.01
  done
  kill -9 "$old"
  wait "$old" 2>/dev/null || true
  LEAD_KILLS_DONE=$((LEAD_KILLS_DONE + 1))
  start_lead "$i"
  deadline=$((SECONDS + 10))
  for p in "${orphans[@]}"; do
    while [[ -d /proc/$p ]] && is_live_worker "$p"; do
      if [[ $SECONDS -ge $deadline ]]; then
        fail "worker $p outlived the supervisor it was started by (kill -9 of $old) by 10 s"
      fi
      sleep 0.01
    done
  done
  log "lead kill $LEAD_KILLS_DONE: supervisor $old${HOSTS[$i]:+ of host ${HOSTS[$i]}} killed with ${#orphans[@]} live workers (all gone since), ${LEAD_PIDS[$i]} ready"
}

# The L lead kills are spread evenly among the N worker kills.
KILLS_DONE=0 LEAD_KILLS_DONE=0 REDIS_RESTARTS_DONE=0
declare -A LEAD_KILL_AT=() REDIS_RESTART_AT=()
for ((j = 1; j <= LEAD_KILLS; j++)); do
  LEAD_KILL_AT[$(((j * EVENTS) / (LEAD_KILLS + 1)))]=1
done
# Redis restarts fall between the lead kills (the first at a third of the way, if any).
for ((j = 1; j <= REDIS_RESTARTS; j++)); do
  at=$(((j * EVENTS) / (REDIS_RESTARTS + 1) + EVENTS / (3 * (REDIS_RESTARTS + 1)) ))
  while [[ -n ${LEAD_KILL_AT[$at]-} || -n ${REDIS_RESTART_AT[$at]-} ]]; do at=$((at + 1)); done
  REDIS_RESTART_AT[$at]=1
done
next=0
for ((e = 0; e < EVENTS; e++)); do
  # Written whole (rename), so a sender never reads a half-written count.
  echo "$e" >"$TMP/progress.new" && mv "$TMP/progress.new" "$TMP/progress"
  sleep "0.$(printf '%03d' $((20 + RANDOM % 181)))"
  if [[ -n ${LEAD_KILL_AT[$e]-} ]]; then
    kill_lead
    continue
  fi
  if [[ -n ${REDIS_RESTART_AT[$e]-} ]]; then
    restart_redis
    continue
  fi
  # A worker may be between a kill and its restart: wait (bounded) for one to be up.
  tries=0
  until pid=$(random_worker); do
    tries=$((tries + 1))
    if [[ $tries -ge 1000 ]]; then
      fail "no live worker to kill for 10 s (see lead status)"
    fi
    sleep 0.01
  done
  if kill -9 "$pid" 2>/dev/null; then
    KILLS_DONE=$((KILLS_DONE + 1))
  else
    e=$((e - 1)) # it exited on its own meanwhile: pick another
  fi
  if [[ $((KILLS_DONE % 25)) == 0 && $KILLS_DONE -gt $next ]]; then
    next=$KILLS_DONE
    log "$KILLS_DONE worker kills"
  fi
done
KILLS_END=$(date +%s.%N)
echo "$EVENTS" >"$TMP/progress.new" && mv "$TMP/progress.new" "$TMP/progress"
for p in "${SENDER_PIDS[@]}"; do wait "$p"; done
SENDER_PIDS=()
FLOOD_END=$(sort -n "$TMP"/sent/*.done | tail -1)
log "$(printf 'flood done after %.1f s, kills after %.1f s' "$(bc_sub "$FLOOD_END" "$FLOOD_START")" \
  "$(bc_sub "$KILLS_END" "$FLOOD_START")"): $KILLS_DONE worker kills, $LEAD_KILLS_DONE lead kills"

# --- the checks ----------------------------------------------------------------------------------
# check.py consume: waits (bounded) until every sent id is in its recipient's transcript.
# check.py report: prints the summary line and the failures found.
cat >"$TMP/check.py" <<'EOF'
import glob, json, os, sys, time

tmp, tag = os.environ["DRILL_TMP"], os.environ["DRILL_TAG"]
# Every host's team dir (transcripts stay on the member's host).
teams = os.environ["DRILL_TEAMS"].split(":")
on_bus = bool(os.environ.get("TROUPE_BUS"))

def sent():
    ids = {}
    for path in glob.glob(os.path.join(tmp, "sent", "*")):
        if not os.path.basename(path).isdigit():
            continue
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:
                    ids[parts[0]] = parts[1]
    return ids

def consumed():
    """Every drill message in a transcript, as (id, consumer) pairs, duplicates included."""
    seen = []
    paths = [p for team in teams for p in glob.glob(os.path.join(team, "transcripts", "*.jsonl"))]
    for path in paths:
        name = os.path.basename(path)[: -len(".jsonl")]
        with open(path, "rb") as f:
            data = f.read()
        for raw in data.split(b"\n"):
            if b'"inbox"' not in raw:
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # a torn last line of a killed writer
            if entry.get("kind") != "inbox":
                continue
            msg = entry.get("message") or {}
            if str(msg.get("content", "")).startswith(tag + " "):
                seen.append((msg.get("id"), name))
    return seen

def inboxes_empty():
    if on_bus:
        # The inboxes are streams on the server: no early verdict, the wait runs its course.
        return False
    team = teams[0]
    for name in set(sent().values()):
        try:
            if os.path.getsize(os.path.join(team, "inbox", name + ".jsonl")) > 0:
                return False
        except FileNotFoundError:
            pass
    return True

if sys.argv[1] == "consume":
    # Every sender has finished. A drain journals a batch before it truncates the inbox, so a
    # sent message is always in its recipient's inbox or transcript: once the inboxes are empty
    # (looked at before the transcripts) a message in neither is lost, and waiting is pointless.
    ids, deadline = sent(), time.monotonic() + float(sys.argv[2])
    settled = 0
    while True:
        empty = inboxes_empty()
        got = {i for i, _ in consumed()}
        missing = len(set(ids) - got)
        if missing == 0:
            sys.exit(0)
        settled = settled + 1 if empty else 0
        if settled >= 3:
            print(f"recovery-drill: {missing} sent messages are in no inbox and no transcript",
                  file=sys.stderr)
            sys.exit(1)
        if time.monotonic() >= deadline:
            print(f"recovery-drill: {missing} sent messages still unconsumed after {sys.argv[2]} s",
                  file=sys.stderr)
            sys.exit(1)
        time.sleep(0.2)

ids, seen = sent(), consumed()
counts = {}
wrong = 0
for i, who in seen:
    counts[i] = counts.get(i, 0) + 1
    if i in ids and ids[i] != who:
        wrong += 1
duplicates = sum(n - 1 for n in counts.values() if n > 1)
lost = sum(1 for i in ids if i not in counts)
unrecorded = sum(1 for i in counts if i not in ids)
failed = 0
for path in glob.glob(os.path.join(tmp, "sent", "*.failed")):
    with open(path) as f:
        failed += sum(1 for _ in f)
print(f"sent={len(ids)} consumed={len(seen)} duplicates={duplicates} lost={lost} "
      f"kills={sys.argv[2]} lead_kills={sys.argv[3]}"
      + (f" redis_restarts={sys.argv[4]}" if os.environ.get("TROUPE_BUS") else ""))
reasons = []
if lost:
    reasons.append(f"{lost} sent messages never consumed")
if duplicates:
    reasons.append(f"{duplicates} duplicate consumptions")
if wrong:
    reasons.append(f"{wrong} messages consumed by a teammate they were not sent to")
with open(os.path.join(tmp, "reasons"), "w") as f:
    f.write("; ".join(reasons))
notes = []
if unrecorded:
    notes.append(f"{unrecorded} drill messages consumed whose send reported a failure")
if failed:
    notes.append(f"{failed} messages not sent after {os.environ.get('DRILL_TRIES', 5)} attempts")
for path in [p for team in teams for p in glob.glob(os.path.join(team, "inbox", "*.corrupt.jsonl"))]:
    with open(path) as f:
        notes.append(f"{sum(1 for _ in f)} lines set aside in {os.path.basename(path)}")
if notes:
    print("recovery-drill: note: " + "; ".join(notes), file=sys.stderr)
EOF
DRILL_TEAMS=$(IFS=:; echo "${TEAMS[*]}")
export DRILL_TMP=$TMP DRILL_TEAMS DRILL_TAG=$TAG DRILL_TRIES=$TRIES

CONSUME_START=$SECONDS
# In the background, so that a signal to the drill is handled at once.
python3 "$TMP/check.py" consume 120 &
HELPER_PID=$!
wait "$HELPER_PID" || true
HELPER_PID=""
log "consumption waited $((SECONDS - CONSUME_START)) s"

REASONS=()
rc=0
lead stop --timeout 60 >/dev/null || rc=$?
if [[ $rc != 0 ]]; then
  REASONS+=("lead stop exited $rc")
  for p in "${LEAD_PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
fi
for p in "${LEAD_PIDS[@]}"; do
  rc=0
  wait "$p" || rc=$?
  [[ $rc == 0 ]] || REASONS+=("lead run (pid $p) exited $rc after lead stop")
done
LEAD_PIDS=()

if pending=$(lead requests --status pending --json); then
  npending=$(python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' <<<"$pending")
  [[ $npending == 0 ]] || REASONS+=("$npending requests left pending")
else
  REASONS+=("lead requests --status pending failed")
fi

# Processes in their last moments get a second to go.
orphans=$(team_pids)
for _ in 1 2 3 4 5 6 7 8 9 10; do
  [[ -z $orphans ]] && break
  sleep 0.1
  orphans=$(team_pids)
done
[[ -z $orphans ]] || REASONS+=("orphaned processes of the team: $(echo $orphans)")

if [[ $REDIS == 1 ]]; then
  keep_acl_denials
  if [[ -s $TMP/acl-denied ]]; then
    REASONS+=("the server refused the troupe user $(sort "$TMP/acl-denied" | uniq -c | sed 's/^ *//' | paste -sd, -)")
  fi
fi

python3 "$TMP/check.py" report "$KILLS_DONE" "$LEAD_KILLS_DONE" "$REDIS_RESTARTS_DONE"
r=$(cat "$TMP/reasons")
[[ -z $r ]] || REASONS=("$r" "${REASONS[@]}")
log "total $((SECONDS - START)) s"
if [[ ${#REASONS[@]} -gt 0 ]]; then
  FAILED=1
  (IFS=';'; echo "recovery-drill: FAIL: ${REASONS[*]}" >&2)
  exit 1
fi
