#!/usr/bin/env bash
# The wheels a GPU host without a package index needs to run this project's benchmarks, for its Python 3.12 on
# x86-64 (torch, triton and numba come with the host's image): the versions pyproject.toml pins.
#
#   bench/device_wheels.sh OUT_DIR [index]      # index: also faiss-cpu (the retrieval index's benchmarks)
#   PYVER=3.11 bench/device_wheels.sh OUT_DIR   # for another Python (this machine's, to try the stripped NIXL here:
#                                               # its tests/handoff/test_nixl.py pass with it first on PYTHONPATH)
#
# On the host: pip install --no-index --no-deps --target /tmp/site OUT_DIR/*.whl, PYTHONPATH=/tmp/site.
# nixl-cu12 is 69 MB; its expert-parallel modules (nixl_ep_cu12), the NIXL plugins other than UCX and the libraries
# only they need are left out (15 MB). Its UCX registers GPU memory only with the CUDA 12 runtime (libcudart.so.12)
# loadable: on a CUDA 13 image, OUT_DIR/extra holds that runtime's wheel; install it to a directory of its own and
# put its nvidia/cuda_runtime/lib on LD_LIBRARY_PATH for the processes that use NIXL.
set -euo pipefail
out=$1 what=${2:-}
here=$(cd "$(dirname "$0")/.." && pwd)
pin() { grep -o "\"$1==[^\"]*\"" "$here/pyproject.toml" | tr -d '"'; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() {     # pip download for the host's Python; DIR NAME==VERSION...
    local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}
mkdir -p "$out/extra"
get "$out" "$(pin rocksdict)" "$(pin grpcio)" "$(pin grpcio-health-checking)" "$(pin grpcio-reflection)" \
    "$(pin protobuf)" "$(pin isal)" "$(pin prometheus-client)" "$(pin cryptography)" cffi==2.1.1 py-spy==0.4.3
[ "$what" = index ] && get "$out" "$(pin faiss-cpu)"
get "$tmp" "$(pin nixl-cu12)"
get "$out/extra" nvidia-cuda-runtime-cu12==12.9.79
python3 - "$tmp"/nixl_cu12-*.whl "$out" <<'PY'
import os, subprocess, sys, tempfile, zipfile
src, out = sys.argv[1], sys.argv[2]
zin = zipfile.ZipFile(src)
with tempfile.TemporaryDirectory() as d:
    zin.extractall(d)
    libs = {}
    for root, _, files in os.walk(d):
        for f in files:
            if ".so" in f:
                libs.setdefault(f, os.path.join(root, f))
    def needed(path):
        text = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        return [l.split("[")[1].split("]")[0] for l in text.splitlines() if "(NEEDED)" in l]
    system = ("libc.", "libm.", "libdl", "libpthread", "librt", "libstdc", "libgcc", "ld-linux", "libcuda",
              "libnvidia-ml", "libz.", "libssl", "libcrypto")
    ucx = [p for n, p in libs.items() if "/ucx/" in p and n.endswith(".so.0.0.0") and "perftest" not in n]
    start = [p for n, p in libs.items() if n.startswith("_") and n.endswith(".so")] + [libs["libplugin_UCX.so"]]
    def closure(roots):
        seen, todo, outside = set(), list(roots), set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            for n in needed(p):
                if n in libs:
                    todo.append(libs[n])
                elif not n.startswith(system):
                    outside.add(p)
        return seen, outside
    _, outside = closure(start + ucx)
    keep, _ = closure(start + [p for p in ucx if p not in outside])   # UCX modules for hardware the host lacks go
    keep = {os.path.relpath(p, d) for p in keep}
def kept(name):
    if name.startswith(("nixl_ep_cu12", "nixl_cu12.scripts")) or ".data/" in name or name.endswith(".la"):
        return False
    return ".so" not in os.path.basename(name) or name in keep
names = [n for n in zin.namelist() if kept(n)]
dest = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(dest, "w") as z:
    for n in names:
        data = zin.read(n)
        if n.endswith(".dist-info/RECORD"):
            data = ("\n".join(l for l in data.decode().splitlines() if kept(l.split(",")[0])) + "\n").encode()
        z.writestr(n, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print(f"{os.path.basename(src)}: {os.path.getsize(src) >> 20} MiB -> {os.path.getsize(dest) >> 20} MiB")
PY
du -sh "$out"
