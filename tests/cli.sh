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

expect_ok "run --chat" "$K3" run -m "$TINY" --chat -n 4 --temp 0 "Hi"
expect_ok "run quantized, C8 cache" "$K3" run -m "$TINY" --quant w8a8+w4a8 --kv-cache c8 -n 4 --temp 0 "Hello"
# --isa: the kernels named, printed by info; an unknown or missing one refused
expect_ok "info --isa ref" "$K3" info -m "$TINY" --isa ref
grep -q "^kernels: ref$" "$TMP/out" && ok "info prints the kernels" || bad "info prints the kernels" "$TMP/out"
expect_ok "run quantized --isa ref" "$K3" run -m "$TINY" --quant w8a8+w4a8 --kv-cache c8 --isa ref -n 4 --temp 0 "Hello"
expect_fail "run --isa unknown" "unknown kernel ISA" "$K3" run -m "$TINY" --isa sse9 -n 1 "Hello"
expect_fail "bench --isa unknown" "unknown kernel ISA" "$K3" bench -m "$TINY" --isa avx3
# weights read from the mapping (--mmap) or copied into RAM (default): same text
"$K3" run -m "$TINY" -n 12 --temp 0 "Hello" >"$TMP/copied" 2>/dev/null
"$K3" run -m "$TINY" -n 12 --temp 0 --mmap "Hello" >"$TMP/mapped" 2>/dev/null
if [ -s "$TMP/copied" ] && cmp -s "$TMP/copied" "$TMP/mapped"; then ok "run --mmap = copied weights"; else bad "run --mmap = copied weights"; fi
printf 'It is a truth universally acknowledged, that a single man in possession of a good fortune.\n' >"$TMP/t.txt"
expect_ok "eval" "$K3" eval -m "$TINY" --text "$TMP/t.txt" --ctx 8
tail -n 1 "$TMP/out" | grep -qE '^ppl [0-9.]+ bits_per_byte [0-9.]+ tokens [0-9]+$' && ok "eval last line" || bad "eval last line" "$TMP/out"
expect_ok "bench --json" "$K3" bench -m "$TINY" --runs 1 --prompts 16 --decode-tokens 2 --membw-mb 64 --json
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [d[k] for k in ("prefill_tok_s","prefill_gflops","decode_tok_s","bytes_per_token","effective_gbps","mem_bw_gbps")]; assert 0 <= d["decode_runs_steady"] <= d["runs"] and d["bandwidth_fraction"] > 0' "$TMP/out" 2>/dev/null && ok "bench --json fields" || bad "bench --json fields" "$TMP/out"
printf 'Hello, world! 12345 don'"'"'t\r\n' >"$TMP/h.txt"
"$K3" tokenize --vocab ../shared/data/tokenizers/cl100k_base.tiktoken --pattern cl100k <"$TMP/h.txt" >"$TMP/ids" 2>"$TMP/err" &&
    "$K3" tokenize --vocab ../shared/data/tokenizers/cl100k_base.tiktoken --pattern cl100k --decode <"$TMP/ids" >"$TMP/back" 2>>"$TMP/err" &&
    cmp -s "$TMP/h.txt" "$TMP/back" && ok "tokenize round trip (cl100k)" || bad "tokenize round trip (cl100k)" "$TMP/err"

expect_fail "missing model dir" "No such file" "$K3" info -m "$TMP/nope"
expect_fail "unknown command" "unknown command" "$K3" frobnicate
expect_fail "unknown option" "unknown option" "$K3" run -m "$TINY" --bogus 1 hi
expect_fail "id out of range" "out of range" "$K3" run -m "$TINY" --ids 1,5000 -n 0
expect_fail "negative id" "out of range" "$K3" run -m "$TINY" --ids 1,-3 -n 0
expect_fail "bad quant mode" "unknown mode" "$K3" run -m "$TINY" --quant w2a2 -n 1 hi
expect_fail "bad cache type" "kv-cache" "$K3" run -m "$TINY" --kv-cache q4 -n 1 hi
expect_fail "eval without text" "usage" "$K3" eval -m "$TINY"
expect_fail "eval missing file" "No such file" "$K3" eval -m "$TINY" --text "$TMP/none.txt"
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
