# cli_grammar.sh -- `k3 grammar` end to end (sourced by tests/cli.sh: uses its
# K3, TMP, ok, bad, expect_ok, expect_fail): compile, check texts token by
# token, the --json layout, the exit codes.
G_VOCAB="--vocab data/tokenizers/o200k_base.tiktoken --pattern o200k"
# shellcheck disable=SC2086
gram() { timeout 120 "$K3" grammar $G_VOCAB "$@"; }

gram --help >"$TMP/out" 2>&1 && grep -q "usage: k3 grammar" "$TMP/out" && ok "grammar --help" || bad "grammar --help" "$TMP/out"
for args in "--regex a --choice b" "--json-schema" "--bogus" "--regex a --sample x"; do
    # shellcheck disable=SC2086
    gram $args >"$TMP/out" 2>"$TMP/err"
    rc=$?
    [ $rc -eq 2 ] && grep -q "k3 grammar:" "$TMP/err" && ok "grammar bad usage ($args) exits 2" ||
        bad "grammar bad usage ($args): exit $rc" "$TMP/err"
done
timeout 60 "$K3" grammar --regex a >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ] && ok "grammar without a vocabulary exits 2" || bad "grammar without a vocabulary" "$TMP/err"
expect_fail "grammar missing schema file" "cannot read" "$K3" grammar $G_VOCAB --json-schema "$TMP/none.json"

cat >"$TMP/s.json" <<'JSON'
{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
 "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}, "required": ["name"], "additionalProperties": false}
JSON
printf '%s\n' '"{\"name\": \"Ada\", \"tags\": [\"a\", \"b\"]}"' '"{\"name\": 1}"' '"{\"name\": \"x\""' \
    '"{\"tags\": []}"' >"$TMP/t.jsonl"
gram --json-schema "$TMP/s.json" --test "$TMP/t.jsonl" --json >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ $rc -eq 0 ] &&
    grep -q '^{"compiled": true, "error": null, "compile_ms": [0-9.e-]*, "results": \[{"accepted": true, "tokens": [0-9]*, "rejected_at": null}, {"accepted": false, "tokens": [0-9]*, "rejected_at": [0-9]*}, {"accepted": false, "tokens": \([0-9]*\), "rejected_at": \1}, {"accepted": false, "tokens": [0-9]*, "rejected_at": 1}\], "mask_us": {"mean": [0-9.e-]*, "p50": [0-9.e-]*, "p99": [0-9.e-]*, "max": [0-9.e-]*, "n": [0-9]*}}$' "$TMP/out"; then
    ok "grammar --json: verdicts and mask times"
else
    bad "grammar --json (exit $rc)" "$TMP/out"
fi
printf '{"type": "object", "dependentSchemas": {"a": {}}}' >"$TMP/u.json"
gram --json-schema "$TMP/u.json" --test "$TMP/t.jsonl" --json >"$TMP/out" 2>"$TMP/err"
rc=$?
[ $rc -eq 0 ] && grep -q '"compiled": false, "error": "json_schema: keyword .dependentSchemas. is not supported"' "$TMP/out" &&
    grep -q '"results": \[\]' "$TMP/out" && ok "grammar: a schema it cannot compile is a verdict (exit 0)" ||
    bad "grammar: unsupported keyword (exit $rc)" "$TMP/out"
printf '"yes"\n"nope"\n' >"$TMP/c.jsonl"
expect_ok "grammar --choice" "$K3" grammar $G_VOCAB --choice yes,no --test "$TMP/c.jsonl"
grep -q "text 1: accepted" "$TMP/out" && grep -q "text 2: rejected" "$TMP/out" && ok "grammar --choice verdicts" ||
    bad "grammar --choice verdicts" "$TMP/out"
printf 'root ::= [0-9]+ ("," [0-9]+)*\n' >"$TMP/g.gbnf"
printf '"1,22,333"\n"1,,2"\n' >"$TMP/g.jsonl"
expect_ok "grammar --grammar" "$K3" grammar $G_VOCAB --grammar "$TMP/g.gbnf" --test "$TMP/g.jsonl"
grep -q "text 1: accepted" "$TMP/out" && grep -q "text 2: rejected" "$TMP/out" && ok "grammar --grammar verdicts" ||
    bad "grammar --grammar verdicts" "$TMP/out"
expect_ok "grammar --regex --sample" "$K3" grammar $G_VOCAB --regex '[a-c]{2}-[0-9]' --sample 3 --seed 2
[ "$(grep -c '^"[a-c][a-c]-[0-9]"$' "$TMP/out")" -eq 3 ] && ok "grammar --sample writes matching texts" ||
    bad "grammar --sample" "$TMP/out"
# K3 tool calls on the bundled model's tokenizer: a test line mixes text and specials
printf '[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]' >"$TMP/tools.json"
printf '%s\n' '["<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>", "<|open|>", "call tool=\"get_weather\" index=\"1\"", "<|sep|>", "<|open|>", "argument key=\"city\" type=\"string\"", "<|sep|>", "Paris", "<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>"]' \
    '["<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>", "<|open|>", "call tool=\"get_time\" index=\"1\"", "<|sep|>"]' >"$TMP/tc.jsonl"
expect_ok "grammar --tools" "$K3" grammar -m models/k3-mini --tools "$TMP/tools.json" --test "$TMP/tc.jsonl"
grep -q "text 1: accepted" "$TMP/out" && grep -q "text 2: rejected" "$TMP/out" && ok "grammar --tools verdicts" ||
    bad "grammar --tools verdicts" "$TMP/out"
