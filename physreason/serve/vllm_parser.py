"""physreason's reasoning parser for vLLM's OpenAI server: `<think>` text to `reasoning`, `<answer>` text to `content`.

Registered under the name `physreason` (`--reasoning-parser physreason`). All splitting is
`physreason.serve.reasoning.ReasoningSplitter`; this class only adapts it to vLLM's interface.

Why it never reports the end of reasoning (`is_reasoning_end*` are always False): once a parser says
reasoning ended, vLLM streams every later token as raw content, tags included, without asking the parser
again; Cosmos-Reason's content is the text inside `<answer>...</answer>`, so the parser must see the whole
output. The cost: vLLM starts guided decoding (`response_format`, `structured_outputs`) only after the end
of reasoning, so requests with those are rejected by `adjust_request` instead of running unconstrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from physreason.serve import PARSER_NAME
from physreason.serve.reasoning import ReasoningSplitter, prompt_opens_think, split_reasoning
from physreason.vllm_compat import delta_message, reasoning_parser_classes

ReasoningParser, ReasoningParserManager = reasoning_parser_classes()

# Prompt tokens decoded to see whether the chat template opened <think> ("<|im_start|>assistant\n<think>\n"
# is about 5 tokens in Qwen's vocabulary; the tiny test tokenizer needs more).
_PROMPT_TAIL_TOKENS = 24


class PhysReasonReasoningParser(ReasoningParser):
    """Splits Cosmos-Reason1/2 output into reasoning and answer, streaming or not; malformed output is kept."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self._think_open = False
        self._splitter: ReasoningSplitter | None = None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Always False: the parser keeps every token of the output under its control (see the module doc)."""
        return False

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Any) -> bool:
        """Always False, for the same reason as `is_reasoning_end`."""
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """All ids: vLLM asks this only after the end of reasoning, which this parser never reports."""
        return list(input_ids)

    def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Note whether the chat template opened `<think>` in the prompt, so output starts as reasoning."""
        tail = self.model_tokenizer.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        self._think_open = prompt_opens_think(tail)

    def adjust_request(self, request: Any) -> Any:
        """Reject guided decoding with a clear message: it would never start under this parser (see the module doc)."""
        if _asks_for_structured_output(request):
            raise ValueError(
                "response_format / structured_outputs cannot be combined with the physreason reasoning parser: "
                "the answer is the text inside <answer>...</answer>; send the request without them"
            )
        return request

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """Split a whole completion: (reasoning, content), None for an empty part."""
        return split_reasoning(model_output)

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> Any:
        """The reasoning and content this delta settles, or None while it is held back (a tag being written)."""
        if self._splitter is None:
            self._splitter = ReasoningSplitter(think_open=self._think_open)
        piece = self._splitter.feed(delta_text)
        if not piece.reasoning and not piece.content:
            return None
        return delta_message(piece.reasoning or None, piece.content or None)

    def get_streaming_fallback_content(self, text: str, request: Any) -> str | None:
        """At the end of a stream, the content still held back (an unfinished `</answer>`, say).

        vLLM calls this when the stream ends without the end of reasoning (always, here) and appends
        what it returns to the last delta's content; it cannot carry reasoning, so reasoning held back
        at the end (blanks, or a `</think>` cut off by max_tokens) is not sent.
        """
        if self._splitter is None:
            return None
        return self._splitter.finish().content or None


def _asks_for_structured_output(request: Any) -> bool:
    response_format = getattr(request, "response_format", None)
    if response_format is not None and getattr(response_format, "type", "text") != "text":
        return True
    return getattr(request, "structured_outputs", None) is not None


def register() -> None:
    """Register the parser with vLLM under `physreason` (what the plugin file runs when vLLM imports it)."""
    ReasoningParserManager.register_module(PARSER_NAME, module=PhysReasonReasoningParser)
