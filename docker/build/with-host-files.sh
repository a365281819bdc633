#!/usr/bin/env bash
# Inside one `docker build` RUN: run a command with what the host lends the build over 127.0.0.1 (served by
# docker/build/host-files.sh for the duration of `make image`, reachable because the build uses --network host):
#   ca.crt    the host's CA bundle (hosts whose TLS goes through an intercepting proxy): pip and Python trust it
#   wheels/   wheels PyPI does not have (the cpu flavor's +cpu torch): a pip find-links page
# They are fetched into a temporary folder that is deleted before the RUN ends, so no layer holds them. Without
# a server (a hand-run build, or a host with nothing to lend) the command runs with the image's own trust store.
#   bash docker/build/with-host-files.sh <command> [args...]      (HOST_FILES_PORT: build arg)
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
url="http://127.0.0.1:${HOST_FILES_PORT:-0}"
fetch() { python3 - "$1" "$2" <<'PYEOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r, open(sys.argv[2], "wb") as f:
        f.write(r.read())
except OSError:
    sys.exit(1)
PYEOF
}
if [ -n "${HOST_FILES_PORT:-}" ] && fetch "$url/ca.crt" "$tmp/ca.crt"; then
  export PIP_CERT="$tmp/ca.crt" SSL_CERT_FILE="$tmp/ca.crt" REQUESTS_CA_BUNDLE="$tmp/ca.crt" CURL_CA_BUNDLE="$tmp/ca.crt"
  echo "with-host-files: trusting the host's CA bundle for this step"
fi
if [ -n "${HOST_FILES_PORT:-}" ] && fetch "$url/wheels/" "$tmp/wheels.html"; then
  export PIP_FIND_LINKS="$url/wheels/" PIP_TRUSTED_HOST=127.0.0.1
  echo "with-host-files: wheels from the host: $(grep -o 'href="[^"]*\.whl"' "$tmp/wheels.html" | sed 's/href=//' | tr '\n' ' ')"
fi
"$@"
