"""Every Redis key and channel the fleet uses, one builder each. All start with `kvfleet:{<fleet>}:`.

The fleet name sits in braces, a Redis Cluster hash tag, so one fleet's keys share a slot (the queue's Lua
scripts touch several of them at once). The operator reads `queue_key` (ZCARD: the fleet's queued requests).
"""

from __future__ import annotations


def key_prefix(fleet: str) -> str:
    return f"kvfleet:{{{fleet}}}:"


def queue_key(fleet: str) -> str:
    """Sorted set: entry id -> score; its ZCARD is the fleet's queued-request count, which the operator reads."""
    return key_prefix(fleet) + "queue"


def queue_entries_key(fleet: str) -> str:
    """Hash: entry id -> "owner|priority|deadline_ms|charge|tenant" (charge: its tokens / its tenant's weight)."""
    return key_prefix(fleet) + "queue:entries"


def queue_classes_key(fleet: str) -> str:
    """Hash: priority -> entries queued in that class."""
    return key_prefix(fleet) + "queue:classes"


def queue_band_tenants_key(fleet: str, priority: str) -> str:
    """Sorted set: tenant -> counter of service (tokens / weight), for the tenants with entries queued in a band."""
    return key_prefix(fleet) + f"queue:band:{priority}:active"


def queue_band_idle_key(fleet: str, priority: str) -> str:
    """Sorted set: tenant -> counter, for tenants with nothing queued in a band (bounded, lowest trimmed; expires)."""
    return key_prefix(fleet) + f"queue:band:{priority}:idle"


def queue_band_tenant_prefix(fleet: str, priority: str) -> str:
    """What the sorted set of a tenant's queued entries in a band (entry id -> score) starts with; the queue's Lua
    scripts append the tenant's name."""
    return key_prefix(fleet) + f"queue:band:{priority}:tenant:"


def queue_floors_key(fleet: str) -> str:
    """Hash: priority -> the counter of the last tenant whose queued entries in that band ran out."""
    return key_prefix(fleet) + "queue:floors"


def queue_released_key(fleet: str) -> str:
    """Counter of entries released in the last scrape interval, by any replica (expires)."""
    return key_prefix(fleet) + "queue:released"


def queue_leases_key(fleet: str) -> str:
    """Hash: entry id -> "owner|released_ms", for entries released to another replica that has not yet said it has
    the grant."""
    return queue_key(fleet) + ":leases"


def queue_drained_key(fleet: str) -> str:
    """Sorted set: entries released fleet-wide lately, entry id -> release time (ms since the epoch), trimmed to the
    drain-rate window by the release script: what the drain rate is measured from."""
    return key_prefix(fleet) + "queue:drained"


def queue_busy_since_key(fleet: str) -> str:
    """String: when (ms since the epoch) the queue last went from empty to holding an entry; absent while it is
    empty. Set by the enqueue script, removed by whichever script takes its last entry: the drain rate counts the
    releases since it (gateway/queue/wait.py)."""
    return key_prefix(fleet) + "queue:busy_since"


def tenant_inflight_key(fleet: str, tenant: str) -> str:
    """Sorted set: a tenant's admitted, unfinished requests (id -> lease expiry ms), for its in-flight cap."""
    return key_prefix(fleet) + f"tenant:{tenant}:inflight"


def heartbeat_prefix(fleet: str) -> str:
    """What a gateway replica's heartbeat key starts with; the queue's Lua scripts append an owner's id."""
    return key_prefix(fleet) + "gateway:"


def heartbeat_key(fleet: str, gateway_id: str) -> str:
    """A replica's heartbeat (expires); queued entries of a replica without one are dropped."""
    return heartbeat_prefix(fleet) + gateway_id


def live_entries_key(fleet: str, gateway_id: str) -> str:
    """Set: the entries a replica still holds connections for, written just before a sweep of its orphans."""
    return heartbeat_key(fleet, gateway_id) + ":live"


def grants_prefix(fleet: str) -> str:
    """What a replica's grants channel starts with; the queue's Lua scripts append an owner's id."""
    return key_prefix(fleet) + "grants:"


def grants_channel(fleet: str, gateway_id: str) -> str:
    """Pub/sub channel on which other replicas hand a replica its released entries."""
    return grants_prefix(fleet) + gateway_id


def slo_slot_key(fleet: str, slot_start: int) -> str:
    """Hash: `<class>:<counter>` -> what every gateway replica counted of that class in the slot starting at this
    Unix second (kvfleet/fleet/slo_stats.py: the counters, the slot length, its TTL)."""
    return key_prefix(fleet) + f"slo:{slot_start}"


def rate_limit_key(fleet: str, key_id: str) -> str:
    """Hash of one API key's usage, fields `r:<unix second>` (requests) and `t:<unix second>` (tokens)."""
    return key_prefix(fleet) + f"ratelimit:{key_id}"


# The Batch API (gateway/batch/state.py)

def batch_files_key(fleet: str) -> str:
    """Hash: file id -> its record (JSON: tenant, bytes, created_at, filename, purpose)."""
    return key_prefix(fleet) + "batch:files"


def batch_tenant_files_key(fleet: str, tenant: str) -> str:
    """Sorted set: a tenant's file ids by creation time."""
    return key_prefix(fleet) + f"batch:tenant:{tenant}:files"


def batch_file_expiry_key(fleet: str) -> str:
    """ZSET file id -> the Unix second it expires (files with an expiry only)."""
    return key_prefix(fleet) + "batch:file-expiry"


def batch_key(fleet: str, batch_id: str) -> str:
    """Hash: a batch's record, status, times, total and result file ids."""
    return key_prefix(fleet) + f"batch:{batch_id}"


def batch_tenant_batches_key(fleet: str, tenant: str) -> str:
    """Sorted set: a tenant's batch ids by creation time."""
    return key_prefix(fleet) + f"batch:tenant:{tenant}:batches"


def batch_active_key(fleet: str) -> str:
    """Sorted set: unfinished batch ids by creation time (what the replicas' runners take)."""
    return key_prefix(fleet) + "batch:active"


def batch_lease_key(fleet: str, batch_id: str) -> str:
    """The replica running a batch (expires unless renewed)."""
    return key_prefix(fleet) + f"batch:{batch_id}:lease"


def batch_results_key(fleet: str, batch_id: str) -> str:
    """Hash: custom_id -> the output file's line (JSON), written once."""
    return key_prefix(fleet) + f"batch:{batch_id}:results"


def batch_errors_key(fleet: str, batch_id: str) -> str:
    """Hash: custom_id (or line:N) -> the error file's line (JSON), written once."""
    return key_prefix(fleet) + f"batch:{batch_id}:errors"


def batch_backlog_key(fleet: str) -> str:
    """Hash: batch id -> its unfinished work for this fleet's engines (JSON: remaining, prompt_tokens, output_tokens,
    deadline, reported_at), which the gateway runners report and the operator's autoscaler reads."""
    return key_prefix(fleet) + "batch:backlog"
