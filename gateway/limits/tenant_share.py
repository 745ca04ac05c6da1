"""Who holds less than an equal share of the requests in flight: this replica's admitted, unfinished requests per
tenant (queued or at an engine). A standard request of a tenant below its share goes ahead of the rest of its class
inside the engines (kvfleet.fleet.priority.UNDER_SHARE_ENGINE_PRIORITY), so an engine's own first-come queue does not
put a light tenant's request behind a flood the fair queue had already ordered after it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class InFlightShares:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._total = 0

    def under_share(self, tenant: str) -> bool:
        """Fewer of the tenant's requests in flight than an equal share among the tenants in flight (it included);
        False with nothing in flight."""
        tenants = len(self._counts) + (tenant not in self._counts)
        return self._counts[tenant] * tenants < self._total

    def start(self, tenant: str) -> Callable[[], None]:
        """Counts one request of the tenant; the function returned ends it (once)."""
        self._counts[tenant] += 1
        self._total += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._total -= 1
                self._counts[tenant] -= 1
                if self._counts[tenant] <= 0:
                    del self._counts[tenant]
        return end
