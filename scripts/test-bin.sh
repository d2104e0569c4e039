# Sourced by the pack-*.sh scripts. `test_bin ARGS NAME` builds `cargo test --release --features
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
