# Sourced by the pack-*.sh scripts, which call `fresh_kernels` before they build.
#
# `fresh_kernels`: worktrees that share a target dir (CARGO_TARGET_DIR) share the build script's
# out dir, and cargo reruns build.rs for this tree only when its kernels are newer than the last
# run, which may have been another tree's: its PTX would be embedded here. build.rs records the
# tree it compiled (out/source_dir.txt); when that is not this tree, touching a kernel makes
# cargo run it again.
fresh_kernels() {
    local f
    for f in "$CARGO_TARGET_DIR"/release/build/candle-flash-*/out/source_dir.txt; do
        [ -e "$f" ] || continue
        if [ "$(cat "$f")" != "$(pwd -P)" ]; then
            echo "PTX in $(dirname "$f") was built from $(cat "$f"): rebuilding from $(pwd -P)" >&2
            touch kernels/sm90/fwd.cuh
            return
        fi
    done
}

# `test_bin ARGS NAME` builds `cargo test --release --features
# "$features" ARGS --no-run` and prints the path of the test executable of target NAME (a
# binary's path is only known from cargo's JSON messages): `test_bin "--test gpu" gpu`,
# `test_bin --lib candle_flash`.
test_bin() {
    # shellcheck disable=SC2086  # ARGS is a list of words
    cargo test --release --features "$features" $1 --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$2"
}
