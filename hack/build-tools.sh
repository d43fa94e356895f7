#!/usr/bin/env bash
# Builds the dev-cluster binaries (etcd, kube-apiserver, the stock kube-scheduler for benchmark
# baselines, kubectl, kwok, helm, jaeger) from the Go module proxy, and Tessera's kube-scheduler
# (tessera-scheduler, from sidecar-go/), into $TESSERA_CACHE/bin.
# Idempotent: a binary is rebuilt only when its inputs change (its module's go.mod/go.sum, the
# package, the ldflags, the Go version, this script, and for Tessera's own code its Go sources).
#
# Usage: hack/build-tools.sh [--force] [--set demo|test|all] [TOOL...]
#        (default: every tool in the table below)
# Env:   TESSERA_CACHE (default ~/.cache/tessera), GO_BUILD_P (default 2: the machine has 2 cores),
#        PROGRESS_S (default 15: seconds between progress lines of a long build)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TESSERA_CACHE="${TESSERA_CACHE:-${HOME}/.cache/tessera}"
BIN_DIR="${TESSERA_CACHE}/bin"
STAMP_DIR="${TESSERA_CACHE}/stamps"
export GOCACHE="${GOCACHE:-${TESSERA_CACHE}/go-build}"
export GOMODCACHE="${GOMODCACHE:-${TESSERA_CACHE}/gomod}"
# Never fetch another toolchain behind our back; go.mod files say `go 1.26.0`.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
GO_BUILD_P="${GO_BUILD_P:-2}"
PROGRESS_S="${PROGRESS_S:-15}"

log() { printf 'build-tools: %s\n' "$*" >&2; }

# The k8s version stamp comes from the kube tools module so /version matches what was built.
kube_version() {
  awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2; exit }' "${ROOT}/hack/tools/kube/go.mod"
}

kube_ldflags() {
  local v major minor flags="" pkg
  v="$(kube_version)"
  major="${v#v}"; major="${major%%.*}"
  minor="${v#v*.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X ${pkg}.gitVersion=${v} -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
    flags+=" -X ${pkg}.gitTreeState=clean"
  done
  printf '%s' "${flags}"
}

# Tool table: NAME MODULE_DIR PACKAGE LDFLAGS_FUNCTION [SOURCE_DIR].
# SOURCE_DIR (optional) names a directory of this repository whose *.go files also key the stamp,
# for tools built from Tessera's own code rather than only from pinned modules.
TOOLS=(
  "etcd           hack/tools/kube go.etcd.io/etcd/server/v3           -"
  "kube-apiserver hack/tools/kube k8s.io/kubernetes/cmd/kube-apiserver kube_ldflags"
  "kubectl        hack/tools/kube k8s.io/kubernetes/cmd/kubectl        kube_ldflags"
  "kwok           hack/tools/kwok sigs.k8s.io/kwok/cmd/kwok           -"
  "tessera-scheduler sidecar-go   tessera/sidecar-go                  kube_ldflags sidecar-go"
  "kube-scheduler hack/tools/kube k8s.io/kubernetes/cmd/kube-scheduler kube_ldflags"
  "helm           hack/tools/helm helm.sh/helm/v3/cmd/helm             -"
  "jaeger         hack/tools/jaeger github.com/jaegertracing/jaeger/cmd/jaeger -"
)

# What each entry point needs (--set NAME): the demo and `tessera up` run no stock
# kube-scheduler, Helm or Jaeger; the tests need the stock scheduler (benchmark baselines) and
# Helm (chart tests); Jaeger only `tessera up --jaeger` runs.
SET_DEMO="etcd kube-apiserver kubectl kwok tessera-scheduler"
SET_TEST="${SET_DEMO} kube-scheduler helm"

stamp_key() {
  local moddir="$1" pkg="$2" ldflags="$3" srcdir="${4:-}"
  {
    go version
    printf '%s\n%s\n' "${pkg}" "${ldflags}"
    cat "${ROOT}/${moddir}/go.mod" "${ROOT}/${moddir}/go.sum"
    cat "${BASH_SOURCE[0]}"
    if [[ -n "${srcdir}" ]]; then
      (cd "${ROOT}/${srcdir}" && find . -name '*.go' ! -name '*_test.go' -type f -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum)
    fi
  } | sha256sum | cut -d' ' -f1
}

