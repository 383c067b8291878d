"""Chat messages in the OpenAI / Hugging Face layout, with the prompts each Cosmos-Reason generation expects.

Visual payloads are never embedded: each video or image becomes a `{"type": "video"}` or
`{"type": "image"}` placeholder, and the caller passes the frames to the processor or engine
separately (each kind in its own order). The builders live in `physreason.chat.style`, beside the
prompt styles they follow.
"""

from __future__ import annotations

from physreason.chat.style import Message, build_mcq_messages, build_messages

__all__ = ["Message", "build_mcq_messages", "build_messages"]
