"""k3ckpt -- write Kimi K3 checkpoints in the released layout (numpy only, no torch).

Spec: docs/model.md sections 2, 4, 5.

Public API
----------
bf16_bytes(a)                 -> bytes   float32 array -> BF16 (round to nearest even), little-endian
f32_bytes(a)                  -> bytes   float32 little-endian
bf16_round(a)                 -> float32 array holding the BF16-rounded values
write_safetensors(path, tensors, metadata=None)
    tensors: {name: (dtype_str, shape, data)} with dtype_str in BF16/F16/F32/U8 and data either
    bytes-like or a zero-argument callable returning bytes (called once, in name order, so large
    files can be written without holding every tensor in memory). Header JSON padded with spaces
    to a multiple of 8; tensors stored sorted by name, back to back.
read_safetensors(path)        -> {name: np.ndarray}  (BF16 returned as float32)
mxfp4_quantize(w)             -> (packed uint8 [rows, cols/2], scale uint8 [rows, cols/32])
mxfp4_dequantize(packed, scale) -> float32 [rows, cols]
special_tokens_k3(n_ranks)    -> {id: name} (256 specials after the ranks)
make_config(n_ranks, **text_overrides) -> full nested config.json dict (defaults = spec 6.1 tiny)
tensor_dtype(name, config)    -> "BF16" | "F32" | "MXFP4" (storage rule used by write_checkpoint)
write_checkpoint(out_dir, config, tensors, tokenizer, shard_bytes=None, dtype_overrides=None)
    tensors: {name: float32 array or k3ckpt.lazy(shape, fn)}; names with or without the
    "language_model." prefix (added when missing). Routed experts given as
    "...experts.{e}.w{1,2,3}.weight" are written as .weight_packed/.weight_scale U8 when the
    config's quantization_config is mxfp4-pack-quantized, else BF16 .weight. uint8 arrays are
    passed through as U8. tokenizer = (ranks: list[bytes] in rank order, specials: {id: name}).
    dtype_overrides: {name: "BF16"/"F32"/"F16"/"MXFP4"} beats the default rule.
lazy(shape, fn, dtype=np.float32) -> deferred tensor for write_checkpoint (fn() -> array)
"""

import base64
import json
import os
import re

import numpy as np

__all__ = [
    "bf16_bytes", "f32_bytes", "bf16_round", "write_safetensors", "read_safetensors",
    "mxfp4_quantize", "mxfp4_dequantize", "special_tokens_k3", "make_config",
    "tensor_dtype", "write_checkpoint", "E2M1_VALUES",
]

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}

# ---------------------------------------------------------------------------- scalar formats


def _bf16_u16(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)  # quiet NaN
    return r


def bf16_bytes(a):
    """float32 array -> BF16 bytes (round to nearest even, NaN kept NaN), little-endian."""
    return _bf16_u16(a).astype("<u2").tobytes()


