#!/bin/sh
# cli.sh -- end-to-end checks of the `k3` program: it runs, and bad input gets
# one clear message and a non-zero exit, never a crash (exit status >= 128
# means a signal) or a hang. Usage: sh tests/cli.sh build/k3
# Ends with the line `cli: N passed, N failed, N skipped`.
K3=${1:-build/k3}
TINY=tests/models/tiny
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
skip=0

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
grep -q "(quant w8a8+w4a8, kv c8)" "$TMP/err" && ok "run prints the mode it ran in" || bad "run prints the mode it ran in" "$TMP/err"
expect_ok "run a checkpoint saved by the official K3 classes" "$K3" run -m tests/models/official-tiny -n 4 --temp 0 "Hello"
grep -q "(quant none, kv c8)" "$TMP/err" && ok "run's default mode is as stored, C8" || bad "run's default mode is as stored, C8" "$TMP/err"
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
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [d[k] for k in ("prefill_tok_s","prefill_gflops","prefill_work_gflops","decode_tok_s","bytes_per_token","effective_gbps","mem_bw_gbps")]; assert 0 <= d["decode_runs_steady"] <= d["runs"] and d["bandwidth_fraction"] > 0 and d["prefill_work_gflops"] > 0 and all(p["work_gflops"] > 0 for p in d["prefill"])' "$TMP/out" 2>/dev/null && ok "bench --json fields" || bad "bench --json fields" "$TMP/out"
expect_ok "bench throughput --json" "$K3" bench throughput -m "$TINY" --num-prompts 6 --max-concurrency 3 --input-len 40 --output-len 5 --prefix-len 32 --block-size 16 --threads 1 --json
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [d[k][s] for k in ("ttft_ms","tpot_ms","itl_ms") for s in ("mean","median","p99")]; assert d["output_throughput"] > 0 and d["total_token_throughput"] > d["output_throughput"] and d["request_throughput"] > 0 and 0 < d["prefix_cache_hit_rate"] < 1 and d["preemptions"] >= 0' "$TMP/out" 2>/dev/null && ok "bench throughput --json fields" || bad "bench throughput --json fields" "$TMP/out"
expect_fail "bench throughput bad prefix" "bad option" "$K3" bench throughput -m "$TINY" --input-len 16 --prefix-len 16
printf 'Hello, world! 12345 don'"'"'t\r\n' >"$TMP/h.txt"
"$K3" tokenize --vocab data/tokenizers/cl100k_base.tiktoken --pattern cl100k <"$TMP/h.txt" >"$TMP/ids" 2>"$TMP/err" &&
    "$K3" tokenize --vocab data/tokenizers/cl100k_base.tiktoken --pattern cl100k --decode <"$TMP/ids" >"$TMP/back" 2>>"$TMP/err" &&
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

# ---- issue 14: options, input, conversation, honest output ----------------
K3ABS=$(cd "$(dirname "$K3")" && pwd)/$(basename "$K3")
expect_fail "-n not a number" "\-n expects an integer" "$K3" run -m "$TINY" -n abc hi
expect_fail "-n too large" "\-n expects an integer from 0 to" "$K3" run -m "$TINY" -n 99999999999 hi
expect_fail "--temp not a number" "\-\-temp expects a finite number" "$K3" run -m "$TINY" --temp abc hi
expect_fail "--temp nan" "\-\-temp expects a finite number" "$K3" run -m "$TINY" --temp nan hi
expect_fail "--top-p inf" "\-\-top-p expects a finite number" "$K3" run -m "$TINY" --top-p inf hi
expect_fail "--min-p nan" "\-\-min-p expects a finite number" "$K3" run -m "$TINY" --min-p nan hi
expect_fail "--threads not a number" "\-\-threads expects an integer" "$K3" run -m "$TINY" --threads abc hi
expect_fail "--seed negative" "\-\-seed expects an integer" "$K3" run -m "$TINY" --seed -1 hi
expect_fail "eval --ctx not a number" "\-\-ctx expects an integer" "$K3" eval -m "$TINY" --text x --ctx 12abc
expect_fail "bench --runs out of range" "\-\-runs expects an integer from 1 to 64" "$K3" bench -m "$TINY" --runs 0
expect_ok "--threads 0 = every CPU" "$K3" run -m "$TINY" --threads 0 -n 2 --temp 0 hi
for c in run info tokenize eval bench; do
    if "$K3" $c --help >"$TMP/out" 2>&1 && grep -q "usage: k3 $c" "$TMP/out"; then ok "$c --help exits 0"; else bad "$c --help exits 0" "$TMP/out"; fi
