"""`physreason serve`: vLLM's OpenAI-compatible server with Cosmos-Reason defaults and a reasoning parser.

`reasoning` splits `<think>`/`<answer>` output (pure Python); `vllm_parser` adapts it to vLLM's
reasoning-parser interface; `server` builds the `vllm serve` command. Nothing here imports vLLM at
package import, so the CLI and the splitter work where vLLM is absent.
"""

# The name the parser is registered under in vLLM (`--reasoning-parser physreason`).
PARSER_NAME = "physreason"
