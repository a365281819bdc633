#!/usr/bin/env bash
# The cpu flavor's base image: a Debian rootfs bootstrapped with mmdebstrap (bit-reproducible under
# SOURCE_DATE_EPOCH) and `docker import`ed. Its one layer's digest is the rootfs tar's sha256, pinned in the lock.
#   docker/base.sh [--lock] [SUITE]     (make image FLAVOR=cpu runs it; make lock-images FLAVOR=cpu passes --lock)
# Prints the image reference to build FROM on its last line of stdout: <BASE_NAME>:<suite>-<first 12 of the digest>.
# Refuses (exit 3) when the fresh rootfs differs from the lock, naming the packages that moved, unless
# ALLOW_UNPINNED=1 (the image is then labelled base-pinned=false) or --lock (re-pin: commit the lock and list).
# Needs root (mmdebstrap --mode=root, as root or with sudo) on Debian/Ubuntu; reuses .cache/base/ when it can.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK_MODE=
if [ "${1:-}" = --lock ]; then LOCK_MODE=1; shift; fi
SUITE=${1:-bookworm}
DESC=docker/base/$SUITE.env
LIST=docker/base/$SUITE.packages
LOCK=${LOCK_FILE:-docker/images.lock}
DOCKER=${DOCKER:-docker}
[ -f "$DESC" ] || { echo "base: no $DESC" >&2; exit 2; }
# shellcheck disable=SC1090
set -a; . "$DESC"; set +a
REF="$BASE_NAME:$SUITE"
OUT=.cache/base
TAR=$OUT/rootfs-$SUITE.tar
mkdir -p "$OUT"
say() { echo "base: $*" >&2; }

locked=$(awk -v r="$REF" '$1 == r {print $2}' "$LOCK" 2>/dev/null)
packages_of() { tar -xOf "$1" ./var/lib/dpkg/status | awk '/^Package:/{p=$2} /^Version:/{print p"="$2}' | sort; }

# imported TAG DIGEST: the engine has TAG and its only layer is DIGEST
imported() { [ "$("$DOCKER" image inspect "$1" --format '{{json .RootFS.Layers}}' 2>/dev/null)" = "[\"$2\"]" ]; }

# 0) the locked base is already imported: nothing to do
if [ -z "$LOCK_MODE" ] && [[ "$locked" == sha256:* ]] && imported "$REF-${locked:7:12}" "$locked"; then
  echo "$REF-${locked:7:12}"; exit 0
fi

# 1) the rootfs: reuse the cached tar when it is the locked one, else bootstrap
sha=""
[ -f "$TAR" ] && [ -f "$TAR.sha256" ] && sha=$(cat "$TAR.sha256")
if [ -z "$sha" ] || [ "sha256:$sha" != "$locked" ] || [ -n "$LOCK_MODE" ]; then
  if ! command -v mmdebstrap >/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
      || { say "mmdebstrap is missing: apt-get install mmdebstrap (as root on Debian/Ubuntu)"; exit 2; }
    say "installing mmdebstrap (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  fi
  # the Debian mirror this host's apt uses for the suite (BASE_MIRROR overrides)
  mirror=${BASE_MIRROR:-$(apt-get indextargets --format '$(REPO_URI) $(CODENAME) $(ORIGIN)' 'Identifier: Packages' 2>/dev/null \
    | awk -v s="$SUITE" '$2 == s && $3 == "Debian" {print $1; exit}')}
  [ -n "$mirror" ] || { say "no Debian mirror for $SUITE in this host's apt sources: set BASE_MIRROR=<mirror URL>"; exit 2; }
  say "bootstrapping Debian $SUITE ($BASE_VARIANT + $BASE_INCLUDE) with mmdebstrap, SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"
  t0=$(date +%s)
  mmdebstrap --quiet --mode=root --format=tar --variant="$BASE_VARIANT" --include="$BASE_INCLUDE" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$TAR.tmp" "$mirror" >&2
  mv "$TAR.tmp" "$TAR"
  sha=$(sha256sum "$TAR" | cut -d' ' -f1)
  echo "$sha" > "$TAR.sha256"
  say "rootfs sha256:$sha ($(du -m "$TAR" | cut -f1) MB, $(( $(date +%s) - t0 )) s)"
fi

# 2) the pin
if [ -n "$LOCK_MODE" ]; then
  tmp=$(mktemp "$LOCK.XXXXXX")
  { grep -v "^$REF " "$LOCK" 2>/dev/null || true; echo "$REF sha256:$sha"; } > "$tmp" && mv "$tmp" "$LOCK"
  packages_of "$TAR" > "$LIST"
  say "pinned $REF sha256:$sha in $LOCK; package list in $LIST ($(wc -l < "$LIST") packages): commit both"
elif [ "sha256:$sha" != "$locked" ]; then
  if [ "${ALLOW_UNPINNED:-}" != 1 ]; then
    say "the bootstrapped $SUITE rootfs is sha256:$sha but $LOCK pins ${locked:-nothing} for $REF."
    if [ -f "$LIST" ]; then
      say "packages that moved (-locked +now):"
      diff <(cat "$LIST") <(packages_of "$TAR") | sed -n 's/^</  -/p; s/^>/  +/p' >&2 || true
    fi
    say "Debian published new package versions (or the base description changed). Review, then re-pin with"
    say "\`make lock-images FLAVOR=cpu\` and commit $LOCK and $LIST; or build this once with ALLOW_UNPINNED=1."
    exit 3
  fi
  say "WARNING: building from an unpinned base (sha256:$sha, lock has ${locked:-nothing}); ALLOW_UNPINNED=1"
fi

# 3) the image: imported once per digest; the tag names the digest
TAG="$REF-${sha:0:12}"
if ! imported "$TAG" "sha256:$sha"; then
  "$DOCKER" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    --message "mmdebstrap $SUITE $BASE_VARIANT +$BASE_INCLUDE SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" "$TAR" "$TAG" >/dev/null
  say "imported $TAG"
fi
echo "$TAG"