done
# the usage on stdout
for c in serve plan grammar "bench throughput" "bench serve"; do
    if "$K3" $c --help >"$TMP/out" 2>/dev/null && grep -q "usage: k3 $c" "$TMP/out"; then ok "$c --help exits 0"; else bad "$c --help exits 0" "$TMP/out"; fi
done
"$K3" --version >"$TMP/out" 2>&1 && grep -q "^k3 [0-9]" "$TMP/out" && ok "k3 --version" || bad "k3 --version" "$TMP/out"
expect_ok "--think implies --chat" "$K3" run -m "$TINY" --think -n 3 --temp 0 "Hi"
grep -q '^\[think\]' "$TMP/out" && ok "--think shows its opening marker" || bad "--think shows its opening marker" "$TMP/out"
"$K3" run -m "$TINY" -n 2 hi >/dev/null 2>"$TMP/err"
grep -q "seed [0-9]* (random" "$TMP/err" && ok "random seed printed" || bad "random seed printed" "$TMP/err"
"$K3" run -m "$TINY" -n 2 --seed 7 hi >/dev/null 2>"$TMP/err"
grep -q "seed 7$" "$TMP/err" && ok "given seed printed" || bad "given seed printed" "$TMP/err"
printf 'The quick brown fox' >"$TMP/p.txt"
"$K3" run -m "$TINY" -n 4 --temp 0 "The quick brown fox" >"$TMP/arg" 2>/dev/null
"$K3" run -m "$TINY" -n 4 --temp 0 -f "$TMP/p.txt" >"$TMP/file" 2>/dev/null
"$K3" run -m "$TINY" -n 4 --temp 0 - <"$TMP/p.txt" >"$TMP/stdin" 2>/dev/null
if [ -s "$TMP/arg" ] && cmp -s "$TMP/arg" "$TMP/file" && cmp -s "$TMP/arg" "$TMP/stdin"; then ok "prompt from -f FILE and - = argument"; else bad "prompt from -f FILE and - = argument"; fi
expect_fail "two prompts" "give one of" "$K3" run -m "$TINY" -f "$TMP/p.txt" hi
# the conversation: two turns piped in; the second prefills only its own message
printf 'Hi\nHello there\n/exit\nnot read\n' | timeout 60 "$K3" run -m "$TINY" --chat -n 4 --temp 0 >"$TMP/chat" 2>"$TMP/chaterr"
rc=$?
t2=$(sed -n 's/^\[turn 2: prefilled \([0-9]*\) new tokens, context \([0-9]*\)\/.*/\1 \2/p' "$TMP/chaterr")
"$K3" run -m "$TINY" --chat -n 0 "Hello there" >/dev/null 2>"$TMP/one"
alone=$(sed -n 's/^prompt \([0-9]*\) tokens.*/\1/p' "$TMP/one")
if [ $rc -eq 0 ] && [ -n "$t2" ] && [ "${t2% *}" = "$alone" ] && [ "${t2#* }" -gt "$alone" ] && ! grep -q "turn 3" "$TMP/chaterr"; then
    ok "chat: turn 2 prefilled only its $alone tokens (context ${t2#* })"
else
    bad "chat: turn 2 prefilled only its own tokens (got '$t2', alone '$alone', exit $rc)" "$TMP/chaterr"
