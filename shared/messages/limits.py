"""Wire size limits, chosen so that no message we send can exceed NATS's payload limit.

NATS refuses payloads above ``max_payload`` (1 MiB by default); a client that sends one
gets its connection closed or a publish error, and a request then surfaces as a timeout —
a known failure in Dynamo. We make that impossible by construction:

* every encoded message is checked against :data:`MAX_MESSAGE_BYTES` (512 KiB, half the
  NATS default) at encode time and refused with ``MessageTooLargeError`` before sending;
* every string and container field has a maximum length (schema ``max_len``), so each
  message type has a computable worst-case size;
* the only large fields are token id lists. A token id is < 2**32, i.e. at most
  :data:`BYTES_PER_TOKEN_ID` = 5 bytes in msgpack (0xce + u32). With
  :data:`ENVELOPE_RESERVE_BYTES` for the rest of a PrefillRequest/MigrateRequest,
  ``MAX_WIRE_TOKEN_IDS = (512 KiB - 16 KiB) // 5 = 101_580`` token ids always fit. The
  router refuses prompts beyond the model context, and a deployment's ``max_model_len``
  must be ``<= MAX_WIRE_TOKEN_IDS`` (check with :func:`check_context_fits`);
* streamed tokens are packed into TokenBatch messages by ``pack_token_batches``, which
  splits into several messages when one would exceed the budget.
"""

from __future__ import annotations

from shared.errors import ContextLengthError

NATS_DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES = 512 * 1024
ENVELOPE_RESERVE_BYTES = 16 * 1024
BYTES_PER_TOKEN_ID = 5
MAX_TOKEN_ID = 2**32 - 1
MAX_WIRE_TOKEN_IDS = (MAX_MESSAGE_BYTES - ENVELOPE_RESERVE_BYTES) // BYTES_PER_TOKEN_ID
# KV blocks per request on the wire (AdmitReply): ids (u32, 5 B) + generations (u64, 9 B).
MAX_WIRE_BLOCKS = 16 * 1024


def check_context_fits(max_model_len: int) -> None:
    """Raise ContextLengthError if a context of ``max_model_len`` tokens could not travel
    in one PrefillRequest/MigrateRequest. Pure."""
    if max_model_len > MAX_WIRE_TOKEN_IDS:
        raise ContextLengthError(
            f"max_model_len {max_model_len} exceeds the wire limit of {MAX_WIRE_TOKEN_IDS} "
            "tokens per message"
        )
