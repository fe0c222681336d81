#!/usr/bin/env python3
"""Tiny K3 checkpoints built by Moonshot's own classes (the llmcompressor wheel's
kimi_k3/ modeling code), with those classes' own initialization, saved by their
own save_pretrained, and the official fp32 logits and greedy tokens on a fixed
prompt -- the goldens tests/test_official.c holds k3 to.

    TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=1 .venv/bin/python tools/official_model_goldens.py
      # writes tests/models/official-tiny, tests/models/official-tiny-mxfp4,
      #        tests/golden/official/{official-tiny,official-tiny-mxfp4}.safetensors

Needs fla (pip install --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 einops):
the official KimiDeltaAttention calls fla's ShortConvolution, FusedRMSNormGated
and chunk_kda, Triton kernels; the first two run on CPU under TRITON_INTERPRET=1,
chunk_kda does not (its intra-chunk kernel fails in the interpreter), so the
goldens route that one call to fla's naive_recurrent_kda (plus the gate,
l2norm and beta sigmoid chunk_kda applies in-kernel). As a cross-check the
script reruns the forward with fla's fused_recurrent_kda Triton kernel (the
official decode path) under the interpreter and prints the rel-L2 between
the two.

Initialization: KimiK3PreTrainedModel._init_weights returns at once, so every
module keeps PyTorch's default (nn.Linear kaiming-uniform, nn.Embedding N(0,1),
norms 1, A_log log U(1,16), the router weight kaiming-uniform). Two parameters
are created with torch.empty and never written (the router's
e_score_correction_bias, KDA's dt_bias): they are uninitialized memory, so the
script sets them to zero. Weights are rounded to BF16 once; the saved BF16
checkpoint and the fp32 forward see the same values.

The MXFP4 variant: the same model with every routed expert's w1/w2/w3 in
compressed-tensors mxfp4-pack-quantized (weight_packed / weight_scale, as
tools/k3ckpt.py writes and k3 loads them) and the quantization_config k3's
bench checkpoints carry; its golden logits are the official forward with those
experts replaced by their dequantized values.
"""
import copy
import json
import os
import shutil
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from official_common import ROOT, kimi_k3  # noqa: E402
import k3ckpt  # noqa: E402


def stub_llmcompressor():
    """modeling_kimi_linear imports llmcompressor.modeling.moe.context for one
    flag (calibrate all experts, False at inference); llmcompressor's own
    __init__ needs loguru and more, so the flag is provided here."""
    import types
    for name in ("llmcompressor", "llmcompressor.modeling", "llmcompressor.modeling.moe"):
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules.setdefault(name, m)
    ctx = types.ModuleType("llmcompressor.modeling.moe.context")
    ctx.get_calibrate_all_experts_flag = lambda: False
    sys.modules["llmcompressor.modeling.moe.context"] = ctx


TOKENIZER = os.path.join(ROOT, "tests/models/tiny")  # 768 ranks + 256 specials = 1024

TEXT = dict(
    model_type="kimi_linear", vocab_size=1024, hidden_size=128, num_hidden_layers=6,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True,
    mla_use_output_gate=True,
    linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                        "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                        "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6]},
    attn_res_block_size=2, first_k_dense_replace=1, moe_layer_freq=1, intermediate_size=256,
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
    routed_expert_hidden_size=64, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
    moe_renormalize=True, routed_scaling_factor=1.0, use_grouped_topk=True, num_expert_group=1,
    topk_group=1, topk_method="noaux_tc", hidden_act="situ", activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=768, eos_token_id=770, pad_token_id=1023)

VISION = dict(patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2,
              vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=32,
              vt_intermediate_size=64, qkv_hidden_size=96, mm_hidden_size=32, text_hidden_size=128,
              _attn_implementation="eager")

MXFP4_QC = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": None,
                                  "weights": {"num_bits": 4, "group_size": 32, "type": "float",
                                              "strategy": "group", "symmetric": True,
                                              "dynamic": False, "scale_dtype": "uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*", "lm_head",
               "re:.*routed_expert_.*", "re:.*gate$"]}

SEED = 15
N_PROMPT = 24
N_GREEDY = 8


def triton_on_cpu():
    """Under TRITON_INTERPRET=1 the kernels run in numpy, but Triton's
    autotuner still asks for a GPU driver to time its configs; with one
    config there is nothing to time, so each autotuned kernel keeps its
    first config (all of fla's configs compute the same values)."""
    from triton.runtime import autotuner
    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)
    autotuner.Autotuner.run = first_config


def build():
    cfgm = kimi_k3("configuration_kimi_k3")
    mod = kimi_k3("modeling_kimi_k3")
    torch.manual_seed(SEED)
    config = cfgm.KimiK3Config(text_config=dict(TEXT), vision_config=dict(VISION),
                               media_placeholder_token_id=789, pad_token_id=1023,
                               bos_token_id=768, eos_token_id=770)
    config.text_config._attn_implementation = "eager"
    model = mod.KimiK3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or name.endswith("dt_bias"):
                p.zero_()
            p.copy_(p.bfloat16().float())
            assert torch.isfinite(p).all(), name
    return model


