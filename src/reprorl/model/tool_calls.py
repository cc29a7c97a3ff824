"""Tool calls as the chat templates here write them, read back from a model's text.

Qwen2.5 (and the embedded model's template, and Hermes-style models) write a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after the turn's text. The GRPO
worker's tool loop and the server's chat route read them with the same parser, so a model's
turn means the same in training and in serving.
"""

from __future__ import annotations

import json
import re

CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """A turn's text -> (content, calls). Content is the text outside the call blocks."""
    blocks = CALL_BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.strip())
        except json.JSONDecodeError:
            return text, []
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(arguments, dict)):
            return text, []
        calls.append({"name": call["name"], "arguments": arguments})
    return CALL_BLOCK.sub("", text).strip(), calls