def bf16_round(a):
    """The float32 values a BF16 store of `a` reads back as."""
    return (_bf16_u16(a).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_bytes(a):
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def _to_bytes(dtype, a):
    if dtype == "BF16":
        return bf16_bytes(a)
    if dtype == "F32":
        return f32_bytes(a)
    if dtype == "F16":
        return np.ascontiguousarray(a, dtype="<f2").tobytes()
    if dtype == "U8":
        return np.ascontiguousarray(a, dtype=np.uint8).tobytes()
    raise ValueError("unsupported dtype " + dtype)


# ---------------------------------------------------------------------------- safetensors


def write_safetensors(path, tensors, metadata=None, progress=None):
    """tensors: {name: (dtype_str, shape, bytes | callable -> bytes)}.
    progress, when given, is called with the byte count of each tensor written."""
    names = sorted(tensors)
    header = {}
    off = 0
    for n in names:
        dt, shape, _ = tensors[n]
        if dt not in DTYPE_SIZE:
            raise ValueError("%s: unsupported dtype %s" % (n, dt))
        nb = DTYPE_SIZE[dt] * int(np.prod(shape, dtype=np.int64))
        header[n] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + nb]}
        off += nb
    meta = {"format": "pt"}
    if metadata:
        meta.update(metadata)
    hdr = {"__metadata__": meta}
    hdr.update(header)
    hj = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((-len(hj)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for n in names:
            data = tensors[n][2]
            if callable(data):
                data = data()
            b0, b1 = header[n]["data_offsets"]
            mv = memoryview(data).cast("B")
            if len(mv) != b1 - b0:
                raise ValueError("%s: %d bytes, header says %d" % (n, len(mv), b1 - b0))
            f.write(mv)
            if progress:
                progress(len(mv))
    os.replace(tmp, path)
    return off


def read_safetensors(path):
    """Minimal reader (for tests): {name: np.ndarray}; BF16/F16 come back as float32."""
    with open(path, "rb") as f:
        buf = f.read()
    hl = int.from_bytes(buf[:8], "little")
    hdr = json.loads(buf[8:8 + hl])
    base = 8 + hl
    out = {}
    for n, t in hdr.items():
        if n == "__metadata__":
            continue
        b0, b1 = t["data_offsets"]
        raw = buf[base + b0: base + b1]
        dt = t["dtype"]
        if dt == "BF16":
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F16":
            a = np.frombuffer(raw, "<f2").astype(np.float32)
        elif dt == "F32":
            a = np.frombuffer(raw, "<f4").copy()
        elif dt == "U8":
            a = np.frombuffer(raw, np.uint8).copy()
        else:
            raise ValueError(dt)
        out[n] = a.reshape(t["shape"])
    return out


# ---------------------------------------------------------------------------- MXFP4

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=np.float32)
# Round-to-nearest-even on the magnitude code: midpoint t_i between codes i and i+1 goes to the
# even code, so the comparison is '>' when i is even and '>=' when i is odd.
_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def _e2m1_code(m):
    """|x| (already divided by the block scale) -> magnitude code 0..7, saturating at 6."""
    code = np.zeros(m.shape, dtype=np.uint8)
    for i, t in enumerate(_MID):
        code += ((m > t) if i % 2 == 0 else (m >= t)).astype(np.uint8)
    return code


def mxfp4_quantize(w):
    """float32 [rows, cols] (cols % 32 == 0) -> (packed uint8 [rows, cols/2], scale uint8 [rows, cols/32]).

    compressed-tensors mxfp4-pack-quantized: low nibble = even column, E2M1 codes (bit 3 sign);
    scale byte = floor(log2(amax)) - 2 + 127 clamped to [0, 254] (OCP MX), per 32 columns."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if cols % 32:
        raise ValueError("cols must be a multiple of 32")
    blk = w.reshape(rows, cols // 32, 32)
    amax = np.abs(blk).max(axis=2)
    _, e = np.frexp(amax)                       # amax = m * 2^e, m in [0.5, 1) -> floor(log2) = e-1
    sb = np.where(amax > 0, e.astype(np.int64) - 1 - 2 + 127, 0)
    sb = np.clip(sb, 0, 254).astype(np.uint8)
    xs = np.ldexp(np.float32(1.0), sb.astype(np.int32) - 127).astype(np.float32)
    m = np.abs(blk) / xs[:, :, None]
    code = _e2m1_code(m)
    neg = (blk < 0) & (code > 0)
    nib = (code | (neg.astype(np.uint8) << 3)).reshape(rows, cols)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return packed, sb


def mxfp4_dequantize(packed, scale):
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.uint8)
    rows, half = packed.shape
    cols = half * 2
    if scale.shape != (rows, cols // 32):
        raise ValueError("scale shape %s does not match packed %s" % (scale.shape, packed.shape))
    if (scale == 255).any():
        raise ValueError("scale byte 255 (NaN)")
    nib = np.empty((rows, cols), dtype=np.uint8)
    nib[:, 0::2] = packed & 0xF
    nib[:, 1::2] = packed >> 4
    v = E2M1_VALUES[nib]
    xs = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
    return (v.reshape(rows, cols // 32, 32) * xs[:, :, None]).reshape(rows, cols)


# ---------------------------------------------------------------------------- tokenizer / config


def special_tokens_k3(n_ranks):
    named = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>",
             5: "<|sep|>", 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"}
    return {n_ranks + i: named.get(i, "<|reserved_token_%d|>" % (n_ranks + i)) for i in range(256)}


_NOT_SPECIAL = {"<|open|>", "<|close|>", "<|sep|>"}


def _write_tokenizer(out_dir, ranks, specials):
    seen = set()
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for i, b in enumerate(ranks):
            b = bytes(b)
            if not b or b in seen:
                raise ValueError("rank %d: empty or duplicate token" % i)
            seen.add(b)
            f.write("%s %d\n" % (base64.b64encode(b).decode("ascii"), i))
    byname = {v: k for k, v in specials.items()}
    dec = {}
    for i in sorted(specials):
        dec[str(i)] = {"content": specials[i], "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False,
                       "special": specials[i] not in _NOT_SPECIAL}
    tc = {"added_tokens_decoder": dec, "additional_special_tokens": []}
    for key, nm in (("bos_token", "[BOS]"), ("eos_token", "[EOS]"), ("unk_token", "[UNK]"),
                    ("pad_token", "[PAD]")):
        if nm in byname:
            tc[key] = nm
    tc["additional_special_tokens"] = [n for n in ("<|end_of_msg|>", "<|open|>", "<|close|>",
                                                   "<|sep|>", "<|media_pad|>") if n in byname]
    tc.update({"clean_up_tokenization_spaces": False, "model_max_length": 1048576,
               "tokenizer_class": "K3Tokenizer"})
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
        f.write("\n")
    install_hf_tokenizer(out_dir)


def install_hf_tokenizer(out_dir):
    """Puts the Hugging Face tokenizer into a checkpoint (tools/hf_tokenizer:
    tokenization_k3.py and tokenizer_config.json's auto_map), so that
    AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True) loads it."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_tokenizer", "install.py")
    spec = importlib.util.spec_from_file_location("k3_hf_tokenizer_install", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install(out_dir)


def make_config(n_ranks, **text_overrides):
    """Full nested config.json (K3 layout) with the spec 6.1 tiny defaults; special ids placed
    after n_ranks. text_overrides replace text_config fields (linear_attn_config is replaced
    whole if given). Pass quantization_config=None to drop MXFP4 (BF16 experts)."""
    tc = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": n_ranks + 256, "hidden_size": 256, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
            "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
        "attn_res_block_size": 3,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 512,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2,
        "moe_intermediate_size": 64, "routed_expert_hidden_size": 128,
        "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": n_ranks, "eos_token_id": n_ranks + 2, "pad_token_id": n_ranks + 255,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "input_activations": None,
                "weights": {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group",
                            "symmetric": True, "dynamic": False, "scale_dtype": "uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                       "lm_head", "re:.*routed_expert_.*", "re:.*gate$"]},
    }
    for k, v in text_overrides.items():
        if v is None:
            tc.pop(k, None)
        else:
            tc[k] = v
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": n_ranks, "eos_token_id": n_ranks + 2, "pad_token_id": n_ranks + 255,
        "media_placeholder_token_id": n_ranks + 21,
        "image_placeholder": "<|media_pad|>",
        "tie_word_embeddings": False, "dtype": "bfloat16",
        "text_config": tc,
    }


