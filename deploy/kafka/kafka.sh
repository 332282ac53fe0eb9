#!/usr/bin/env bash
# Apache Kafka (KRaft) brokers for PRME development and tests, without Docker.
#
#   kafka.sh fetch                  fetch the broker jars with Maven (once; cached)
#   kafka.sh start DATA_DIR         format (first time) and start a broker; prints 127.0.0.1:PORT last
#   kafka.sh stop DATA_DIR          SIGTERM, then SIGKILL after PRME_KAFKA_STOP_TIMEOUT seconds
#   kafka.sh kill DATA_DIR          SIGKILL at once (a crash, for fault tests)
#   kafka.sh status DATA_DIR        exit 0 and print the bootstrap address when running
#   kafka.sh cluster-start DIR [N]  N (default 3) replicated brokers in DIR/b1..bN; prints the
#                                   bootstrap list last; restarts any stopped node of DIR
#   kafka.sh cluster-stop DIR       stop every node of the cluster in DIR
#   kafka.sh cluster-status DIR     one status line per node; exit 0 when all run
# A cluster node DIR/bI is an ordinary data directory: start, stop and kill it alone.
#
# Environment: PRME_KAFKA_CACHE (jar cache, default ~/.cache/prme/kafka-libs),
# PRME_KAFKA_START_TIMEOUT (default 90), PRME_KAFKA_STOP_TIMEOUT (default 30),
# PRME_KAFKA_HEAP (default 1g), PRME_PYTHON (an interpreter with aiokafka for the readiness
# probe; default: the project's .venv/bin/python when there is one, else python3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIBS="${PRME_KAFKA_CACHE:-$HOME/.cache/prme/kafka-libs}"
ROOT="$(cd "$HERE/../.." && pwd)"
if [[ -n "${PRME_PYTHON:-}" ]]; then PYTHON="$PRME_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"
else PYTHON="python3"; fi
START_TIMEOUT="${PRME_KAFKA_START_TIMEOUT:-90}"
STOP_TIMEOUT="${PRME_KAFKA_STOP_TIMEOUT:-30}"
HEAP="${PRME_KAFKA_HEAP:-1g}"

die() { echo "kafka.sh: $*" >&2; exit 1; }

