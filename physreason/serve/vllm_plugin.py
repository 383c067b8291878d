"""vLLM reasoning-parser plugin file: `vllm serve --reasoning-parser-plugin <this file> --reasoning-parser physreason`.

vLLM imports this file by its path (under a module name of its own); it only registers the parser, which
lives in `physreason.serve.vllm_parser`, so the class is defined once whatever imported it first.
"""

from physreason.serve.vllm_parser import register

register()
