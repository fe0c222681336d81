# cli_vision.sh -- end-to-end checks of images in `k3 run`, `k3 info` and
# `k3 bench`; sourced by tests/cli.sh (its helpers and counters).
VT=tests/models/vision-tiny
VI=tests/golden/vision/images

expect_ok "run --image (two images)" "$K3" run -m "$VT" --quant none --temp 0 -n 6 \
    --image "$VI/rgb_200x130.png" --image "$VI/photo_67x45.jpg" "Which is brighter?"
grep -q "rgb_200x130.png: 200x130 -> 142x92, 8x12 patches, 24 tokens" "$TMP/err" &&
    grep -q "photo_67x45.jpg: 67x45 -> 67x45, 4x6 patches, 6 tokens" "$TMP/err" &&
    grep -q "prompt 63 tokens" "$TMP/err" && ok "run --image reports sizes and tokens" ||
    bad "run --image reports sizes and tokens" "$TMP/err"
expect_ok "run --chat --image (RGBA, W8A8 tower)" "$K3" run -m "$VT" --chat --quant w8a8 --temp 0 -n 4 \
    --image "$VI/rgba_180x150.png" "Describe this."
# the image changes what the model says (greedy, 8 tokens)
"$K3" run -m "$VT" --quant none --temp 0 -n 8 --image "$VI/rgb_112x112.png" "Hi" >"$TMP/a" 2>/dev/null
"$K3" run -m "$VT" --quant none --temp 0 -n 8 --image "$VI/grey_300x40.png" "Hi" >"$TMP/b" 2>/dev/null
if [ -s "$TMP/a" ] && ! cmp -s "$TMP/a" "$TMP/b"; then ok "different images, different text"; else bad "different images, different text"; fi
expect_ok "info shows the vision tower" "$K3" info -m "$VT"
grep -q "vision: MoonViT3d, 2 blocks" "$TMP/out" && ok "info vision lines" || bad "info vision lines" "$TMP/out"
"$K3" info -m "$TINY" 2>/dev/null | grep -q "vision: none (text only)" && ok "info: text-only checkpoint" ||
    bad "info: text-only checkpoint"
expect_ok "bench --json with a tower" "$K3" bench -m "$VT" --runs 1 --prompts 16 --decode-tokens 2 --membw-mb 64 --json
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); e=d["image_encode"]; assert len(e) == 3 and all(r["tower_ms"] > 0 and r["tokens"] > 0 for r in e)' "$TMP/out" 2>/dev/null &&
    ok "bench image_encode fields" || bad "bench image_encode fields" "$TMP/out"

expect_fail "image on a text-only checkpoint" "no vision tower" "$K3" run -m "$TINY" -n 1 --image "$VI/rgb_112x112.png" hi
expect_fail "image file missing" "No such file" "$K3" run -m "$VT" -n 1 --image "$TMP/none.png" hi
expect_fail "image not PNG, JPEG, WEBP or GIF" "not a PNG, JPEG, WEBP or GIF image" "$K3" run -m "$VT" -n 1 --image "$VT/config.json" hi
expect_ok "run --image WEBP and GIF (first frames)" "$K3" run -m "$VT" --quant none --temp 0 -n 2 \
    --image "$VI/webp_anim_offset_140x100.webp" --image "$VI/gif_trns_150x100.gif" "Which is brighter?"
grep -q "140x100 -> 133x95, 8x10 patches, 20 tokens" "$TMP/err" && grep -q "150x100 -> 143x95, 8x12 patches, 24 tokens" "$TMP/err" && ok "run --image reports WEBP/GIF sizes" ||
    bad "run --image reports WEBP/GIF sizes" "$TMP/err"
head -c 2000 "$VI/webp_lossy_150x100.webp" >"$TMP/cut.webp"
expect_fail "truncated WEBP" "bad WEBP: the file is truncated" "$K3" run -m "$VT" -n 1 --image "$TMP/cut.webp" hi
head -c 700 "$VI/gif_interlaced_53x37.gif" >"$TMP/cut.gif"
expect_fail "truncated GIF" "bad GIF: the file is truncated" "$K3" run -m "$VT" -n 1 --image "$TMP/cut.gif" hi
# a GIF screen of 40000 x 40000 with a 1x1 frame: refused from its first 13 bytes
printf 'GIF89a\100\234\100\234\200\000\000\000\000\000\377\377\377,\000\000\000\000\001\000\001\000\000\002\002D\001\000;' >"$TMP/bomb.gif"
expect_fail "oversized GIF" "over the limit" "$K3" run -m "$VT" -n 1 --image "$TMP/bomb.gif" hi
head -c 2000 "$VI/rgb_200x130.png" >"$TMP/cut.png"
expect_fail "truncated PNG" "truncated" "$K3" run -m "$VT" -n 1 --image "$TMP/cut.png" hi
head -c 600 "$VI/photo_67x45.jpg" >"$TMP/cut.jpg"
expect_fail "truncated JPEG" "truncated" "$K3" run -m "$VT" -n 1 --image "$TMP/cut.jpg" hi
# a PNG header claiming 30000 x 30000 pixels (a decompression bomb's first bytes)
python3 -c '
import struct, sys, zlib
ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
sys.stdout.buffer.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 90001)))' >"$TMP/bomb.png"
expect_fail "oversized image" "over the limit" "$K3" run -m "$VT" -n 1 --image "$TMP/bomb.png" hi
expect_fail "image with --ids" "text prompt" "$K3" run -m "$VT" -n 1 --ids 1,2 --image "$VI/rgb_112x112.png"
expect_fail "image in a conversation" "not a conversation" "$K3" run -m "$VT" --chat --image "$VI/rgb_112x112.png"
expect_ok "run --system --image" "$K3" run -m "$VT" --system "Be brief." --temp 0 -n 2 --image "$VI/dot_5x3.png" "Hi"
