"""What counts as Redis being unavailable, for every part of the gateway that falls back when it is."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# A wrong answer counts too: a connection cut by a timeout mid-reply can hand a later command an earlier one's error
# (seen: redis-py's CLIENT SETINFO refusal from an older server as a queue script's answer, a 500 to the client);
# the caller falls back to the replica's own state and tries Redis again, as after a timeout.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, RedisResponseError, OSError)
# redis-py's connection options: no CLIENT SETINFO on connect, which Redis before 7.2 refuses
CLIENT_OPTIONS = {"lib_name": None, "lib_version": None}
