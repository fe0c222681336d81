#!/usr/bin/env python3
"""Goldens for k3's vision path, made with Moonshot's own code.

The official K3 code ships in the PyPI wheel llmcompressor==0.14.0.1 under
llmcompressor/modeling/kimi_k3/ (modeling_kimi_k3.py, media_utils.py,
kimi_k3_vision_processing.py); it is imported as that package and nothing of
it is copied here. This script

  1. builds a tiny random KimiK3ForConditionalGeneration (MoonViT3d tower,
     sd2_tpool merger, patchmergerv2 projector, and an all-MLA text model:
     KDA needs fla's Triton kernels, which do not run on CPU) and writes it
     with save_pretrained, plus a preprocessor_config.json from the official
     KimiK3VisionProcessor and the tiny test tokenizer with the media specials;
  2. writes small test images (odd sizes, RGBA with alpha, grey, palette,
     JPEG);
  3. runs the official processor, tower + projector and whole model, and
     writes what they produce as goldens (safetensors, float32/int64).

Self-contained: needs torch (CPU), transformers, safetensors, numpy, Pillow
and the llmcompressor wheel (installed --no-deps). Usage, from the repo root:

    TORCHDYNAMO_DISABLE=1 .venv/bin/python tools/official_vision.py \
        --model tests/models/vision-tiny --golden tests/golden/vision

The checkpoint, images and goldens are deterministic for a given seed and
library versions (recorded in tests/golden/vision/README.md).
"""
import argparse
import json
import math
import os
import shutil
import struct
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file


def _bare_packages():
    """llmcompressor is installed --no-deps: its package __init__ files pull in
    loguru, compressed-tensors and more. Register the two parent packages as
    empty namespaces so that only the kimi_k3 folder's own modules (and
    modeling/moe/context.py, which it imports) are executed, unchanged."""
    import importlib.util
    import types
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None:
        sys.exit("pip install --no-deps llmcompressor==0.14.0.1 first")
    base = list(spec.submodule_search_locations)[0]
    for name, sub in (("llmcompressor", ""), ("llmcompressor.modeling", "modeling"),
                      ("llmcompressor.modeling.moe", "modeling/moe")):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [os.path.join(base, sub)]
            sys.modules[name] = m


_bare_packages()
from llmcompressor.modeling.kimi_k3 import configuration_kimi_k3 as cfgmod
from llmcompressor.modeling.kimi_k3 import modeling_kimi_k3 as mk
from llmcompressor.modeling.kimi_k3.kimi_k3_vision_processing import KimiK3VisionProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "models", "tiny")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import k3ckpt  # noqa: E402

# Media specials of the tiny tokenizer: K3 has <|media_begin|> 163602,
# <|media_content|> 163603, <|media_end|> 163604, <|media_pad|> 163605, i.e.
# base+18..21; the tiny tokenizer's base is 768 and it already has the pad.
MEDIA = {786: "<|media_begin|>", 787: "<|media_content|>", 788: "<|media_end|>"}
PAD_ID = 789

TEXT_CONFIG = dict(
    model_type="kimi_k3", vocab_size=1024, hidden_size=64, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
    mla_use_output_gate=True, attn_res_block_size=2, intermediate_size=96,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
    bos_token_id=768, eos_token_id=770, pad_token_id=1023, num_nextn_predict_layers=0,
)

VISION_CONFIG = dict(
    patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
    pos_emb_type="divided_fixed", vt_num_attention_heads=2, vt_num_hidden_layers=2,
    vt_hidden_size=48, vt_intermediate_size=96, merge_kernel_size=[2, 2],
    merge_type="sd2_tpool", _attn_implementation="eager", mm_projector_type="patchmergerv2",
    mm_hidden_size=48, projector_hidden_act="gelu", projector_ln_eps=1e-5,
    qkv_hidden_size=64, norm_type="rmsnorm", attn_bias=False, patch_embed_proj_bias=False,
    mlp_type="mlp2", linear_bias=False, activation_func="gelu_pytorch_tanh",
    pos_emb_interpolation_mode="bilinear", text_hidden_size=64,
)

# A small patch budget so that the test images really get resized (the
# published one, 65536 patches / 512 a side, leaves small images alone).
MEDIA_PROC_CFG = dict(
    in_patch_limit=64, patch_size=14, merge_kernel_size=2, patch_limit_on_one_side=16,
    fixed_output_tokens=None, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    transparent_bg_config=dict(pattern="chessboard", chessboard_square_size=8,
                               chessboard_square_on_top_left=True,
                               chessboard_white_value=255, chessboard_gray_value=180),
    transparent_bg_fill_stage="after_resize",
)


