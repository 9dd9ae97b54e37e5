"""The roofline cost model against numbers worked out by hand from the formulas in
``planner/roofline.py`` and the published model configs."""

from __future__ import annotations

import json

import pytest

from planner.roofline import Efficiency, RooflineCost, load_hardware, model_shape

# facebook/opt-66b config.json (the fields the roofline reads, as published).
OPT_66B = {
    "_name_or_path": "facebook/opt-66b",
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "hidden_size": 9216,
    "ffn_dim": 36864,
    "num_hidden_layers": 64,
    "num_attention_heads": 72,
    "vocab_size": 50272,
    "word_embed_proj_dim": 9216,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}

# meta-llama/Meta-Llama-3-8B config.json (the fields the roofline reads).
LLAMA_3_8B = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

EXACT = Efficiency(step_overhead_s=0.0)  # the formulas alone, no fixed per-step cost


def test_opt_66b_shape_from_its_config():
    shape = model_shape(OPT_66B)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (64, 9216, 72, 72)
    assert (shape.head_dim, shape.intermediate_size, shape.gated_mlp) == (128, 36864, False)
    # per layer: Q, K, V, O = 4 * 9216^2 and a 2-matrix MLP = 2 * 9216 * 36864
    assert shape.layer_params == 4 * 9216**2 + 2 * 9216 * 36864 == 1_019_215_872
    # 64 layers + the (tied) embedding 50272 * 9216: 65.69 B, the "66B"
    assert shape.params == 64 * 1_019_215_872 + 50272 * 9216 == 65_693_122_560
    assert shape.kv_bytes_per_token == 2 * 64 * 72 * 128 * 2 == 2_359_296


def test_llama_3_8b_shape_from_a_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    shape = model_shape(tmp_path)  # a model directory, as the planner's --model takes it
    assert (shape.num_kv_heads, shape.head_dim, shape.gated_mlp, shape.tie_word_embeddings) == (8, 128, True, False)
    # Q and O 4096^2 each, K and V 4096 * 1024 each, SwiGLU 3 * 4096 * 14336
    assert shape.layer_params == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    # 8,030,261,248 published, of which 266,240 are RMSNorm weights (left out here)
    assert shape.params == 8_030_261_248 - 266_240
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072


def test_prefill_flops_are_two_per_weight_per_token_plus_attention():
    cost = RooflineCost(model_shape(LLAMA_3_8B), load_hardware("h100"))
    shape, tokens = cost.shape, 1000
    attention = 2 * 32 * tokens**2 * 4096  # QK^T and AV over the causal half of tokens^2, every layer
    lm_head = 2 * 128256 * 4096  # logits of the last token only
    assert cost.prefill_flops(tokens) == 2 * shape.matmul_params * tokens + attention + lm_head


def test_long_prefill_is_compute_bound_at_the_mfu():
    cost = RooflineCost(model_shape(OPT_66B), load_hardware("a100"), tp=1, efficiency=EXACT)
    flops = cost.prefill_flops(2048)
    assert cost.prefill_s(2048) == pytest.approx(flops / (312e12 * 0.55))
    assert cost.prefill_s(2048) == pytest.approx(1.585, abs=0.01)  # 2 * 65.2e9 * 2048 / 171.6e12


def test_tensor_parallelism_halves_compute_and_adds_two_allreduces_per_layer():
    shape, a100 = model_shape(OPT_66B), load_hardware("a100")
    tp1 = RooflineCost(shape, a100, tp=1, efficiency=EXACT)
    tp2 = RooflineCost(shape, a100, tp=2, efficiency=EXACT)
    tokens = 2048
    activations = tokens * 9216 * 2  # bytes each all-reduce moves
    ring = 2 * (2 - 1) / 2 * activations / (300e9 * 0.8) + 10e-6  # 2(tp-1)/tp * bytes / NVLink + latency
    assert tp2.allreduce_s(activations) == pytest.approx(ring)
    assert tp1.allreduce_s(activations) == 0.0
    assert tp2.prefill_s(tokens) == pytest.approx(tp1.prefill_s(tokens) / 2 + 2 * 64 * ring)


def test_decode_at_batch_one_streams_the_weights_at_the_bandwidth():
    shape = model_shape(LLAMA_3_8B)
    cost = RooflineCost(shape, load_hardware("h100"), efficiency=EXACT)
    streamed = (shape.matmul_params + shape.lm_head_params) * 2  # every layer and the LM head, bf16
    assert cost.decode_step_s(1, 0) == pytest.approx(streamed / (3.35e12 * 0.8))  # ~6 ms
    # each context token adds its KV read: 131,072 bytes
    extra = cost.decode_step_s(1, 4096) - cost.decode_step_s(1, 0)
    assert extra == pytest.approx(4096 * 131_072 / (3.35e12 * 0.8))
    assert cost.decode_step_s(0, 0) == 0.0


def test_kv_capacity_is_memory_left_after_weights_and_reserve():
    shape, a100 = model_shape(OPT_66B), load_hardware("a100")
    # one A100: 72 GB usable - 2 GB reserve < 131.4 GB of weights
    assert RooflineCost(shape, a100, tp=1).kv_capacity_tokens == 0
    assert not RooflineCost(shape, a100, tp=1).fits(2048)
    tp4 = RooflineCost(shape, a100, tp=4)
    pool = 4 * (80e9 * 0.9 - 2e9) - 65_693_122_560 * 2
    assert tp4.kv_capacity_tokens == int(pool // 2_359_296) == 62_990
    assert tp4.fits(2048)


def test_kv_transfer_is_latency_plus_bytes_over_the_replicas_nics():
    cost = RooflineCost(model_shape(OPT_66B), load_hardware("a100"), tp=4)
    num_bytes = 1000 * 2_359_296
    assert cost.transfer_s(num_bytes) == pytest.approx(0.5e-3 + num_bytes / (4 * 25e9 * 0.8))


@pytest.mark.parametrize("name", ["h100", "h200", "a100", "l40s"])
def test_shipped_hardware_loads_with_sources(name):
    hardware = load_hardware(name)
    assert hardware.name == name
    assert hardware.bf16_flops > 1e14 and hardware.hbm_bytes_per_s > 5e11 and hardware.hbm_bytes >= 48e9
    assert hardware.source and all(url.startswith("https://") for url in hardware.source)


def test_hardware_figures_and_unknown_names():
    h100, h200 = load_hardware("h100"), load_hardware("H200")
    assert h100.bf16_flops == h200.bf16_flops == 989.4e12  # the same GH100 compute
    assert (h100.hbm_bytes, h200.hbm_bytes, h200.hbm_bytes_per_s) == (80e9, 141e9, 4.8e12)
    assert load_hardware("l40s").nvlink_bytes_per_s == 32e9  # PCIe Gen4 x16: no NVLink
    with pytest.raises(ValueError, match="unknown GPU 'b300'.*'a100', 'h100', 'h200', 'l40s'"):
        load_hardware("b300")