# Reads `go build -v` output: a line every PROGRESS_S seconds with how many packages were
# compiled so far; any other line (a compiler error) is passed through as is.
progress() {
  local name="$1" total="$2" started="$3" done=0 last=${SECONDS} line
  while IFS= read -r line; do
    if [[ "${line}" =~ ^[A-Za-z0-9_./~-]+$ ]]; then
      done=$((done + 1))
      if ((SECONDS - last >= PROGRESS_S)); then
        last=${SECONDS}
        log "${name}: ${done}/${total} packages compiled, $((SECONDS - started))s"
      fi
    else
      printf '%s\n' "${line}" >&2
    fi
  done
}

build_one() {
  local name="$1" moddir="$2" pkg="$3" ldfn="$4" force="$5" srcdir="${6:-}"
  local ldflags="-s -w" key stamp="${STAMP_DIR}/${name}.sha256" started total
  [[ "${ldfn}" == "-" ]] || ldflags+=" $("${ldfn}")"
  key="$(stamp_key "${moddir}" "${pkg}" "${ldflags}" "${srcdir}")"
  if [[ "${force}" == 0 && -x "${BIN_DIR}/${name}" && -f "${stamp}" && "$(cat "${stamp}")" == "${key}" ]]; then
    log "${name}: up to date"
    return 0
  fi
  started=${SECONDS}
  log "${name}: resolving ${pkg} (module ${moddir}; the first time downloads its modules)"
  total="$(cd "${ROOT}/${moddir}" && go list -mod=readonly -deps "${pkg}" | wc -l)"
  log "${name}: building ${total} packages (-p ${GO_BUILD_P}; cached ones are skipped)"
  # -mod=readonly: go.sum must already be complete; a stale one fails here, not half-way.
  # -trimpath is also what `make go-test` passes, so the shim's vet and tests reuse every
  # package compiled here. -v names each package as it is compiled: counted for progress.
  (cd "${ROOT}/${moddir}" && go build -v -mod=readonly -trimpath -p "${GO_BUILD_P}" \
      -ldflags "${ldflags}" -o "${BIN_DIR}/.${name}.tmp" "${pkg}") 2>&1 \
    | progress "${name}" "${total}" "${started}"
  mv -f "${BIN_DIR}/.${name}.tmp" "${BIN_DIR}/${name}"
  printf '%s\n' "${key}" > "${stamp}"
  log "${name}: built in $((SECONDS - started))s -> ${BIN_DIR}/${name}"
}

main() {
  local force=0 want=() entry name moddir pkg ldfn srcdir found
  while (($#)); do
    case "$1" in
      --force) force=1 ;;
      --set)
        shift
        case "${1:-}" in
          demo) read -r -a want <<<"${want[*]} ${SET_DEMO}" ;;
          test) read -r -a want <<<"${want[*]} ${SET_TEST}" ;;
          all) ;;
          *) log "unknown set '${1:-}'; known: demo test all"; return 2 ;;
        esac
        ;;
      -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}"; return 0 ;;
      -*) log "unknown flag: $1"; return 2 ;;
      *) want+=("$1") ;;
    esac
    shift
  done
  command -v go >/dev/null || { log "go not found on PATH: install Go 1.26+"; return 1; }
  mkdir -p "${BIN_DIR}" "${STAMP_DIR}" "${GOCACHE}" "${GOMODCACHE}"
  for name in "${want[@]}"; do
    found=0
    for entry in "${TOOLS[@]}"; do
      [[ "${entry%% *}" == "${name}" ]] && found=1
    done
    ((found)) || { log "unknown tool '${name}'; known: etcd kube-apiserver kube-scheduler kubectl kwok tessera-scheduler helm jaeger"; return 2; }
  done
  for entry in "${TOOLS[@]}"; do
    read -r name moddir pkg ldfn srcdir <<<"${entry}"
    if ((${#want[@]})) && [[ " ${want[*]} " != *" ${name} "* ]]; then
      continue
    fi
    build_one "${name}" "${moddir}" "${pkg}" "${ldfn}" "${force}" "${srcdir}"
  done
}

main "$@"