def _is_mxfp4(config):
    for qc in (config.get("text_config", {}).get("quantization_config"),
               config.get("quantization_config")):
        if isinstance(qc, dict):
            fmt = qc.get("format")
            if fmt is None:
                for g in qc.get("config_groups", {}).values():
                    fmt = g.get("format") or fmt
            if fmt == "mxfp4-pack-quantized":
                return True
    return False


_F32_RE = re.compile(r"(self_attn\.[qkv]_conv1d\.weight|self_attn\.A_log|self_attn\.dt_bias|"
                     r"self_attn\.o_norm\.weight|e_score_correction_bias)$")
_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def tensor_dtype(name, config):
    """Storage dtype of a float tensor: "F32", "BF16", or "MXFP4" (routed expert, quantized)."""
    if _F32_RE.search(name):
        return "F32"
    if _EXPERT_RE.search(name) and _is_mxfp4(config):
        return "MXFP4"
    return "BF16"


def _full_name(n):
    return n if n.startswith("language_model.") else "language_model." + n


def write_checkpoint(out_dir, config, tensors, tokenizer, shard_bytes=None, dtype_overrides=None,
                     progress=None):
    """Write config.json, model.safetensors (or shards + index), tiktoken.model,
    tokenizer_config.json. Returns {file: bytes}. progress, when given, is
    called as progress(bytes_written_so_far, total_tensor_bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    dtype_overrides = dtype_overrides or {}
    entries = {}   # final name -> (dtype, shape, producer)

    def add(name, dt, shape, producer):
        if name in entries:
            raise ValueError("duplicate tensor " + name)
        entries[name] = (dt, tuple(int(s) for s in shape), producer)

    def get(v):
        return v() if callable(v) else v

    for name, val in tensors.items():
        full = _full_name(name)
        if callable(val):
            if not hasattr(val, "shape"):
                raise ValueError("%s: a callable tensor needs a .shape attribute "
                                 "(use k3ckpt.lazy(shape, fn))" % full)
            shape, dtype_hint = val.shape, getattr(val, "dtype", np.float32)
        else:
            val = np.asarray(val)
            shape, dtype_hint = val.shape, val.dtype
        if dtype_hint == np.uint8:
            add(full, "U8", shape, (lambda v=val: get(v).tobytes()))
            continue
        dt = dtype_overrides.get(full, dtype_overrides.get(name)) or tensor_dtype(full, config)
        if dt == "MXFP4":
            if len(shape) != 2 or shape[1] % 32:
                raise ValueError("%s: MXFP4 needs [rows, cols%%32==0], got %s" % (full, shape))
            base = full[:-len(".weight")]
            cache = {}

            def quant(v=val, c=cache):
                if "p" not in c:
                    c["p"], c["s"] = mxfp4_quantize(get(v))
                return c

            def packed(q=quant):
                return q()["p"].tobytes()

            def scales(q=quant, c=cache):
                b = q()["s"].tobytes()
                c.clear()
                return b
            # sorted order: "<base>.weight_packed" < "<base>.weight_scale" -> packed computed first
            add(base + ".weight_packed", "U8", (shape[0], shape[1] // 2), packed)
            add(base + ".weight_scale", "U8", (shape[0], shape[1] // 32), scales)
        else:
            add(full, dt, shape, (lambda v=val, d=dt: _to_bytes(d, get(v))))

    names = sorted(entries)
    nbytes = {n: DTYPE_SIZE[entries[n][0]] * int(np.prod(entries[n][1], dtype=np.int64)) for n in names}
    total = sum(nbytes.values())
    done = [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)
    shards = [[]]
    if shard_bytes:
        cur = 0
        for n in names:
            if shards[-1] and cur + nbytes[n] > shard_bytes:
                shards.append([])
                cur = 0
            shards[-1].append(n)
            cur += nbytes[n]
    else:
        shards[0] = names
    # stale outputs of an earlier run with a different sharding
    for fn in os.listdir(out_dir):
        if re.match(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$", fn):
            os.remove(os.path.join(out_dir, fn))
    sizes = {}
    if len(shards) == 1 and not shard_bytes:
        fn = "model.safetensors"
        write_safetensors(os.path.join(out_dir, fn), {n: entries[n] for n in shards[0]}, progress=step)
        sizes[fn] = os.path.getsize(os.path.join(out_dir, fn))
    else:
        wm = {}
        for k, sh in enumerate(shards):
            fn = "model-%05d-of-%05d.safetensors" % (k + 1, len(shards))
            write_safetensors(os.path.join(out_dir, fn), {n: entries[n] for n in sh}, progress=step)
            sizes[fn] = os.path.getsize(os.path.join(out_dir, fn))
            for n in sh:
                wm[n] = fn
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)
            f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    ranks, specials = tokenizer
    _write_tokenizer(out_dir, ranks, specials)
    return sizes


class lazy:
    """A deferred tensor for write_checkpoint: lazy(shape, fn) with fn() -> float32 array."""

    def __init__(self, shape, fn, dtype=np.float32):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.fn = fn

    def __call__(self):
        a = self.fn()
        if tuple(a.shape) != self.shape:
            raise ValueError("lazy tensor: got shape %s, declared %s" % (a.shape, self.shape))
        return a


__all__.append("lazy")
