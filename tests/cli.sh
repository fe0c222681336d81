#!/bin/sh
# cli.sh -- end-to-end checks of the `k3` program: it runs, and bad input gets
# one clear message and a non-zero exit, never a crash (exit status >= 128
# means a signal) or a hang. Usage: sh tests/cli.sh build/k3
# Ends with the line `cli: N passed, N failed`.
K3=${1:-build/k3}
TINY=tests/models/tiny
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0

ok() { pass=$((pass + 1)); echo "ok   cli: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL cli: $1"; [ -n "$2" ] && sed 's/^/    /' "$2" | head -5; }

# expect_fail NAME PATTERN CMD... : CMD must exit 1-127 with PATTERN on stderr
expect_fail() {
    name=$1 pat=$2
    shift 2
    timeout 60 "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
        bad "$name (exit $rc)" "$TMP/err"
    elif ! grep -q -- "$pat" "$TMP/err"; then
        bad "$name (message lacks '$pat')" "$TMP/err"
    else
        ok "$name"
    fi
}

# expect_ok NAME CMD... : CMD must succeed
expect_ok() {
    name=$1
    shift
    if timeout 120 "$@" >"$TMP/out" 2>"$TMP/err" </dev/null; then ok "$name"; else bad "$name" "$TMP/err"; fi
}

# a copy of the tiny checkpoint to damage
damaged() {
    rm -rf "$TMP/m"
    cp -r "$TINY" "$TMP/m"
}

expect_ok "run tiny model" "$K3" run -m "$TINY" -n 8 --temp 0 "Hello"
grep -q "decode" "$TMP/err" && ok "run prints its timing line" || bad "run prints its timing line" "$TMP/err"
expect_ok "info" "$K3" info -m "$TINY"
grep -q "KDA" "$TMP/out" && ok "info shows the layer map" || bad "info shows the layer map" "$TMP/out"
expect_ok "dump logits" "$K3" run -m "$TINY" --ids 1,2,3 -n 0 --dump-logits "$TMP/l.f32"
[ "$(wc -c <"$TMP/l.f32")" -eq $((3 * 1024 * 4)) ] && ok "dump logits size" || bad "dump logits size"

expect_fail "missing model dir" "No such file" "$K3" info -m "$TMP/nope"
expect_fail "unknown command" "unknown command" "$K3" frobnicate
expect_fail "unknown option" "unknown option" "$K3" run -m "$TINY" --bogus 1 hi
expect_fail "id out of range" "out of range" "$K3" run -m "$TINY" --ids 1,5000 -n 0
expect_fail "negative id" "out of range" "$K3" run -m "$TINY" --ids 1,-3 -n 0
expect_fail "ids not numbers" "cannot parse" "$K3" run -m "$TINY" --ids 1,x -n 0
expect_fail "prompt longer than the context" "context" "$K3" run -m "$TINY" --ctx 4 -n 1 "one two three four five six seven eight nine ten"
expect_fail "invalid UTF-8 prompt" "UTF-8" "$K3" run -m "$TINY" -n 1 "$(printf 'ab\377cd')"

damaged
head -c 1000 "$TINY/model.safetensors" >"$TMP/m/model.safetensors"
expect_fail "truncated safetensors" "model.safetensors" "$K3" info -m "$TMP/m"

damaged
printf '\377\377\377\377\0\0\0\0{}' >"$TMP/m/model.safetensors"
expect_fail "header length past the end" "header" "$K3" info -m "$TMP/m"

damaged
rm "$TMP/m/model.safetensors"
expect_fail "missing safetensors" "model.safetensors" "$K3" info -m "$TMP/m"

damaged
sed 's/"hidden_size": 256,//' "$TINY/config.json" >"$TMP/m/config.json"
expect_fail "config missing a field" "hidden_size" "$K3" info -m "$TMP/m"

damaged
sed 's/"hidden_size": 256,/"hidden_size": 256, "frobnication_factor": 3,/' "$TINY/config.json" >"$TMP/m/config.json"
expect_fail "config with an unknown field" "frobnication_factor" "$K3" info -m "$TMP/m"

damaged
sed 's/"hidden_size": 256,/"hidden_size": 320,/' "$TINY/config.json" >"$TMP/m/config.json"
expect_fail "config disagrees with tensor shapes" "shape" "$K3" info -m "$TMP/m"

damaged
printf '{"text_config": ' >"$TMP/m/config.json"
expect_fail "config not JSON" "config.json" "$K3" info -m "$TMP/m"

damaged
printf 'not base64 at all\n' >"$TMP/m/tiktoken.model"
expect_fail "corrupt tiktoken.model" "tiktoken.model" "$K3" run -m "$TMP/m" -n 1 "hi"

printf 'ab\377cd' >"$TMP/bad.txt"
expect_fail "tokenize invalid UTF-8" "UTF-8" sh -c "\"$K3\" tokenize -m \"$TINY\" <\"$TMP/bad.txt\""
expect_fail "decode id out of range" "range" sh -c "echo 99999 | \"$K3\" tokenize -m \"$TINY\" --decode"

echo "cli: $pass passed, $fail failed"
[ $fail -eq 0 ]
