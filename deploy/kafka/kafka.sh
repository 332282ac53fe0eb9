#!/usr/bin/env bash
# A single-node Apache Kafka (KRaft) broker for PRME development and tests, without Docker.
#
#   kafka.sh fetch             fetch the broker jars with Maven (once; cached)
#   kafka.sh start DATA_DIR    format (first time) and start a broker; prints 127.0.0.1:PORT last
#   kafka.sh stop DATA_DIR     SIGTERM, then SIGKILL after PRME_KAFKA_STOP_TIMEOUT seconds
#   kafka.sh status DATA_DIR   exit 0 and print the bootstrap address when running
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
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
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

# Blocks until the broker answers an admin describe_cluster, the process dies, or the deadline.
wait_ready() {
    "$PYTHON" - "$1" "$2" "$START_TIMEOUT" <<'PY'
import asyncio, logging, os, sys, time

from aiokafka.admin import AIOKafkaAdminClient

logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

bootstrap, pid, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])


def alive() -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


async def probe() -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        await asyncio.wait_for(admin.start(), 10)
        cluster = await asyncio.wait_for(admin.describe_cluster(), 10)
        return bool(cluster.get("brokers"))
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
    fetched || cmd_fetch >/dev/null
    command -v java >/dev/null || die "java not found (install a JDK 17+)"

    local props="$data/server.properties"
    if [[ ! -f "$data/logs/meta.properties" ]]; then
        # First start: pick free ports, write the config, format the storage.
        local broker_port controller_port cluster_id
        broker_port="$(free_port)"
        controller_port="$(free_port)"
        while [[ "$controller_port" == "$broker_port" ]]; do controller_port="$(free_port)"; done
        sed -e "s|@BROKER_PORT@|$broker_port|g" -e "s|@CONTROLLER_PORT@|$controller_port|g" \
            -e "s|@DATA_DIR@|$data|g" "$HERE/server.properties.template" >"$props"
        echo "127.0.0.1:$broker_port" >"$data/bootstrap"
        cluster_id="$("$PYTHON" -c 'import base64, uuid
print(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))')"
        java -cp "$LIBS/*" -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
            -Dprme.kafka.log="$data/format.log" \
            kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$props" \
            >"$data/format.out" 2>&1 || { cat "$data/format.out" >&2; die "storage format failed"; }
    fi
    # On a restart the formatted quorum remembers the controller port: reuse the config.

    local bootstrap
    bootstrap="$(cat "$data/bootstrap")"
    setsid java -Xms256m -Xmx"$HEAP" -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -Dprme.kafka.log="$data/server.log" \
        -cp "$LIBS/*" kafka.Kafka "$props" >"$data/kafka.out" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$data/kafka.pid"

    local rc=0
    wait_ready "$bootstrap" "$pid" || rc=$?
    if [[ $rc -ne 0 ]]; then
        if [[ $rc -eq 2 ]]; then echo "kafka.sh: broker exited during startup" >&2
        else echo "kafka.sh: broker not ready after ${START_TIMEOUT}s" >&2; fi
        tail -n 40 "$data/kafka.out" "$data/server.log" >&2 2>/dev/null || true
        cmd_stop "$data" >/dev/null 2>&1 || true
        exit 1
    fi
    echo "$bootstrap"
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
    status) cmd_status "${2:-}" ;;
    *) usage ;;
esac
