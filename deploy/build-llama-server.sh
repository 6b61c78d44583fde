#!/usr/bin/env bash
# Build llama.cpp's own llama-server, for side-by-side benchmarks (python -m loadtest bench generation).
# Not part of the default set-up: deploy/setup.sh does not call this.
#
#   deploy/build-llama-server.sh        build once, print the binary's path on the last line
#
# It builds the llama.cpp that llama-cpp-python $LLAMA_VERSION vendors, so both sides of a
# comparison run the same kernels. GOVERNOR_LLAMA_CMAKE_ARGS replaces the build flags exactly as
# in deploy/setup.sh, e.g. "-DGGML_CUDA=on" on an NVIDIA GPU (then run it with -ngl 99).
set -euo pipefail
cd "$(dirname "$0")/.."
# cmake and the compilers must never wait on a terminal when this runs in the background.
exec </dev/null

LLAMA_VERSION=0.3.36
# The same portable x86-64 flags as deploy/setup.sh (the native build crashes on AMX CPUs).
DEFAULT_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
FLAGS="${GOVERNOR_LLAMA_CMAKE_ARGS:-$DEFAULT_FLAGS}"
# Static, so the one copied binary runs without the build tree's shared libraries.
FIXED="-DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF"

dest="${XDG_CACHE_HOME:-$HOME/.cache}/governor/llama-server"
stamp="$LLAMA_VERSION $FLAGS $FIXED"
if [ -x "$dest/llama-server" ] && [ "$(cat "$dest/build-flags" 2>/dev/null)" = "$stamp" ]; then
    echo "$dest/llama-server"
    exit 0
fi

if [ -x .venv/bin/pip ]; then pip=(.venv/bin/pip); else pip=(python3 -m pip); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build-llama-server: fetching llama-cpp-python $LLAMA_VERSION's sources" >&2
"${pip[@]}" download --quiet --no-binary :all: --no-deps -d "$work" \
    "llama-cpp-python==$LLAMA_VERSION"
tar -xzf "$work"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"

echo "build-llama-server: building with $FLAGS $FIXED (several minutes)" >&2
# Word splitting of the flag strings is wanted: each is a list of -D options.
# shellcheck disable=SC2086
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release $FLAGS $FIXED >&2
cmake --build "$src/build" --target llama-server -j "${GOVERNOR_BUILD_JOBS:-2}" >&2

mkdir -p "$dest"
install -m 0755 "$src/build/bin/llama-server" "$dest/llama-server.new"
mv "$dest/llama-server.new" "$dest/llama-server"
printf '%s\n' "$stamp" >"$dest/build-flags"
echo "$dest/llama-server"
