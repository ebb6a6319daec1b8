#!/bin/sh
# Builds the base image of deploy/docker/* from Debian's archive alone, for hosts that cannot
# pull python:3.11-slim (or redis) from Docker Hub: a bookworm minbase root made by
# debootstrap with Debian's python3 (3.11) and python3-venv, imported into podman as
# $BASE_TAG (default localhost/flywheel-base:bookworm). Root only (debootstrap, podman).
#   deploy/podman/debian-base.sh [--rebuild]
# Environment: BASE_TAG, DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SUITE
# (bookworm), WORKDIR (scratch folder for the root, default /var/tmp).
set -eu
BASE_TAG=${BASE_TAG:-localhost/flywheel-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-bookworm}
if [ "$(id -u)" != 0 ]; then
  echo "debian-base.sh: debootstrap needs root" >&2
  exit 1
fi
if [ "${1:-}" != "--rebuild" ] && podman image exists "$BASE_TAG"; then
  echo "$BASE_TAG exists (--rebuild to make it again)"
  exit 0
fi
root=$(mktemp -d "${WORKDIR:-/var/tmp}/flywheel-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "debootstrap $SUITE from $MIRROR into $root"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# lean: no package cache, lists or docs in the image (Dockerfiles that apt-get run update)
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" --numeric-owner -c . | podman import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
podman image ls "$BASE_TAG"
