"""Router side of logprobs / echo / n, without a cluster: parsing, the echo gate in
RequestStream, the OpenAI objects, the per-choice seeds."""

from __future__ import annotations

import asyncio

import pytest

from services.router.errors import BadRequest
from services.router.generate import choice_seed
from services.router.logprobs import ChatLogprobs, CompletionLogprobs
from services.router.openai_api import parse_chat, parse_completion
from services.router.streams import RequestStream
from shared.messages import TokenItem, TokenLogprob
from shared.tokenizer import Tokenizer
from shared.tokenizer.models import load_tokenizer

MODEL = "tiny"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(MODEL)


def test_parse_logprobs_echo_n(tokenizer: Tokenizer) -> None:
    req = parse_completion(
        {"model": MODEL, "prompt": "hi", "logprobs": 2, "echo": True, "n": 3, "best_of": 3},
        tokenizer,
        MODEL,
    )
    assert (req.logprobs, req.echo, req.n) == (2, True, 3)
    assert parse_completion({"model": MODEL, "prompt": "hi"}, tokenizer, MODEL).logprobs is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**chat, "logprobs": True, "top_logprobs": 3}, tokenizer, MODEL).logprobs == 3
    assert parse_chat({**chat, "logprobs": True}, tokenizer, MODEL).logprobs == 0
    assert parse_chat({**chat, "logprobs": False}, tokenizer, MODEL).logprobs is None
    for bad, param in (
        ({**chat, "top_logprobs": 2}, "top_logprobs"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**chat, "echo": True}, "echo"),
    ):
        with pytest.raises(BadRequest) as info:
            parse_chat(bad, tokenizer, MODEL)
        assert info.value.param == param


def test_echo_holds_tokens_until_every_prompt_logprob_is_in() -> None:
    async def run() -> None:
        lp = TokenLogprob(logprob=-0.5, top_ids=(4,), top_logprobs=(-0.5,))
        stream = RequestStream("r", prompt_len=4)  # prompt positions 1..3 to come
        # D's token and its part of the prompt (positions 3) first, then P's (1..2).
        stream.offer(
            TokenItem(
                request_id="r",
                index=0,
                token_ids=(9,),
                logprobs=(lp,),
                finish_reason="length",
                prompt_logprobs_start=3,
                prompt_logprobs=(lp,),
            )
        )
        assert not stream.finished and stream.num_tokens == 0
        stream.offer(TokenItem(request_id="r", prompt_logprobs_start=1, prompt_logprobs=(lp, lp)))
        chunk = await asyncio.wait_for(stream.next(), 1)
        assert chunk.token_ids == [9] and chunk.logprobs == [lp]
        assert chunk.end is not None and chunk.end.finish_reason == "length"
        assert sorted(stream.prompt_logprobs) == [1, 2, 3]

    asyncio.run(run())


def test_openai_logprob_objects(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world")[:2]
    lp = TokenLogprob(logprob=-1.25, top_ids=(ids[1], ids[0]), top_logprobs=(-1.25, float("-inf")))
    comp = CompletionLogprobs(tokenizer, num_top=2)
    comp.add(ids[0], None)  # echo: the first prompt token has nothing before it
    comp.add(ids[1], lp)
    out = comp.take()
    assert out["token_logprobs"] == [None, -1.25] and out["top_logprobs"][0] is None
    assert max(out["top_logprobs"][1].values()) == -1.25
    assert min(out["top_logprobs"][1].values()) == -9999.0  # -inf as vLLM sends it
    assert out["text_offset"][0] == 0 and out["text_offset"][1] == len(out["tokens"][0])
    assert comp.take()["tokens"] == []  # taken once
    chat = ChatLogprobs(tokenizer, num_top=1)
    chat.add(ids[1], lp)
    (entry,) = chat.take()["content"]
    assert entry["logprob"] == -1.25 and len(entry["top_logprobs"]) == 1
    assert entry["bytes"] == list(entry["token"].encode())


def test_choice_seeds_are_distinct_and_stable() -> None:
    seeds = [choice_seed(1234, i) for i in range(16)]
    assert seeds[0] == 1234 and len(set(seeds)) == 16
    assert seeds == [choice_seed(1234, i) for i in range(16)]
    assert all(0 <= s < 2**62 for s in seeds)