fi
printf 'Hi\n' | timeout 60 "$K3" run -m "$TINY" --system "Be brief." -n 2 --temp 0 >/dev/null 2>"$TMP/syserr"
sys1=$(sed -n 's/^\[turn 1: prefilled \([0-9]*\).*/\1/p' "$TMP/syserr")
hi1=$(sed -n 's/^\[turn 1: prefilled \([0-9]*\).*/\1/p' "$TMP/chaterr")
[ -n "$sys1" ] && [ "$sys1" -gt "$hi1" ] && ok "--system adds a system message to the first turn" || bad "--system adds a system message" "$TMP/syserr"
printf 'Hi\nHello there, how are you today?\n' | timeout 60 "$K3" run -m "$TINY" --chat --ctx 60 -n 4 --temp 0 >/dev/null 2>"$TMP/err"
rc=$?
[ $rc -eq 1 ] && grep -q "conversation is full" "$TMP/err" && ok "chat: a full context is an error naming --ctx" || bad "chat: a full context is an error (exit $rc)" "$TMP/err"
"$K3" eval -m "$TINY" --text "$TMP/t.txt" --ctx 8 >/dev/null 2>"$TMP/err"
if grep -q "$(printf '\r')" "$TMP/err"; then bad "eval progress: no CR frames off a terminal" "$TMP/err"; else ok "eval progress: no CR frames off a terminal"; fi
(cd "$TMP" && "$K3ABS" info >/dev/null 2>"$TMP/err") && ok "default model found from another directory" || bad "default model found from another directory" "$TMP/err"
mkdir -p "$TMP/bin" && cp "$K3" "$TMP/bin/k3"
(cd "$TMP" && "$TMP/bin/k3" info >/dev/null 2>"$TMP/err")
grep -q "looked in" "$TMP/err" && ok "missing default model: the error says where it looked" || bad "missing default model says where it looked" "$TMP/err"
mkdir -p "$TMP/usr/bin" "$TMP/usr/share/k3/models" && cp "$K3" "$TMP/usr/bin/k3" && cp -r "$TINY" "$TMP/usr/share/k3/models/k3-mini"
(cd / && "$TMP/usr/bin/k3" info >"$TMP/out" 2>"$TMP/err") && grep -q "vocab 1024" "$TMP/out" && ok "installed layout: default model under PREFIX/share/k3" || bad "installed layout: default model under PREFIX/share/k3" "$TMP/err"
"$K3" info -m "$TINY" >"$TMP/out" 2>&1
"$K3" bench -m "$TINY" --quant none --runs 1 --prompts 16 --decode-tokens 2 --membw-mb 64 >"$TMP/bench" 2>"$TMP/benchrr"
i_bpt=$(sed -n 's/.*bytes read per decoded token: \([0-9]*\) .*/\1/p' "$TMP/out")
b_bpt=$(sed -n 's/.*bytes read per decoded token: \([0-9]*\) .*/\1/p' "$TMP/bench")
[ -n "$i_bpt" ] && [ "$i_bpt" = "$b_bpt" ] && ok "info and bench agree on bytes read per decoded token ($i_bpt)" || bad "info and bench agree on bytes per token ('$i_bpt' vs '$b_bpt')" "$TMP/bench"
grep -q "s left)" "$TMP/benchrr" && ok "bench shows the time left" || bad "bench shows the time left" "$TMP/benchrr"
"$K3" info -m "$TINY" --quant w8a8+w4a8 >"$TMP/out" 2>&1
"$K3" bench -m "$TINY" --quant w8a8+w4a8 --runs 1 --prompts 16 --decode-tokens 2 --membw-mb 64 >"$TMP/bench" 2>/dev/null
i_q=$(sed -n 's/.*bytes read per decoded token: \([0-9]*\) .*as quantized/\1/p' "$TMP/out")
b_q=$(sed -n 's/.*bytes read per decoded token: \([0-9]*\) .*with --quant w8a8+w4a8.*/\1/p' "$TMP/bench")
[ -n "$i_q" ] && [ "$i_q" = "$b_q" ] && ok "info --quant and bench agree under W8A8+W4A8 ($i_q)" || bad "info --quant and bench agree ('$i_q' vs '$b_q')" "$TMP/bench"