usage() {
    sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

fetched() { [[ -f "$LIBS/.complete" ]] && compgen -G "$LIBS/kafka_2.13-*.jar" >/dev/null; }

cmd_fetch() {
    if fetched; then
        echo "$LIBS"
        return 0
    fi
    command -v mvn >/dev/null || die "mvn not found (install Maven)"
    local tmp="$LIBS.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    (cd "$HERE" && mvn -B -q dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory="$tmp") >&2 || { rm -rf "$tmp"; die "maven fetch failed"; }
    touch "$tmp/.complete"
    rm -rf "$LIBS"
    mkdir -p "$(dirname "$LIBS")"
    mv "$tmp" "$LIBS"
    echo "$LIBS"
}

# The readiness probe talks to the broker through aiokafka: check the interpreter has it
# before starting anything, and say so plainly when it does not.
check_probe() {
    local error
    if ! error="$("$PYTHON" -c 'import aiokafka' 2>&1)"; then
        die "the readiness probe needs aiokafka, but $PYTHON cannot import it: $(tail -n 1 <<<"$error")
  (run 'make setup' to create .venv, or set PRME_PYTHON to an interpreter with the project installed)"
    fi
}

pid_alive() { [[ -f "$1/kafka.pid" ]] && kill -0 "$(cat "$1/kafka.pid")" 2>/dev/null; }

free_port() {
    "$PYTHON" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Blocks until the cluster at $1 describes at least $3 brokers (default 1), any of the
# processes in $2 (comma-separated pids) dies, or the deadline.
wait_ready() {
    "$PYTHON" - "$1" "$2" "$START_TIMEOUT" "${3:-1}" <<'PY'
import asyncio, logging, os, sys, time

from aiokafka.admin import AIOKafkaAdminClient

logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

bootstrap, pids, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
brokers = int(sys.argv[4])


def alive() -> bool:
    try:
        for pid in pids.split(","):
            os.kill(int(pid), 0)
    except OSError:
        return False
    return True


async def probe() -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        await asyncio.wait_for(admin.start(), 10)
        cluster = await asyncio.wait_for(admin.describe_cluster(), 10)
        return len(cluster.get("brokers") or []) >= brokers
    except Exception:
        return False
    finally:
        await admin.close()


async def main() -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return 2
        if await probe():
            return 0
        await asyncio.sleep(0.5)  # poll interval of the readiness probe
    return 1


sys.exit(asyncio.run(main()))
PY
}

# new_cluster_id: a fresh KRaft cluster id (22 base64url characters, not starting with
# "-": the storage tool's parser reads "-t -Xy..." as a missing value and fails with
# "expected one argument", which once failed every broker test of a run in 1 of 64; Kafka's
# own Uuid.randomUuid skips such ids too). Python is quick; when it gives no id, Kafka's own
# storage tool makes one.
new_cluster_id() {
    local id
    id="$("$PYTHON" -c 'import base64, uuid
while (i := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
    pass
print(i)' 2>&1)" || true
    if [[ ! "$id" =~ ^[A-Za-z0-9_][A-Za-z0-9_-]{21}$ ]]; then
        echo "kafka.sh: $PYTHON gave no cluster id (${id:-no output}); asking kafka-storage" >&2
        id="$(java -cp "$LIBS/*" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)"
    fi
    [[ "$id" =~ ^[A-Za-z0-9_][A-Za-z0-9_-]{21}$ ]] || die "could not make a cluster id"
    echo "$id"
}

# format_storage DATA_DIR CLUSTER_ID [FLAGS...]: format the node's log directory once.
format_storage() {
    local data="$1" cluster_id="$2"
    shift 2
    java -cp "$LIBS/*" -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -Dprme.kafka.log="$data/format.log" \
        kafka.tools.StorageTool format "$@" -t "$cluster_id" -c "$data/server.properties" \
        >"$data/format.out" 2>&1 || { cat "$data/format.out" >&2; die "storage format failed"; }
}

# launch DATA_DIR: start the JVM of a formatted node in the background; prints its pid.
launch() {
    local data="$1"
    setsid java -Xms256m -Xmx"$HEAP" -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -Dprme.kafka.log="$data/server.log" \
        -cp "$LIBS/*" kafka.Kafka "$data/server.properties" >"$data/kafka.out" 2>&1 </dev/null &
    echo "$!" >"$data/kafka.pid"
    echo "$!"
}

# not_ready RC DIR...: report why a start failed, show the log tails and stop the nodes.
not_ready() {
    local rc="$1"
    shift
    if [[ $rc -eq 2 ]]; then echo "kafka.sh: broker exited during startup" >&2
    else echo "kafka.sh: broker not ready after ${START_TIMEOUT}s" >&2; fi
    local data
    for data in "$@"; do
        tail -n 40 "$data/kafka.out" "$data/server.log" >&2 2>/dev/null || true
        cmd_stop "$data" >/dev/null 2>&1 || true
    done
    exit 1
}

prepare() {
    fetched || cmd_fetch >/dev/null
    command -v java >/dev/null || die "java not found (install a JDK 17+)"
}

cmd_start() {
    local data="${1:-}"
    [[ -n "$data" ]] || usage
    check_probe
    mkdir -p "$data"
    data="$(cd "$data" && pwd)"
    if pid_alive "$data"; then
        cat "$data/bootstrap"
        return 0
    fi
    prepare

    if [[ ! -f "$data/logs/meta.properties" ]]; then
        # First start: pick free ports, write the config, format the storage.
        local broker_port controller_port
        broker_port="$(free_port)"
        controller_port="$(free_port)"
        while [[ "$controller_port" == "$broker_port" ]]; do controller_port="$(free_port)"; done
        sed -e "s|@BROKER_PORT@|$broker_port|g" -e "s|@CONTROLLER_PORT@|$controller_port|g" \
            -e "s|@DATA_DIR@|$data|g" "$HERE/server.properties.template" >"$data/server.properties"
        echo "127.0.0.1:$broker_port" >"$data/bootstrap"
        format_storage "$data" "$(new_cluster_id)" --standalone
    fi
    # On a restart the formatted quorum remembers the controller port: reuse the config.
    # A node of a cluster (cluster-start) restarts the same way, and rejoins its quorum.

    local bootstrap pid rc=0
    bootstrap="$(cat "$data/bootstrap")"
    pid="$(launch "$data")"
    wait_ready "$bootstrap" "$pid" || rc=$?
    [[ $rc -eq 0 ]] || not_ready "$rc" "$data"
    echo "$bootstrap"
}

cmd_cluster_start() {
    local root="${1:-}" count="${2:-3}"
    [[ -n "$root" ]] || usage
    [[ "$count" =~ ^[1-9][0-9]*$ ]] || die "node count must be a positive integer"
    check_probe
    mkdir -p "$root"
    root="$(cd "$root" && pwd)"
    if [[ -f "$root/nodes" ]]; then
        count="$(cat "$root/nodes")"
    else
        prepare
        # First start: two distinct free ports per node, a static voter set of all nodes.
        local -a ports=()
        local port i
        while ((${#ports[@]} < 2 * count)); do
            port="$(free_port)"
            [[ " ${ports[*]} " == *" $port "* ]] || ports+=("$port")
        done
        local voters="" servers=""
        for ((i = 1; i <= count; i++)); do
            voters+="${voters:+,}$i@127.0.0.1:${ports[2 * i - 1]}"
            servers+="${servers:+,}127.0.0.1:${ports[2 * i - 2]}"
        done
        local rf=$((count < 3 ? count : 3))
        local min_isr=$((rf > 1 ? rf - 1 : 1))
        local cluster_id data
        cluster_id="$(new_cluster_id)"
        for ((i = 1; i <= count; i++)); do
            data="$root/b$i"
            mkdir -p "$data"
            sed -e "s|@NODE_ID@|$i|g" -e "s|@BROKER_PORT@|${ports[2 * i - 2]}|g" \
                -e "s|@CONTROLLER_PORT@|${ports[2 * i - 1]}|g" -e "s|@VOTERS@|$voters|g" \
                -e "s|@RF@|$rf|g" -e "s|@MIN_ISR@|$min_isr|g" -e "s|@DATA_DIR@|$data|g" \
                "$HERE/cluster.properties.template" >"$data/server.properties"
            echo "127.0.0.1:${ports[2 * i - 2]}" >"$data/bootstrap"
            format_storage "$data" "$cluster_id" &
        done
        wait
        for ((i = 1; i <= count; i++)); do
            [[ -f "$root/b$i/logs/meta.properties" ]] || die "storage format of b$i failed"
        done
        echo "$servers" >"$root/bootstrap"
        echo "$count" >"$root/nodes"
    fi
    prepare
    # Every node starts at once: a controller quorum needs a majority before any broker
    # can register.
    local -a pids=() dirs=()
    local i data
    for ((i = 1; i <= count; i++)); do
        data="$root/b$i"
        dirs+=("$data")
        if pid_alive "$data"; then
            pids+=("$(cat "$data/kafka.pid")")
        else
            pids+=("$(launch "$data")")
        fi
    done
    local bootstrap rc=0
    bootstrap="$(cat "$root/bootstrap")"
    wait_ready "$bootstrap" "$(IFS=,; echo "${pids[*]}")" "$count" || rc=$?
    [[ $rc -eq 0 ]] || not_ready "$rc" "${dirs[@]}"
    echo "$bootstrap"
}

cmd_cluster_each() {
    local action="$1" root="${2:-}" rc=0 i
    [[ -n "$root" && -f "$root/nodes" ]] || die "no cluster in ${root:-?} (cluster-start first)"
    for ((i = 1; i <= $(cat "$root/nodes"); i++)); do
        echo -n "b$i: "
        "$action" "$root/b$i" || rc=$?
    done
    return "$rc"
}

cmd_stop() {
    local data="${1:-}"
    [[ -n "$data" ]] || usage
    if ! pid_alive "$data"; then
        rm -f "$data/kafka.pid"
        echo "stopped"
        return 0
    fi
    local pid
    pid="$(cat "$data/kafka.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "kafka.sh: broker did not stop in ${STOP_TIMEOUT}s; killing" >&2
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2  # poll interval while waiting for the process to exit
    done
    rm -f "$data/kafka.pid"
    echo "stopped"
}

# Every node gets SIGTERM at once: stopped one by one, the last ones would wait for a
# controller quorum that is already gone.
cmd_cluster_stop() {
    local root="${1:-}" i
    [[ -n "$root" && -f "$root/nodes" ]] || die "no cluster in ${root:-?} (cluster-start first)"
    for ((i = 1; i <= $(cat "$root/nodes"); i++)); do
        if pid_alive "$root/b$i"; then kill -TERM "$(cat "$root/b$i/kafka.pid")" 2>/dev/null || true; fi
    done
    cmd_cluster_each cmd_stop "$root"
}

cmd_kill() {
    local data="${1:-}"
    [[ -n "$data" ]] || usage
    if pid_alive "$data"; then
        local pid
        pid="$(cat "$data/kafka.pid")"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do
            sleep 0.1  # poll interval while the kernel reaps the process
        done
    fi
    rm -f "$data/kafka.pid"
    echo "killed"
}

cmd_status() {
    local data="${1:-}"
    [[ -n "$data" ]] || usage
    if pid_alive "$data"; then
        echo "running pid $(cat "$data/kafka.pid") at $(cat "$data/bootstrap")"
        return 0
    fi
    echo "stopped"
    return 3
}

case "${1:-}" in
    fetch) cmd_fetch ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    kill) cmd_kill "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    cluster-start) cmd_cluster_start "${2:-}" "${3:-3}" ;;
    cluster-stop) cmd_cluster_stop "${2:-}" ;;
    cluster-status) cmd_cluster_each cmd_status "${2:-}" ;;
    *) usage ;;
esac