def write_images(d, rng):
    """Small inputs: every mode the processor treats differently."""
    os.makedirs(d, exist_ok=True)
    out = []

    def smooth(h, w, c):  # a gradient plus noise: resampling has something to do
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                         ((x + y) * 7) % 256, (x * y) % 256], -1)[..., :c]
        noise = rng.integers(-40, 41, size=(h, w, c))
        return np.clip(base + noise, 0, 255).astype(np.uint8)

    im = Image.fromarray(smooth(130, 200, 3), "RGB")            # budget resize
    im.save(os.path.join(d, "rgb_200x130.png")); out.append("rgb_200x130.png")
    a = smooth(150, 180, 4)
    yy, xx = np.mgrid[0:150, 0:180]
    a[..., 3] = np.clip((xx * 2 + yy) % 300 - 20, 0, 255)          # alpha 0..255
    Image.fromarray(a, "RGBA").save(os.path.join(d, "rgba_180x150.png"))
    out.append("rgba_180x150.png")
    Image.fromarray(smooth(40, 300, 1)[..., 0], "L").save(os.path.join(d, "grey_300x40.png"))
    out.append("grey_300x40.png")                                # per-side limit
    Image.fromarray(smooth(45, 67, 3), "RGB").save(os.path.join(d, "photo_67x45.jpg"),
                                                  quality=90)
    out.append("photo_67x45.jpg")                               # no resize, padded
    p = Image.fromarray(smooth(101, 170, 3), "RGB").quantize(colors=16)
    p.info["transparency"] = 3
    p.save(os.path.join(d, "palette_170x101.png"), transparency=3)
    out.append("palette_170x101.png")                           # P: nearest + tRNS
    Image.fromarray(smooth(112, 112, 3), "RGB").save(os.path.join(d, "rgb_112x112.png"))
    out.append("rgb_112x112.png")                               # grid = pos table
    Image.fromarray(smooth(3, 5, 3), "RGB").save(os.path.join(d, "dot_5x3.png"))
    out.append("dot_5x3.png")                                   # tiny: one token
    Image.fromarray(smooth(400, 60, 4), "RGBA").save(os.path.join(d, "tall_60x400.png"))
    out.append("tall_60x400.png")                               # Pillow 13: vertical pass first
    bits = (rng.integers(0, 2, (90, 130)) * 255).astype(np.uint8)
    Image.fromarray(bits, "L").convert("1").save(os.path.join(d, "bw_130x90.png"), transparency=255)
    out.append("bw_130x90.png")                                 # "1" with a tRNS key: NEAREST + alpha
    Image.fromarray(rng.integers(0, 4, (70, 150)).astype(np.uint8) * 85, "L").save(
        os.path.join(d, "grey2bit_150x70.png"), bits=2)
    out.append("grey2bit_150x70.png")                           # 2-bit grey, scaled to 0..255
    Image.fromarray(smooth(100, 120, 1)[..., 0], "L").save(os.path.join(d, "greykey_120x100.png"), transparency=17)
    out.append("greykey_120x100.png")                           # "L" + tRNS key, applied after the resize
    Image.fromarray(smooth(95, 140, 2), "LA").save(os.path.join(d, "la_140x95.png"))
    out.append("la_140x95.png")                                 # "LA": premultiplied like RGBA
    Image.fromarray(smooth(80, 160, 3), "RGB").save(os.path.join(d, "rgbkey_160x80.png"), transparency=(1, 2, 3))
    out.append("rgbkey_160x80.png")                             # RGB + tRNS: ignored by the processor
    Image.fromarray(smooth(80, 150, 1)[..., 0], "L").save(os.path.join(d, "grey_150x80.jpg"), quality=80)
    out.append("grey_150x80.jpg")                               # greyscale JPEG
    return out


# ---- WEBP and GIF: the first frame as Pillow opens it ----------------------