# ---- issue 14: hostile input --------------------------------------------------
damaged
rm "$TMP/m/model.safetensors" && mkfifo "$TMP/m/model.safetensors"
expect_fail "FIFO for model.safetensors" "FIFO" "$K3" info -m "$TMP/m"
damaged
rm "$TMP/m/tiktoken.model" && ln -s /dev/zero "$TMP/m/tiktoken.model"
expect_fail "/dev/zero for tiktoken.model" "character device" "$K3" run -m "$TMP/m" -n 1 hi
expect_fail "tokenize: stdin over the limit" "64 MB limit" sh -c "head -c 70000000 /dev/zero | \"$K3\" tokenize -m \"$TINY\""
expect_fail "eval --text /dev/zero" "64 MB limit" "$K3" eval -m "$TINY" --text /dev/zero
damaged
sed 's/"num_experts": 16,/"num_experts": 514,/; s/"num_expert_group": 1,/"num_expert_group": 257,/' "$TINY/config.json" >"$TMP/m/config.json"
expect_fail "257 expert groups" "num_expert_group" "$K3" info -m "$TMP/m"
damaged
python3 - "$TMP/m/model.safetensors" <<'PY'
import json, struct, sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
h = struct.unpack("<Q", b[:8])[0]
off = json.loads(b[8:8 + h])["language_model.model.layers.0.input_layernorm.weight"]["data_offsets"][0]
b[8 + h + off + 10:8 + h + off + 12] = b"\xc0\x7f"  # element 5: BF16 NaN
open(p, "wb").write(b)
PY
expect_fail "NaN weight: info names the tensor" "input_layernorm.weight.*non-finite" "$K3" info -m "$TMP/m"
expect_fail "NaN weight: run refuses at load" "non-finite" "$K3" run -m "$TMP/m" -n 4 --temp 0 hi
expect_fail "NaN weight: run --quant none --no-check-tensors: the sampler refuses" "not finite" "$K3" run -m "$TMP/m" --quant none --kv-cache f32 --no-check-tensors -n 4 --temp 0 hi

. tests/cli_vision.sh
. tests/cli_grammar.sh
# k3 serve: bad options fail cleanly
expect_fail "serve bad --kv-cache" "kv-cache" "$K3" serve -m "$TINY" --kv-cache f16
expect_fail "serve missing model" "config.json" "$K3" serve -m "$TMP/none" --port 0
expect_fail "serve bad --port" "numeric option" "$K3" serve -m "$TINY" --port 70000
expect_fail "serve bad --block-size" "numeric option" "$K3" serve -m "$TINY" --block-size 5000
expect_fail "serve --api-key empty" "the API key is empty" "$K3" serve -m "$TINY" --port 0 --api-key ""
expect_fail "serve K3_API_KEY empty" "the API key is empty" env K3_API_KEY= "$K3" serve -m "$TINY" --port 0
expect_fail "serve bad --header-timeout" "numeric option" "$K3" serve -m "$TINY" --header-timeout 0
expect_fail "serve --kv-cache-metrics-sample over 1" "kv-cache-metrics-sample expects a finite number from 0 to 1" "$K3" serve -m "$TINY" --kv-cache-metrics --kv-cache-metrics-sample 2
expect_fail "bench serve unreachable" "v1/models" "$K3" bench serve --base-url http://127.0.0.1:1 --tokenizer "$TINY"
expect_fail "bench serve --endpoint unknown" "\-\-endpoint takes completions, chat, responses or messages" "$K3" bench serve --base-url http://127.0.0.1:1 --endpoint embeddings
expect_fail "bench serve --num-prompts not a number" "\-\-num-prompts expects an integer" "$K3" bench serve --base-url http://127.0.0.1:1 --num-prompts abc
expect_fail "bench --dcp --runs not a number" "\-\-runs expects an integer" "$K3" bench -m "$TINY" --dcp 1 --runs x