def forward_logits(model, ids):
    with torch.no_grad():
        out = model.language_model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


def greedy(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(forward_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def kda_swap(kind):
    """Context: the official KimiDeltaAttention's chunk_kda call routed to
    fla's naive_recurrent_kda (kind "naive", with the gate, l2norm and beta
    sigmoid chunk_kda applies in-kernel) or to fla's fused_recurrent_kda
    Triton kernel (kind "fused_recurrent", the official decode path, run by
    Triton's interpreter). chunk_kda itself does not run under the
    interpreter (its intra-chunk kernel calls a helper outside @triton.jit)."""
    lin = kimi_k3("modeling_kimi_linear")
    from fla.ops.kda import fused_recurrent_kda
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    def naive(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=False, lower_bound=None,
              transpose_state_layout=True, cu_seqlens=None, **kw):
        assert initial_state is None and cu_seqlens is None
        assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel
        if lower_bound is not None:
            g = naive_kda_lowerbound_gate(g.float(), A_log.float(), dt_bias.float(), lower_bound)
        else:
            g = naive_kda_gate(g.float(), A_log.float(), dt_bias.float())
        q = q.float() / torch.sqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
        k = k.float() / torch.sqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
        o, s = naive_recurrent_kda(q, k, v.float(), g, beta.float().sigmoid(),
                                   output_final_state=True)
        return o.to(v.dtype), s

    def fused(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=True,
              safe_gate=False, **kw):
        return fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=initial_state,
                                   output_final_state=output_final_state, **kw)

    class Swap:
        def __enter__(self):
            self.old = lin.chunk_kda
            lin.chunk_kda = naive if kind == "naive" else fused

        def __exit__(self, *a):
            lin.chunk_kda = self.old
    return Swap()


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def save_golden(path, ids, logits, tokens):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({"ids": torch.tensor(ids, dtype=torch.int32),
               "logits": logits.contiguous().float(),
               "greedy": torch.tensor(tokens, dtype=torch.int32)}, path)


def copy_tokenizer(out):
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), os.path.join(out, f))
    k3ckpt.install_hf_tokenizer(out)  # tokenization_k3.py + auto_map


def main():
    stub_llmcompressor()
    triton_on_cpu()
    model = build()
    rng = np.random.default_rng(SEED)
    ids = [int(x) for x in rng.integers(0, 768, N_PROMPT)]

    out = os.path.join(ROOT, "tests/models/official-tiny")
    shutil.rmtree(out, ignore_errors=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)
    copy_tokenizer(out)

    with kda_swap("naive"):
        logits = forward_logits(model, ids)
        tokens = greedy(model, ids, N_GREEDY)
    with kda_swap("fused_recurrent"):
        logits_fused = forward_logits(model, ids)
    print(f"official-tiny: KDA by fla naive_recurrent_kda (the golden) vs fla fused_recurrent_kda "
          f"(Triton interpreter): logits rel-L2 {rel_l2(logits_fused, logits):.3g}, top-1 "
          f"{int((logits_fused.argmax(-1) == logits.argmax(-1)).sum())}/{len(ids)}")
    save_golden(os.path.join(ROOT, "tests/golden/official/official-tiny.safetensors"),
                ids, logits, tokens)
    print("official-tiny: greedy", tokens)

    # MXFP4 variant: routed experts quantized, the official model run on the
    # dequantized values.
    outq = os.path.join(ROOT, "tests/models/official-tiny-mxfp4")
    shutil.rmtree(outq, ignore_errors=True)
    shutil.copytree(out, outq)
    st = load_file(os.path.join(out, "model.safetensors"))
    stq = {}
    sd = dict(model.named_parameters())
    n_q = 0
    with torch.no_grad():
        for name, t in st.items():
            if k3ckpt._EXPERT_RE.search(name):
                packed, scale = k3ckpt.mxfp4_quantize(t.float().numpy())
                base = name[:-len(".weight")]
                stq[base + ".weight_packed"] = torch.from_numpy(packed)
                stq[base + ".weight_scale"] = torch.from_numpy(scale)
                deq = torch.from_numpy(k3ckpt.mxfp4_dequantize(packed, scale))
                sd[name].copy_(deq)
                n_q += 1
            else:
                stq[name] = t
    save_file(stq, os.path.join(outq, "model.safetensors"), metadata={"format": "pt"})
    cj = os.path.join(outq, "config.json")
    c = json.load(open(cj))
    c["text_config"]["quantization_config"] = MXFP4_QC
    with open(cj, "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    with kda_swap("naive"):
        logits_q = forward_logits(model, ids)
        tokens_q = greedy(model, ids, N_GREEDY)
    save_golden(os.path.join(ROOT, "tests/golden/official/official-tiny-mxfp4.safetensors"),
                ids, logits_q, tokens_q)
    print(f"official-tiny-mxfp4: {n_q} expert matrices in MXFP4; logits rel-L2 vs BF16 "
          f"{rel_l2(logits_q, logits):.3g}; greedy {tokens_q}")


if __name__ == "__main__":
    main()
