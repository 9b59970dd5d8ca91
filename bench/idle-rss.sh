#!/bin/bash
# Idle worker RSS of two or more builds, measured the same way in turns: for each build dir
# (holding `lead` and `worker`), a team of five on the replay provider, sandbox off, no
# OTEL_EXPORTER_OTLP_ENDPOINT; VmRSS and RssAnon of each idle worker, in kB.
#
#   bench/idle-rss.sh ROUNDS DIR...    e.g. bench/idle-rss.sh 4 /tmp/before /tmp/after
#
# Most of an idle worker's RSS is the binary's pages, so it depends on the page cache: copy
# every build the same way (cp), and drop the caches first (as root:
# `sync; echo 3 > /proc/sys/vm/drop_caches`), or the comparison measures the cache.
set -euo pipefail
rounds=$1; shift
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cat > "$scratch/cas.jsonl" <<'JSON'
{"agent":"*","seq":0,"response":{"content":[{"type":"text","text":"ack"}],"stop_reason":"end_turn"}}
JSON
unset OTEL_EXPORTER_OTLP_ENDPOINT
export TROUPE_PROVIDER=replay TROUPE_CASSETTE="$scratch/cas.jsonl" TROUPE_RECORD= \
    TROUPE_REPLAY_PROGRESS= TROUPE_REPLAY_PACE_MS=
for ((r = 0; r < rounds; r++)); do
    for dir in "$@"; do
        t=$(mktemp -d "$scratch/t.XXXX")
        mkdir "$t/work"
        export TROUPE_TEAM_DIR="$t/team" TROUPE_WORKER="$dir/worker"
        "$dir/lead" run --sandbox off --workdir "$t/work" > "$t/run.log" 2>&1 &
        run=$!
        for i in 1 2 3 4 5; do
            "$dir/lead" spawn "w$i" --role r --prompt hi > /dev/null
        done
        # Each worker answers once ("ack") and goes idle.
        for _ in $(seq 100); do
            [ "$("$dir/lead" status --json | grep -o '"status": *"idle"' | wc -l)" = 5 ] && break
            sleep 0.1
        done
        sleep 1
        for p in $(pgrep -f "^$dir/worker"); do
            awk -v d="$dir" '/^VmRSS/ {r = $2} /^RssAnon/ {a = $2} END {print d, r, a}' "/proc/$p/status"
        done
        "$dir/lead" stop > /dev/null
        wait "$run" || true
    done
done | awk '{s[$1] += $2; a[$1] += $3; n[$1]++; if (!($1 in lo) || $2 < lo[$1]) lo[$1] = $2; if ($2 > hi[$1]) hi[$1] = $2}
    END {for (d in s) printf "%s: VmRSS mean %.0f kB (min %d, max %d), RssAnon mean %.0f kB, %d workers\n", d, s[d] / n[d], lo[d], hi[d], a[d] / n[d], n[d]}'
