#!/usr/bin/env bash
# make image: lend the build what it needs from the host, over 127.0.0.1 only, for the duration of one command:
#   docker/build/host-files.sh <flavor> <stack.env> <port> -- docker build --network host ...
# Serves .cache/build/host-files/ (ca.crt = the host's CA bundle, if it has one; wheels/ = the stack's CPU torch
# wheel for the cpu flavor, found in the host's pip find-links or downloaded, checked against the stack's
# TORCH_CPU_WHEEL_SHA256). docker/build/with-host-files.sh reads them inside the build without writing them into
# a layer. The proxy settings are passed by the Makefile as Docker's predefined proxy build args, which are kept
# out of `docker history` and of the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
FLAVOR=$1 STACK_FILE=$2 PORT=$3
shift 3
[ "${1:-}" = -- ] && shift
DIR=.cache/build/host-files
rm -rf "$DIR" && mkdir -p "$DIR/wheels"
get() { sed -n "s/^$1=//p" "$STACK_FILE" | sed 's/^"//; s/"$//'; }

for ca in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" "${REQUESTS_CA_BUNDLE:-}" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  if [ -n "$ca" ] && [ -f "$ca" ]; then cp "$ca" "$DIR/ca.crt"; echo "host-files: lending the build the host's CA bundle ($ca)"; break; fi
done

# stacks whose CPU torch is on PyPI (vllm-0.16) name no wheel
if [ "$FLAVOR" = cpu ] && [ -n "$(get TORCH_CPU_WHEEL)" ]; then
  wheel=$(get TORCH_CPU_WHEEL) want=$(get TORCH_CPU_WHEEL_SHA256)
  [ -n "$want" ] || { echo "host-files: $STACK_FILE names TORCH_CPU_WHEEL without TORCH_CPU_WHEEL_SHA256" >&2; exit 2; }
  found=""
  # the host's pip find-links (environment, then pip config), then docker/wheelhouse/ (git-ignored, for hand copies)
  links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true) docker/wheelhouse"
  for d in $links; do
    d=${d#file://}
    if [ -f "$d/$wheel" ]; then found="$d/$wheel"; break; fi
  done
  if [ -z "$found" ]; then
    echo "host-files: $wheel is not in the host's pip find-links; trying pip download (needs an index that serves CPU torch builds)"
    python3 -m pip download -q --no-cache-dir --no-deps --only-binary=:all: -d "$DIR/wheels" "torch==$(get TORCH_VERSION)+cpu" \
      --python-version "$(get PYTHON_VERSION)" --platform manylinux_2_28_x86_64 >&2 || true
    found="$DIR/wheels/$wheel"
    [ -f "$found" ] || { echo "host-files: no $wheel: put it in docker/wheelhouse/, or set PIP_FIND_LINKS to a folder holding it, or PIP_EXTRA_INDEX_URL to an index with CPU torch builds (https://download.pytorch.org/whl/cpu)" >&2; exit 2; }
  fi
  got=$(sha256sum "$found" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "host-files: $found has sha256 $got, the stack pins $want (TORCH_CPU_WHEEL_SHA256 in $STACK_FILE)" >&2; exit 2; }
  [ "$found" = "$DIR/wheels/$wheel" ] || ln "$found" "$DIR/wheels/$wheel" 2>/dev/null || cp "$found" "$DIR/wheels/$wheel"
  echo "host-files: lending the build $wheel (sha256 verified)"
fi

# 9>&-: not holding make image's build lock (Makefile, image_lock) should this server ever outlive the build
python3 -m http.server --bind 127.0.0.1 --directory "$DIR" "$PORT" > .cache/build/host-files.log 2>&1 9>&- &
server=$!
trap 'rc=$?; kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; rm -rf "$DIR"; exit $rc' EXIT
for _ in $(seq 50); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/', timeout=1)" 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "host-files: could not serve on 127.0.0.1:$PORT (in use? set HOST_FILES_PORT=<free port>): $(tail -n 3 .cache/build/host-files.log)" >&2; exit 2; }
  sleep 0.2
done
"$@"
