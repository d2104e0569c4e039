# Sourced by the scripts that run on the GPU machine (gpu-run.sh, bwd-run.sh, fwd-run.sh).
# `device_setup DIR`: puts the CUDA libraries of the installed Python wheels (nvidia/cu13/lib)
# on LD_LIBRARY_PATH and unpacks the xz-compressed binaries the pack scripts left in DIR (with
# Python's lzma: the machine has no xz), as executables.
device_setup() {
    LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))'):${LD_LIBRARY_PATH:-}
    export LD_LIBRARY_PATH
    local f
    for f in "$1"/*.xz; do
        [ -e "$f" ] || continue
        python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "${f%.xz}" && rm -f "$f"
        chmod +x "${f%.xz}"
    done
}