def _gif_lzw(indices, min_size):
    """GIF's variable-width LZW (what any encoder writes): a clear code first
    and whenever the table is nearly full, the end code last; packed LSB first."""
    clear, end = 1 << min_size, (1 << min_size) + 1
    out, acc, nacc = bytearray(), 0, 0

    def put(code, width):
        nonlocal acc, nacc
        acc |= code << nacc
        nacc += width
        while nacc >= 8:
            out.append(acc & 255)
            acc >>= 8
            nacc -= 8

    def reset():
        return {bytes([i]): i for i in range(clear)}, end + 1, min_size + 1

    table, nxt, width = reset()
    put(clear, width)
    w = b""
    for k in indices:
        wk = w + bytes([k])
        if wk in table:
            w = wk
            continue
        put(table[w], width)
        if nxt < 4093:
            table[wk] = nxt
            nxt += 1
            if nxt > (1 << width) and width < 12:
                width += 1
        else:
            put(clear, width)
            table, nxt, width = reset()
        w = bytes([k])
    if w:
        put(table[w], width)
    put(end, width)
    if nacc:
        out.append(acc & 255)
    return bytes(out)


def _gif_blocks(data):
    return b"".join(bytes([len(data[i:i + 255])]) + data[i:i + 255] for i in range(0, len(data), 255)) + b"\0"


def _gif_table(colors, bits):
    """A colour table of 2**bits entries (RGB triples), padded with black."""
    flat = bytearray()
    for c in colors:
        flat += bytes(c)
    return bytes(flat) + b"\0" * (3 * (1 << bits) - len(flat))


def gif_bytes(screen, frame_idx, x0=0, y0=0, global_colors=None, global_bits=0, local_colors=None,
              local_bits=0, transparency=None, interlace=False, min_code=8, background=0):
    """A GIF89a of one frame written field by field (Pillow's writer always
    puts the first frame on the whole screen, with its own palette layout)."""
    fh, fw = frame_idx.shape
    g = bytearray(b"GIF89a")
    g += struct.pack("<HH", *screen)
    flags = (0x80 | 0x70 | (global_bits - 1)) if global_colors is not None else 0x70
    g += bytes([flags, background, 0])
    if global_colors is not None:
        g += _gif_table(global_colors, global_bits)
    if transparency is not None:
        g += b"\x21\xf9\x04" + bytes([1]) + struct.pack("<H", 0) + bytes([transparency, 0])
    g += b"\x2c" + struct.pack("<HHHH", x0, y0, fw, fh)
    lflags = (0x40 if interlace else 0) | ((0x80 | (local_bits - 1)) if local_colors is not None else 0)
    g += bytes([lflags])
    if local_colors is not None:
        g += _gif_table(local_colors, local_bits)
    rows = list(range(fh))
    if interlace:
        rows = [y for start, step in ((0, 8), (4, 8), (2, 4), (1, 2)) for y in range(start, fh, step)]
    g += bytes([min_code]) + _gif_blocks(_gif_lzw(frame_idx[rows].reshape(-1).tolist(), min_code))
    return bytes(g + b";")


def _riff_chunk(tag, payload):
    return tag + struct.pack("<I", len(payload)) + payload + (b"\0" if len(payload) & 1 else b"")


def _webp_frame_chunks(still):
    """The frame chunks (ALPH + VP8, or VP8L) of a still WEBP file."""
    assert still[:4] == b"RIFF" and still[8:12] == b"WEBP"
    out, off = b"", 12
    while off < len(still):
        tag, n = still[off:off + 4], struct.unpack("<I", still[off + 4:off + 8])[0]
        if tag in (b"ALPH", b"VP8 ", b"VP8L"):
            out += still[off:off + 8 + n + (n & 1)]
        off += 8 + n + (n & 1)
    return out