# pysuite NAME SECONDS FILE PACKAGE...: a Python suite of tests/harness.py's shape in the
# project's .venv (scripts/venv.sh makes it, installing what is missing), its checks shown
# and its closing `NAME: N passed, N failed, N skipped` added to this suite's counts
pysuite() {
    ps_name=$1 ps_time=$2 ps_file=$3
    shift 3
    if PY=$(sh scripts/venv.sh "$@" 2>"$TMP/venv.err"); then
        timeout "$ps_time" "$PY" "$ps_file" "$K3" >"$TMP/$ps_name.out" 2>&1
        grep -E "^(ok|FAIL|skip) |^    " "$TMP/$ps_name.out"
        ps_line=$(grep -E "^$ps_name: [0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$" "$TMP/$ps_name.out" | tail -n 1)
        if [ -z "$ps_line" ]; then
            bad "$ps_name: the suite did not finish" "$TMP/$ps_name.out"
        else
            set -- $ps_line
            pass=$((pass + $2))
            fail=$((fail + $4))
            skip=$((skip + ${6:-0}))
        fi
    else
        bad "$ps_name: a Python with $* (scripts/venv.sh)" "$TMP/venv.err"
    fi
}

# k3 serve end to end with the official openai client
pysuite serve 900 tests/serve_openai.py openai
# the server loses no request: half-closed clients, the drain on SIGTERM, an engine
# failure, the work caps, keep-alive, CORS
pysuite robust 600 tests/serve_robust.py openai
# /v1/responses with the official openai client, /v1/messages with the official anthropic client
pysuite responses 900 tests/serve_responses.py openai
pysuite anthropic 900 tests/serve_anthropic.py openai anthropic
# the sampling knobs, roles and thinking
pysuite knobs 600 tests/serve_knobs.py openai
# structured outputs with the official openai client and jsonschema
pysuite structured 600 tests/serve_structured.py openai jsonschema pydantic
# what agent frameworks send (openai-agents, instructor: installed from PyPI when
# missing; a framework that cannot be installed is a skip in the suite)
sh scripts/venv.sh openai-agents=agents instructor >/dev/null 2>&1 || echo "skip cli: openai-agents or instructor could not be installed from PyPI (their checks skip)"
pysuite agents 600 tests/serve_agents.py openai jsonschema pydantic

# speculative decoding through k3 run: the same text with drafts as without, greedy and seeded,
# on every kind of checkpoint, over a prompt that repeats and one that does not (the default
# kernel table; docs/spec.md says where a table's products of many rows make it differ)
SPEC_P1="The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. The cat"
SPEC_P2="It is a truth universally acknowledged, that"
for m in models/k3-mini $TINY tests/models/tiny-dsa tests/models/official-tiny; do
    for p in 1 2; do
        eval "prompt=\$SPEC_P$p"
        for temp in 0 0.8; do
            same=yes
            timeout 120 "$K3" run -m "$m" -n 40 --temp $temp --seed 7 --speculative off "$prompt" >"$TMP/s.off" 2>"$TMP/s.err" || same=error
            for method in suffix ngram; do
                timeout 120 "$K3" run -m "$m" -n 40 --temp $temp --seed 7 --speculative $method "$prompt" >"$TMP/s.on" 2>>"$TMP/s.err" || same=error
                cmp -s "$TMP/s.off" "$TMP/s.on" || same=no
            done
            if [ $same = yes ]; then ok "run --speculative suffix|ngram = off: $m, prompt $p, temp $temp"
            else bad "run --speculative suffix|ngram = off: $m, prompt $p, temp $temp ($same)" "$TMP/s.err"; fi
        done
    done
