"""One asyncio task per engine in the pool, kept in step with it: what the scraper and the KV-event follower run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine


class PerEngineLoops:
    def __init__(self, loop: Callable[[str], Coroutine], name: str, on_leave: Callable[[str], None] = lambda url: None):
        self.loop, self.name, self.on_leave = loop, name, on_leave
        self.tasks: dict[str, asyncio.Task] = {}

    def sync(self, urls: Collection[str]) -> None:
        """Start a loop for each new engine; cancel the loops of those that left (on_leave told of each)."""
        for url in list(self.tasks):
            if url not in urls:
                self.tasks.pop(url).cancel()
                self.on_leave(url)
        for url in urls:
            if url not in self.tasks:
                self.tasks[url] = asyncio.create_task(self.loop(url), name=f"{self.name} {url}")

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()
