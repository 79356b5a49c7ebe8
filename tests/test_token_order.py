"""Custody hand-overs reach the router before the new worker's tokens.

The router takes a request's tokens only from workers it was told of: a hand-over item
(a queue hand-off at a P->D switch, a re-pairing, a live migration) names the new worker,
and that worker then streams over *its own* connection. nats-server orders messages per
connection only, so "the notice left first" is not enough: the old worker must wait until
the server has processed it (``TokenFlusher.deliver_now``), else the new worker's first
tokens can overtake it and be dropped as foreign, and the stream never completes. A slow
link on the old worker's connection makes the overtaking certain.
"""

from __future__ import annotations

import asyncio

from services.worker.token_stream import TokenFlusher, TokenStreamer
from shared.bus import Bus
from shared.bus.config import BusConfig
from shared.messages import StreamSequencer, Subjects, TokenBatch, TokenItem
from shared.policy.roles import DECODE
from tests.support.nats_server import NatsServer
from tests.support.slow_link import SlowLink

SUBJECTS = Subjects("fluidpd")
LINK_DELAY_S = 0.5  # the old worker's uplink latency; far above a loopback round trip


async def test_a_hand_over_is_processed_before_the_new_worker_may_stream(
    nats_server: NatsServer,
) -> None:
    router_subject = SUBJECTS.router_tokens("r0")
    seen: list[tuple[str, str | None]] = []  # (publisher, handed_to) in arrival order
    both = asyncio.Event()

    async def on_batch(batch: TokenBatch) -> None:
        seen.extend((batch.publisher_id, item.handed_to) for item in batch.items)
        if len(seen) >= 2:
            both.set()

    async with SlowLink("127.0.0.1", nats_server.port) as link:
        old = Bus(BusConfig.from_url(link.url, name="p0"), SUBJECTS)
        new = Bus(BusConfig.from_url(nats_server.url, name="d1"), SUBJECTS)
        router = Bus(BusConfig.from_url(nats_server.url, name="r0"), SUBJECTS)
        async with old, new, router:
            await router.subscribe_stream(SUBJECTS.router_tokens_in("r0"), TokenBatch, on_batch)
            await router.flush()  # the subscription is in place at the server
            streamer = TokenStreamer(StreamSequencer("p0"))
            flusher = TokenFlusher(streamer, old, SUBJECTS, "p0")
            flushing = asyncio.ensure_future(flusher.run())
            try:
                link.delay_s = LINK_DELAY_S
                streamer.add(router_subject, TokenItem.hand_over("req1", "d1", DECODE))
                await flusher.deliver_now()
                # Only now may d1 get the request (the KV leaves after this) and stream it.
                first = TokenItem(request_id="req1", index=1, token_ids=(7,))
                batch = TokenBatch(publisher_id="d1", epoch=1, seq=0, items=(first,))
                await new.publish(SUBJECTS.tokens_from(router_subject, "d1"), batch)
                await asyncio.wait_for(both.wait(), 10 * LINK_DELAY_S + 10)
            finally:
                flushing.cancel()
    assert seen == [("p0", "d1"), ("d1", None)], "d1's token overtook the hand-over notice"