def webp_anim_bytes(canvas, frames, alpha):
    """An animated WEBP (VP8X + ANIM + ANMF) from still frames placed at even
    offsets: frames = [(still_webp_bytes, x, y, w, h)]."""
    vp8x = bytes([0x02 | (0x10 if alpha else 0), 0, 0, 0]) + struct.pack("<I", canvas[0] - 1)[:3] \
        + struct.pack("<I", canvas[1] - 1)[:3]
    body = _riff_chunk(b"VP8X", vp8x) + _riff_chunk(b"ANIM", struct.pack("<IH", 0, 0))
    for still, x, y, w, h in frames:
        hdr = struct.pack("<I", x // 2)[:3] + struct.pack("<I", y // 2)[:3] + struct.pack("<I", w - 1)[:3] \
            + struct.pack("<I", h - 1)[:3] + struct.pack("<I", 100)[:3] + bytes([0])
        body += _riff_chunk(b"ANMF", hdr + _webp_frame_chunks(still))
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def write_format_images(d, rng):
    """WEBP and GIF inputs: each way Pillow's first frame differs."""
    import io
    os.makedirs(d, exist_ok=True)
    out = []

    def smooth(h, w, c, noise=24):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                         ((x + y) * 7) % 256, (x * y) % 256], -1)[..., :c]
        return np.clip(base + rng.integers(-noise, noise + 1, size=(h, w, c)), 0, 255).astype(np.uint8)

    def save(name, data):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        out.append(name)

    def pil_bytes(im, fmt, **kw):
        b = io.BytesIO()
        im.save(b, fmt, **kw)
        return b.getvalue()

    # WEBP: Pillow says RGB or RGBA from the bitstream's alpha flag
    save("webp_lossy_150x100.webp", pil_bytes(Image.fromarray(smooth(100, 150, 3), "RGB"), "WEBP", quality=80))
    save("webp_lossless_90x70.webp", pil_bytes(Image.fromarray(smooth(70, 90, 3), "RGB"), "WEBP", lossless=True))
    a = smooth(120, 160, 4)
    yy, xx = np.mgrid[0:120, 0:160]
    a[..., 3] = np.clip((xx * 3 + yy) % 290 - 20, 0, 255)
    save("webp_alpha_160x120.webp", pil_bytes(Image.fromarray(a, "RGBA"), "WEBP", quality=70))
    save("webp_alpha_lossless_64x48.webp",
         pil_bytes(Image.fromarray(a[:48, :64], "RGBA"), "WEBP", lossless=True, exact=True))
    frames = [Image.fromarray(smooth(100, 160, 3), "RGB") for _ in range(3)]
    save("webp_anim_160x100.webp", pil_bytes(frames[0], "WEBP", save_all=True, append_images=frames[1:],
                                            duration=100, quality=75))
    # animated, the first frame smaller than the canvas (transparent around it)
    f0 = pil_bytes(Image.fromarray(a[:40, :60], "RGBA"), "WEBP", quality=75)
    f1 = pil_bytes(Image.fromarray(smooth(100, 140, 3), "RGB"), "WEBP", quality=75)
    save("webp_anim_offset_140x100.webp",
         webp_anim_bytes((140, 100), [(f0, 24, 30, 60, 40), (f1, 0, 0, 140, 100)], True))
    # the same layout with no alpha anywhere: "RGB", black around the frame
    g0 = pil_bytes(Image.fromarray(smooth(40, 60, 3), "RGB"), "WEBP", quality=75)
    save("webp_anim_offset_rgb_140x100.webp",
         webp_anim_bytes((140, 100), [(g0, 24, 30, 60, 40), (f1, 0, 0, 140, 100)], False))

    # GIF through Pillow's own writer (interlaced from 16 rows up)
    p = Image.fromarray(smooth(100, 170, 3), "RGB").quantize(colors=64)
    save("gif_palette_170x100.gif", pil_bytes(p, "GIF"))                       # "P", interlaced
    p = Image.fromarray(smooth(100, 150, 3), "RGB").quantize(colors=32)
    save("gif_trns_150x100.gif", pil_bytes(p, "GIF", transparency=5, interlace=False))  # "P" + transparency
    save("gif_grey_250x40.gif", pil_bytes(Image.fromarray(smooth(40, 250, 1)[..., 0], "L"), "GIF"))  # "L"
    fr = [Image.fromarray(smooth(70, 110, 3), "RGB").quantize(colors=48) for _ in range(3)]
    save("gif_anim_110x70.gif", pil_bytes(fr[0], "GIF", save_all=True, append_images=fr[1:], duration=80))

    # GIF written field by field
    pal = [tuple(int(v) for v in rng.integers(0, 256, 3)) for _ in range(32)]
    idx = rng.integers(0, 32, (40, 70)).astype(np.uint8)
    idx[:, 20:50] = (np.arange(30)[None, :] // 3 + np.arange(40)[:, None] // 5) % 32   # runs: real LZW work
    save("gif_offset_trns_150x100.gif", gif_bytes((150, 100), idx, 25, 17, pal, 5, transparency=9))
    lpal = [tuple(int(v) for v in rng.integers(0, 256, 3)) for _ in range(16)]
    save("gif_offset_local_120x80.gif",
         gif_bytes((120, 80), idx % 16, 40, 30, pal, 5, local_colors=lpal, local_bits=4, min_code=4))
    save("gif_beyond_60x50.gif", gif_bytes((60, 50), idx, 30, 20, pal, 5))      # frame past the screen
    tall = rng.integers(0, 32, (37, 53)).astype(np.uint8)
    save("gif_interlaced_53x37.gif", gif_bytes((53, 37), tall, 0, 0, pal, 5, interlace=True, min_code=5))
    ramp = [(i, i, i) for i in range(256)]
    g = smooth(100, 160, 1)[..., 0]
    save("gif_greykey_160x100.gif", gif_bytes((160, 100), g, 0, 0, ramp, 8, transparency=int(g[50, 80])))
    save("gif_nopalette_160x100.gif", gif_bytes((160, 100), g // 2, 0, 0))
    # a local grey ramp under a global palette: Pillow says "L" but keeps the
    # global palette on the pixels (and its resize refuses it: no resize here)
    save("gif_local_ramp_90x50.gif", gif_bytes((90, 50), g[:50, :90], 0, 0, pal, 5, local_colors=ramp,
                                               local_bits=8))
    short = rng.integers(0, 16, (30, 44)).astype(np.uint8)                       # indices past a 4-colour palette
    save("gif_short_palette_44x30.gif", gif_bytes((44, 30), short, 0, 0, pal[:4], 2, min_code=4))
    big = rng.integers(0, 256, (64, 96)).astype(np.uint8)                        # 12-bit codes, table resets
    save("gif_noise_96x64.gif", gif_bytes((96, 64), big, 0, 0, pal * 8, 8))
    return out


def format_goldens(golden_dir, seed):
    """formats.safetensors: for each WEBP / GIF image the official processor's
    pixel values (as the uint8 values they normalize) and grid, and the first
    frame as Pillow decodes it (convert("RGBA"))."""
    from safetensors.numpy import save_file as save_np
    from llmcompressor.modeling.kimi_k3.media_utils import normalize
    rng = np.random.default_rng(seed + 100)
    img_dir = os.path.join(golden_dir, "images")
    names = write_format_images(img_dir, rng)
    proc = KimiK3VisionProcessor(media_proc_cfg=dict(MEDIA_PROC_CFG))
    gold, meta = {}, []
    for i, n in enumerate(names):
        path = os.path.join(img_dir, n)
        im = Image.open(path)
        mode, info = im.mode, dict(im.info)
        rgba = np.asarray(im.convert("RGBA")).copy()
        bf = proc.preprocess([{"type": "image", "image": Image.open(path)}], return_tensors="pt")
        px, grid = bf["pixel_values"].float().numpy(), bf["grid_thws"][0].numpy().astype(np.int64)
        ntok = proc.media_tokens_calculator({"type": "image", "image": Image.open(path)})
        # the pixel values are the processor's uint8 image normalized: kept as
        # those bytes (a quarter of the size), after checking that the
        # official normalize gives back the processor's floats bit for bit
        u8 = np.rint((px * np.float32(0.5) + np.float32(0.5)) * 255).astype(np.uint8)
        back = normalize(u8.transpose(0, 2, 3, 1), np.array(MEDIA_PROC_CFG["image_mean"]),
                         1.0 / np.array(MEDIA_PROC_CFG["image_std"])).transpose(0, 3, 1, 2)
        assert np.array_equal(back, px), n
        gold[f"fmt{i}.pixels"] = np.ascontiguousarray(u8)
        gold[f"fmt{i}.grid_thw"] = grid
        gold[f"fmt{i}.rgba"] = rgba
        m = dict(file=n, width=im.size[0], height=im.size[1], mode=mode, grid=grid.tolist(), tokens=int(ntok))
        if "transparency" in info:
            m["transparency"] = info["transparency"]
        meta.append(m)
        print(f"{n}: {im.size[0]}x{im.size[1]} mode {mode}{' transparency %s' % info['transparency'] if 'transparency' in info else ''}"
              f" frames {getattr(im, 'n_frames', 1)} grid {grid.tolist()} tokens {ntok}")
    save_np(gold, os.path.join(golden_dir, "formats.safetensors"), metadata={"images": json.dumps(meta)})
    with open(os.path.join(golden_dir, "formats.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("Pillow", Image.__version__, "libwebp", __import__("PIL.features").features.version("webp"))


def redraw(model, seed):
    """Deterministic weights for every parameter (the official _init_weights
    returns early, so some parameters would be left uninitialised)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "norm0" in name or "norm1" in name \
                    or "layernorm" in name or name.endswith("_norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "pos_emb" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def eager(model):
    """transformers resolves the config's _attn_implementation to "sdpa", which
    the tower's table does not have; its own CPU path is "eager"."""
    for b in model.vision_tower.encoder.blocks:
        b.attn_implementation = "eager"
    return model


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def write_bench(out, seed):
    text = dict(TEXT_CONFIG, hidden_size=1024, num_hidden_layers=1,
                intermediate_size=1024, q_lora_rank=64, kv_lora_rank=64)
    vision = dict(_attn_implementation="eager", text_hidden_size=1024)  # KimiK3VisionConfig defaults = the release
    cfg = cfgmod.KimiK3Config(text_config=text, vision_config=vision, media_placeholder_token_id=PAD_ID,
                              pad_token_id=1023, bos_token_id=768, eos_token_id=770)
    cfg.architectures = ["KimiK3ForConditionalGeneration"]
    model = mk.KimiK3ForConditionalGeneration(cfg).eval()
    redraw(model, seed)
    model = model.to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cpath = os.path.join(out, "config.json")
    cj = json.load(open(cpath))
    cj["text_config"].pop("rope_parameters", None)
    with open(cpath, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    for n in ("generation_config.json",):
        if os.path.exists(os.path.join(out, n)):
            os.remove(os.path.join(out, n))
    shutil.copy(os.path.join(TINY, "tiktoken.model"), out)
    shutil.copy(os.path.join(ROOT, "tests", "models", "vision-tiny", "tokenizer_config.json"), out)
    k3ckpt.install_hf_tokenizer(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.vision_tower.parameters()) / 1e6:.1f}M tower parameters")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tests/models/vision-tiny")
    ap.add_argument("--golden", default="tests/golden/vision")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--bench", metavar="DIR",
                    help="instead: write a checkpoint with the released tower size (27 blocks, "
                         "hidden 1024, BF16, no preprocessor_config.json = the published budget) "
                         "and a 1-layer text model, for `k3 bench`'s image-encode figure")
    ap.add_argument("--formats", action="store_true",
                    help="instead: write the WEBP and GIF images and formats.safetensors only "
                         "(the processor; no model)")
    a = ap.parse_args()
    if a.formats:
        return format_goldens(a.golden, a.seed)
    if a.bench:
        return write_bench(a.bench, a.seed)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)

    # ---- checkpoint ----
    cfg = cfgmod.KimiK3Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                              media_placeholder_token_id=PAD_ID, pad_token_id=1023,
                              bos_token_id=768, eos_token_id=770)
    cfg.architectures = ["KimiK3ForConditionalGeneration"]
    model = eager(mk.KimiK3ForConditionalGeneration(cfg).float().eval())
    redraw(model, a.seed)
    os.makedirs(a.model, exist_ok=True)
    model.save_pretrained(a.model, safe_serialization=True)
    # transformers 5 writes text_config.rope_parameters (rope_theta 10000,
    # "default") for every config; K3's MLA is NoPE (mla_use_nope) and k3's
    # config parser refuses fields it does not read, so it is dropped here.
    cpath = os.path.join(a.model, "config.json")
    cj = json.load(open(cpath))
    cj["text_config"].pop("rope_parameters", None)
    with open(cpath, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    gen = os.path.join(a.model, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    proc = KimiK3VisionProcessor(media_proc_cfg=dict(MEDIA_PROC_CFG))
    with open(os.path.join(a.model, "preprocessor_config.json"), "w") as f:
        f.write(proc.to_json_string())
    shutil.copy(os.path.join(TINY, "tiktoken.model"), a.model)
    tc = json.load(open(os.path.join(TINY, "tokenizer_config.json")))
    for i, name in MEDIA.items():
        tc["added_tokens_decoder"][str(i)]["content"] = name
    with open(os.path.join(a.model, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
        f.write("\n")
    k3ckpt.install_hf_tokenizer(a.model)  # tokenization_k3.py + auto_map

    # ---- images and preprocessing ----
    img_dir = os.path.join(a.golden, "images")
    names = write_images(img_dir, rng)
    gold = {}
    meta = []
    for i, n in enumerate(names):
        im = Image.open(os.path.join(img_dir, n))
        w, h = im.size
        media = {"type": "image", "image": im}
        bf = proc.preprocess([media], return_tensors="pt")
        px, grid = bf["pixel_values"].float(), bf["grid_thws"]
        ntok = proc.media_tokens_calculator({"type": "image", "image": Image.open(os.path.join(img_dir, n))})
        gold[f"img{i}.pixel_values"] = px.contiguous()
        gold[f"img{i}.grid_thw"] = grid[0].to(torch.int64).contiguous()
        meta.append(dict(file=n, width=w, height=h, grid=grid[0].tolist(), tokens=int(ntok)))
        print(f"{n}: {w}x{h} mode {im.mode} grid {grid[0].tolist()} tokens {ntok}")

    # ---- PIL's resampling alone, on random images (what the processor builds on) ----
    cases = []
    for c in range(24):
        w, h = int(rng.integers(1, 70)), int(rng.integers(1, 70))
        ow, oh = int(rng.integers(1, 70)), int(rng.integers(1, 70))
        mode = ["RGB", "RGBA", "L", "P"][c % 4]
        arr = rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
        if c % 8 == 1:
            arr[..., 3] = rng.choice([0, 255], size=(h, w))  # hard edges: 0 and 255 alpha
        src = Image.fromarray(arr, "RGBA")
        im = {"RGB": src.convert("RGB"), "RGBA": src, "L": src.convert("L"),
              "P": src.convert("RGB").quantize(colors=8)}[mode]
        resample = Image.Resampling.NEAREST if mode == "P" else Image.Resampling.BICUBIC
        out = im.resize((ow, oh), resample=resample).convert("RGBA")
        inp = im.convert("RGBA")
        gold[f"pil{c}.in"] = torch.from_numpy(np.asarray(inp).copy())
        gold[f"pil{c}.out"] = torch.from_numpy(np.asarray(out).copy())
        cases.append(dict(mode=mode, w=w, h=h, ow=ow, oh=oh))
    gold["pil.modes"] = torch.tensor([["RGB", "RGBA", "L", "P"].index(c["mode"]) for c in cases], dtype=torch.int64)

    # ---- tower + projector, several images in one call ----
    sel = [0, 1, 2, 5]  # rgb, rgba, grey, 112x112 (the pos table as-is)
    px = torch.cat([gold[f"img{i}.pixel_values"] for i in sel])
    grids = torch.stack([gold[f"img{i}.grid_thw"] for i in sel])
    with torch.no_grad():
        feats = model.vision_tower(px, grids)
        proj = model.mm_projector(feats)
        # fp64 run of the same modules, to state how far fp32 is from exact
        m64 = eager(mk.KimiK3ForConditionalGeneration(cfg).eval())
        m64.load_state_dict(model.state_dict())
        m64 = m64.double()
        proj64 = m64.mm_projector(m64.vision_tower(px.double(), grids))
    for j, i in enumerate(sel):
        gold[f"tower.img{i}"] = proj[j].float().contiguous()
        print(f"tower img{i}: {tuple(proj[j].shape)}  fp32 vs fp64 rel-L2 "
              f"{rel_l2(proj[j].numpy(), proj64[j].numpy()):.2e}")
    gold["tower.images"] = torch.tensor(sel, dtype=torch.int64)
    # a 3-frame clip (t > 1: the fixed sincos time term, the temporal mean of
    # sd2_tpool) -- the tower supports it; K3's processor makes images only
    g3 = torch.Generator().manual_seed(a.seed + 1)
    clip = torch.randn(3 * 4 * 6, 3, 14, 14, generator=g3)
    with torch.no_grad():
        gold["video.pixel_values"] = clip.contiguous()
        gold["video.out"] = model.mm_projector(model.vision_tower(clip, torch.tensor([[3, 4, 6]])))[0].float().contiguous()
    # the position table resized as get_rope_shape does it, in both modes
    # (the release config says bilinear; docs/vision.md §8.1)
    pe = model.vision_tower.patch_embed.pos_emb.weight.detach()
    for mode in ("bilinear", "bicubic"):
        for (h, w) in ((5, 7), (12, 10)):
            gold[f"posemb.{mode}.{h}x{w}"] = mk.get_rope_shape(pe, mode, (h, w)).contiguous()

    # ---- whole model with two images in the prompt (HF flow: one pad each) ----
    def text_ids(s):  # the tiny tokenizer, through tiktoken as k3 does
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(os.path.join(a.model, "tiktoken.model"))
        from llmcompressor.modeling.kimi_k3.tokenization_kimi import TikTokenTokenizer
        pat = TikTokenTokenizer.pat_str  # the official split pattern
        enc = tiktoken.Encoding("tiny", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
        return enc.encode(s)

    def image_prompt(i, n_pads):
        m = meta[i]
        return ([786] + text_ids(f"image {m['width']}x{m['height']}") + [787]
                + [PAD_ID] * n_pads + [788])

    imgs = [0, 3]  # the RGB PNG and the JPEG
    head = [768] + text_ids("Look:")
    mid = text_ids(" and")
    tail = text_ids(" Which is brighter?")
    ids_hf = head + image_prompt(imgs[0], 1) + mid + image_prompt(imgs[1], 1) + tail
    ids_k3 = (head + image_prompt(imgs[0], meta[imgs[0]]["tokens"]) + mid
              + image_prompt(imgs[1], meta[imgs[1]]["tokens"]) + tail)
    assert 0 not in ids_hf  # id 0 is pad_token_id's slot in _merge_...: zeroed
    px = torch.cat([gold[f"img{i}.pixel_values"] for i in imgs])
    grids = torch.stack([gold[f"img{i}.grid_thw"] for i in imgs])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids_hf]), pixel_values=px, grid_thws=grids,
                    attention_mask=torch.ones(1, len(ids_hf), dtype=torch.long), use_cache=False)
        logits = out.logits[0].float()
        # text-only logits of the same model, to tell text and vision errors apart
        text_only = model.language_model(input_ids=torch.tensor([head + tail]),
                                         use_cache=False).logits[0].float()
    assert logits.shape[0] == len(ids_k3), (logits.shape, len(ids_k3))
    gold["prompt.ids"] = torch.tensor(ids_k3, dtype=torch.int64)
    gold["prompt.images"] = torch.tensor(imgs, dtype=torch.int64)
    gold["prompt.logits"] = logits.contiguous()
    gold["text.ids"] = torch.tensor(head + tail, dtype=torch.int64)
    gold["text.logits"] = text_only.contiguous()
    print(f"prompt: {len(ids_hf)} ids -> {len(ids_k3)} positions; greedy "
          f"{logits.argmax(-1).tolist()[-8:]}")
    # ---- an OpenAI chat with image_url parts, through the official encoder ----
    # (encoding_k3 via the official tokenizer's apply_chat_template with the
    # processor's image_prompts: one pad per image, which k3 and vLLM expand
    # to the image's rows)
    import base64
    from tokenizers import AddedToken
    from llmcompressor.modeling.kimi_k3.tokenization_kimi import TikTokenTokenizer
    tcfg = json.load(open(os.path.join(a.model, "tokenizer_config.json")))
    added = {int(k): AddedToken(v["content"], special=v.get("special", True))
             for k, v in tcfg["added_tokens_decoder"].items()}
    tok = TikTokenTokenizer(os.path.join(a.model, "tiktoken.model"), bos_token=tcfg.get("bos_token", "[BOS]"),
                            eos_token=tcfg.get("eos_token", "[EOS]"), unk_token=tcfg.get("unk_token"),
                            pad_token=tcfg.get("pad_token"), added_tokens_decoder=added)
    chat_imgs = [6, 3]  # dot_5x3.png, photo_67x45.jpg

    def data_url(i):
        n = meta[i]["file"]
        kind = "jpeg" if n.endswith(".jpg") else "png"
        raw = open(os.path.join(img_dir, n), "rb").read()
        return f"data:image/{kind};base64," + base64.b64encode(raw).decode()

    conv = [{"role": "system", "content": "You look at images."},
            {"role": "user", "content": [
                {"type": "text", "text": "First:"},
                {"type": "image_url", "image_url": {"url": data_url(chat_imgs[0])}},
                {"type": "text", "text": " and then"},
                {"type": "image_url", "image_url": {"url": data_url(chat_imgs[1])}},
                {"type": "text", "text": "Which is wider?"}]}]
    prompts = [KimiK3VisionProcessor.make_image_prompt(meta[i]["width"], meta[i]["height"]) for i in chat_imgs]
    one_pad = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, thinking=True, thinking_effort=None,
                                      image_prompts=prompts)
    if isinstance(one_pad, dict):
        one_pad = one_pad["input_ids"]
    expanded, k = [], 0
    for t_id in one_pad:
        if t_id == PAD_ID:
            expanded += [PAD_ID] * meta[chat_imgs[k]]["tokens"]
            k += 1
        else:
            expanded.append(int(t_id))
    assert k == 2
    gold["chat.ids"] = torch.tensor(expanded, dtype=torch.int64)
    with open(os.path.join(a.golden, "chat_messages.json"), "w") as f:
        json.dump(conv, f)
        f.write("\n")
    print(f"chat: {len(one_pad)} official ids, {len(expanded)} with the pads expanded")

    os.makedirs(a.golden, exist_ok=True)
    save_file(gold, os.path.join(a.golden, "vision.safetensors"),
              metadata={"images": json.dumps(meta)})
    with open(os.path.join(a.golden, "images.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("torch", torch.__version__, "Pillow", Image.__version__, "numpy", np.__version__)


if __name__ == "__main__":
    sys.exit(main())
