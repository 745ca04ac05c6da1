"""Prefix affinity: send prompts that share a prefix to the engine that likely holds its KV in its prefix cache.

The gateway does not tokenize. Like the Inference Extension's prefix plugin it hashes the prompt's leading
characters in fixed blocks, chained so a block's hash names everything before it, and remembers in an LRU table
which engine each block went to. A prompt's match on an engine is the share of its leading blocks found there.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class ApproximatePrefixTable:
    def __init__(self, block_chars: int = 64, max_blocks: int = 128, capacity: int = 100_000):
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def block_hashes(self, prompt: str, adapter: str | None = None) -> list[bytes]:
        """Chained hashes of the prompt's full leading blocks (a partial last block is never cached whole); an
        adapter's chain starts from its name, as its blocks in an engine are its own."""
        data = prompt.encode("utf-8", errors="replace")
        n = min(len(data) // self.block_chars, self.max_blocks)
        hashes = []
        previous = b"" if adapter is None else hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=16).digest()
        for i in range(n):
            previous = hashlib.blake2b(previous + data[i * self.block_chars:(i + 1) * self.block_chars],
                                       digest_size=16).digest()
            hashes.append(previous)
        return hashes

    def matches(self, hashes: list[bytes]) -> dict[str, float]:
        """For each engine, the share of the prompt's blocks whose longest cached run from the start it holds."""
        if not hashes:
            return {}
        run: dict[str, int] = {}
        alive: set[str] | None = None
        for h in hashes:
            url = self._owner.get(h)
            if url is None or (alive is not None and url not in alive):
                break
            run[url] = run.get(url, 0) + 1
            alive = {url}
        return {url: count / len(hashes) for url, count in run.items()}

    def record(self, hashes: list[bytes], url: str) -> None:
        for h in hashes:
            self._owner[h] = url
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, url: str) -> None:
        """An engine left the pool; its cache went with it."""
        for h in [h for h, u in self._owner.items() if u == url]:
            del self._owner[h]


def prompt_text(body: dict) -> str:
    """The text a request's KV starts from: the prompt, or the chat messages in order."""
    if isinstance(body.get("messages"), list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # content parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""