done
# the closing line says the acceptance; a repeating prompt on k3-mini accepts drafts (the cost
# model off: on a loaded machine its timings may rightly find drafting not worth it)
timeout 120 "$K3" run -n 40 --temp 0 --speculative suffix --spec-no-cost-model "$SPEC_P1" >/dev/null 2>"$TMP/err"
if grep -q "mean acceptance length" "$TMP/err" && ! grep -q " 0 accepted" "$TMP/err"; then ok "run --speculative: acceptance on the closing line"
else bad "run --speculative: acceptance on the closing line" "$TMP/err"; fi
expect_fail "run --speculative eagle" "suffix, ngram, draft_model or off" "$K3" run -m $TINY --speculative eagle x
expect_fail "run --num-speculative-tokens 17" "num-speculative-tokens" "$K3" run -m $TINY --speculative suffix --num-speculative-tokens 17 x
expect_fail "run --speculative draft_model without --draft-model" "draft-model DIR" "$K3" run -m $TINY --speculative draft_model x
expect_fail "run --speculative with --dump-logits" "through the engine" "$K3" run -m $TINY --speculative suffix --dump-logits /dev/null x
# the suffix tree alone: a prompt's ids in, its nodes and ns a token out; what is not ids is refused
printf '1 2 3 1 2 3 1 2 4\n5 6' >"$TMP/ids"
timeout 60 "$K3" bench spec --stree "$TMP/ids" --runs 2 >"$TMP/out" 2>"$TMP/err"
if grep -q "^file *11 tokens, 51 nodes" "$TMP/out" && grep -q "^random *11 tokens" "$TMP/out"; then ok "bench spec --stree: a text's nodes and times"
else bad "bench spec --stree: a text's nodes and times" "$TMP/out"; fi
printf '1 2 x3' >"$TMP/ids"
expect_fail "bench spec --stree, not token ids" "not a token id at byte 4" "$K3" bench spec --stree "$TMP/ids"
expect_fail "bench spec --stree, no file" "cannot" "$K3" bench spec --stree "$TMP/none"
# tiny drafting for itself: every greedy draft accepted, but those after the end of the message
# in the last verify pass (fewer than --num-speculative-tokens 4)
timeout 120 "$K3" run -m $TINY -n 40 --temp 0 --repeat-penalty 1 --speculative draft_model --draft-model $TINY --num-speculative-tokens 4 --spec-no-cost-model "$SPEC_P2" >"$TMP/s.on" 2>"$TMP/err"
timeout 120 "$K3" run -m $TINY -n 40 --temp 0 --repeat-penalty 1 --speculative off "$SPEC_P2" >"$TMP/s.off" 2>/dev/null
acc=$(sed -n 's/.* with \([0-9]*\) draft tokens, \([0-9]*\) accepted.*/\1 \2/p' "$TMP/err")
lost=4
grep -q "(end of message)" "$TMP/err" || lost=1
if cmp -s "$TMP/s.on" "$TMP/s.off" && [ -n "$acc" ] && [ "${acc% *}" -gt 0 ] && [ $((${acc% *} - ${acc#* })) -ge 0 ] &&
    [ $((${acc% *} - ${acc#* })) -lt $lost ]; then
    ok "run --draft-model tiny drafting for itself: the same text, every draft accepted but after the end ($acc)"
else bad "run --draft-model tiny drafting for itself (drafted / accepted: '$acc')" "$TMP/err"; fi

# speculative decoding through k3 serve (tests/serve_spec.py; --mpi: also under mpirun -np 2 --dcp 2)
if PY=$(sh scripts/venv.sh openai 2>"$TMP/venv.err"); then
    mpi=
    command -v mpirun >/dev/null 2>&1 && mpi=--mpi
    timeout 600 "$PY" tests/serve_spec.py "$K3" $mpi >"$TMP/spec.out" 2>&1
    grep -E "^(ok|FAIL|skip) |^    " "$TMP/spec.out"
    xl=$(grep -E "^spec: [0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$" "$TMP/spec.out" | tail -n 1 | tr -d ,)
    xp=$(echo "$xl" | awk '{print $2}')
    xf=$(echo "$xl" | awk '{print $4}')
    if [ -z "$xp" ]; then
        bad "spec: the speculative decoding test did not finish" "$TMP/spec.out"
    else
        pass=$((pass + xp))
        fail=$((fail + xf))
        skip=$((skip + $(echo "$xl" | awk '{print $6 + 0}')))
    fi
else
    bad "spec: a Python with the openai client (scripts/venv.sh)" "$TMP/venv.err"
fi

echo "cli: $pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
