"""The ``tiny`` models: small Llama-shaped HF model directories generated from a seed.

``tiny`` (head_dim 16, fp32, 2 layers) is for CPU tests. ``tiny-gpu`` has a GPU kernel's
shapes: head_dim 128, 8 query / 2 KV heads (GQA 4), 4 layers, hidden 1024, bf16 weights
(~23M parameters, ~45 MB): what FlashInfer's paged kernels take, with no download.

It goes through the real HF-dir loader, so tests of the engine exercise the same code path as a
real checkpoint. Weights are scaled so that attention and MLP visibly change the residual stream
and the logits are far from uniform (greedy text depends on the context, which is what KV-cache
tests need). Same seed -> byte-identical files.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shared.tokenizer.gguf_tokenizer import bytes_to_unicode

# Bump when anything below changes the produced files (part of the cache key in loader.py).
TINY_FORMAT_VERSION = 1

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
NUM_MERGES = 96
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Merges are learned from this fixed text, so the vocabulary never depends on anything outside.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A model of the world is a story the machine "
    "tells itself. In the beginning there was the word, and the word was a token. Tokens become "
    "blocks, blocks become caches, and the cache is shared between the prefill and the decode. "
    "Hello world! How are you today? I am fine, thank you. What is the capital of France? "
    "Paris is the capital of France. One two three four five six seven eight nine ten. "
    "the the the and and and of of of to to to in in in is is is it it it that that that"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


TINY_GPU_CONFIG: dict[str, Any] = dict(
    TINY_CONFIG,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
SHAPES: dict[str, dict[str, Any]] = {"tiny": TINY_CONFIG, "tiny-gpu": TINY_GPU_CONFIG}


def _train_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on the byte-level spelling of ``corpus`` words; ties broken lexicographically."""
    spelling = bytes_to_unicode()
    pretok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pretok.pre_tokenize_str(corpus))
    split = {word: tuple(word) for word in words}
    assert all(set(word) <= set(spelling.values()) for word in words)
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = split[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word in words:
            symbols, merged, i = split[word], [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            split[word] = tuple(merged)
    return merges


def make_tiny_tokenizer() -> BackendTokenizer:
    """Byte-level BPE: 4 special tokens, the 256 byte tokens, NUM_MERGES learned merges."""
    spelling = bytes_to_unicode()
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[spelling[byte]] = len(vocab)
    merges = _train_merges(_CORPUS, NUM_MERGES)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS]
    )
    return backend


def _make_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    import torch  # only model building needs torch; the tokenizer half of this file does not

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        # Not all ones, so that loading a norm into the wrong slot changes the output.
        return 1.0 + normal((hidden,), 0.1)

    weights = {"model.embed_tokens.weight": normal((config["vocab_size"], hidden), 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        # std 1/sqrt(fan_in): attention scores and sublayer outputs are O(1), not negligible.
        weights[p + "self_attn.q_proj.weight"] = normal((q_out, hidden), hidden**-0.5)
        weights[p + "self_attn.k_proj.weight"] = normal((kv_out, hidden), hidden**-0.5)
        weights[p + "self_attn.v_proj.weight"] = normal((kv_out, hidden), hidden**-0.5)
        weights[p + "self_attn.o_proj.weight"] = normal((hidden, q_out), q_out**-0.5)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal((inter, hidden), hidden**-0.5)
        weights[p + "mlp.up_proj.weight"] = normal((inter, hidden), hidden**-0.5)
        weights[p + "mlp.down_proj.weight"] = normal((hidden, inter), inter**-0.5)
    weights["model.norm.weight"] = norm_weight()
    # Logit std ~ 0.3 * sqrt(hidden) = 2.4: peaked enough that greedy text varies with context.
    weights["lm_head.weight"] = normal((config["vocab_size"], hidden), 0.3)
    return weights


def write_tiny_tokenizer_files(
    out_dir: str | Path, shape: str = "tiny"
) -> tuple[Path, dict[str, Any]]:
    """Write everything of a tiny model (``shape``: a SHAPES key) but its weights (no torch
    needed). The tokenizer is the same for every shape.

    Returns (out_dir, config). The router and the emulated engine load the tokenizer from a
    directory written by this function, the torch engine from the full model directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = make_tiny_tokenizer()
    config = dict(SHAPES[shape], vocab_size=backend.get_vocab_size(with_added_tokens=True))
    eos_ids = [backend.token_to_id("</s>"), backend.token_to_id("<|im_end|>")]
    config["eos_token_id"] = eos_ids[0]

    def write_json(name: str, data: dict[str, Any]) -> None:
        (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    write_json("config.json", config)
    write_json(
        "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids},
    )
    write_json(
        "tokenizer_config.json",
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "</s>",
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": config["max_position_embeddings"],
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
        },
    )
    (out / "tokenizer.json").write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    return out, config


def make_tiny_model(out_dir: str | Path, seed: int = 0, shape: str = "tiny") -> Path:
    """Write a tiny model's HF directory into ``out_dir`` (created; existing files replaced).

    ``shape``: a SHAPES key. Files: config.json, generation_config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json. Returns ``out_dir`` as a Path. Deterministic in
    ``seed`` and ``shape``. Raises KeyError on an unknown shape.
    """
    import torch
    from safetensors.torch import save_file

    out, config = write_tiny_tokenizer_files(out_dir, shape)
    weights = _make_weights(config, seed)
    if config["torch_dtype"] == "bfloat16":  # drawn in fp32 (same numbers), stored as bf16
        weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
