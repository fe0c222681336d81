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
    a = ap.parse_args()
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
    # (the release config says bilinear; vision.md §8.1)
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
