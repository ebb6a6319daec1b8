#!/bin/sh
# Builds every image of the compose `cpu` profile with podman from Debian's archive and PyPI
# alone (no Docker Hub): the base from debian-base.sh, Redis from Debian's package, the
# Flywheel images from deploy/docker/* with BASE_IMAGE set to that base. Tags are the ones
# docker-compose.yml names (flywheel-<service>:$FLYWHEEL_TAG, default dev).
#   deploy/podman/build-images.sh
# Environment: FLYWHEEL_TAG; BASE_TAG (see debian-base.sh); TORCH_WHEELS: a host folder of
# torch wheels (default /opt/wheels when it holds one, else the PyTorch CPU index is used);
# BUILD_TIMEOUT (seconds per image, default 3600); HOST_CA: the host's CA bundle, mounted over
# the image's during builds so pip trusts what the host trusts (a TLS-inspecting proxy's CA).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
tag=${FLYWHEEL_TAG:-dev}
base=${BASE_TAG:-localhost/flywheel-base:bookworm}
limit=${BUILD_TIMEOUT:-3600}
wheels=${TORCH_WHEELS:-/opt/wheels}
ca=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
"$here/debian-base.sh"

build() {  # build <tag> <dockerfile> [extra podman build args...]
  image=$1 file=$2
  shift 2
  echo "== $image ($file)"
  timeout "$limit" podman build --network host --layers -q -f "$repo/$file" \
    --build-arg BASE_IMAGE="$base" -t "$image" $ca_mount "$@" "$repo"
}

ca_mount=""
[ -f "$ca" ] && ca_mount="-v $ca:/etc/ssl/certs/ca-certificates.crt:ro"

torch_src=""
if ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
  torch_src="-v $wheels:/wheels:ro --build-arg TORCH_WHEELS=/wheels"
fi
build "flywheel-redis:bookworm" deploy/docker/Dockerfile.redis
for extra in gateway reward teacher; do
  build "flywheel-$extra:$tag" deploy/docker/Dockerfile.python --build-arg EXTRAS="$extra"
done
for extra in engine trainer; do
  # shellcheck disable=SC2086
  build "flywheel-$extra:$tag" deploy/docker/Dockerfile.torch --build-arg EXTRAS="$extra" $torch_src
done
podman image prune -f >/dev/null  # the build stages
podman image ls --filter reference='*flywheel-*'
