"""The bench/test bus client records tokens in stream order, as the router does.

Tokens of one request reach the client from two publishers (P's first token, D's rest)
over two NATS connections; the server orders messages per connection only, so D's second
token can arrive before P's first. CI saw exactly that once (a split test, token 1 ahead of
token 0). The router orders by position; the client every e2e test reads must too.
"""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from services.bench.bus_client import BenchBusClient, StreamRecord
from shared.messages import TokenBatch, TokenItem, TokenLogprob


def _lp(tok: int) -> TokenLogprob:
    return TokenLogprob(logprob=-float(tok), top_ids=(tok,), top_logprobs=(-float(tok),))


@given(order=st.permutations(range(7)))
def test_any_arrival_order_reads_in_stream_order(order: list[int]) -> None:
    rec = StreamRecord("r", 0.0, 0.0)
    for pos in order:
        by = "p0" if pos == 0 else "d0"
        rec.place(pos, 100 + pos, float(pos), float(pos), by, _lp(100 + pos))
    assert rec.indices == list(range(7))
    assert rec.token_ids == [100 + p for p in range(7)]
    assert rec.recv_s == [float(p) for p in range(7)]  # each token keeps its own time
    assert rec.publishers == ["p0"] + ["d0"] * 6
    assert [lp.top_ids[0] for lp in rec.logprobs] == rec.token_ids


def test_a_repeated_position_stays_visible() -> None:
    rec = StreamRecord("r", 0.0, 0.0)
    for pos in (0, 2, 1, 1):
        rec.place(pos, pos, 0.0, 0.0, "d0")
    assert rec.indices == [0, 1, 1, 2]  # so `indices == list(range(n))` catches it


def test_batches_from_two_publishers_out_of_order() -> None:
    """Through the inbound handler: D's batch (tokens 1-2, finish) lands before P's
    (token 0); the record reads 0, 1, 2 and is done."""
    client = BenchBusClient("nats://127.0.0.1:1")  # never started: no connection needed
    client.streams["r"] = rec = StreamRecord("r", 0.0, 0.0)
    d_items = (TokenItem(request_id="r", index=1, token_ids=(11, 12), finish_reason="length"),)
    p_items = (TokenItem(request_id="r", index=0, token_ids=(10,)),)
    d = TokenBatch(publisher_id="d0", epoch=1, seq=0, items=d_items)
    p = TokenBatch(publisher_id="p0", epoch=1, seq=0, items=p_items)

    async def feed() -> None:
        await client._on_batch(d)
        await client._on_batch(p)

    asyncio.run(feed())
    assert rec.token_ids == [10, 11, 12] and rec.publishers == ["p0", "d0", "d0"]
    assert rec.finish_reason == "length" and rec.done.is_set()
