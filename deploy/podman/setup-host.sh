#!/bin/sh
# Installs what `make compose-test` needs on a Debian 12 host, as root: podman, podman-compose
# and debootstrap from Debian's archive, and /etc/containers/containers.conf with
# `default_ulimits = []` (podman's default ulimits cannot be applied on hosts whose hard
# limits are lower than podman's built-in values; without them root podman runs containers).
# Idempotent: installs only what is missing, keeps an existing containers.conf that already
# has the setting. Without root or apt-get it says what to do and exits 1.
set -eu

if [ "$(id -u)" != 0 ]; then
  echo "setup-host.sh: run as root (it apt-installs podman, podman-compose, debootstrap and" >&2
  echo "writes /etc/containers/containers.conf)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "setup-host.sh: needs a Debian/Ubuntu host (apt-get); install podman, podman-compose" >&2
  echo "and debootstrap with your package manager and set default_ulimits = [] in" >&2
  echo "/etc/containers/containers.conf" >&2
  exit 1
fi

missing=""
for tool in podman podman-compose debootstrap; do
  command -v "$tool" >/dev/null || missing="$missing $tool"
done
if [ -n "$missing" ]; then
  echo "installing$missing (apt)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    $missing netavark aardvark-dns uidmap slirp4netns fuse-overlayfs >/dev/null
fi

conf=/etc/containers/containers.conf
mkdir -p /etc/containers
if ! grep -qE '^[[:space:]]*default_ulimits[[:space:]]*=[[:space:]]*\[[[:space:]]*\]' "$conf" 2>/dev/null; then
  if [ -f "$conf" ] && grep -q '^\[containers\]' "$conf"; then
    sed -i '/^\[containers\]/a default_ulimits = []' "$conf"
  else
    printf '[containers]\ndefault_ulimits = []\n' >>"$conf"
  fi
  echo "wrote default_ulimits = [] to $conf"
fi
podman --version
podman-compose --version 2>/dev/null | tail -1 || true
