"""Optional API keys for the gateway, held only as sha256 hashes.

Key lines (a file, or each value of a Kubernetes Secret) read
`<key or sha256:<64 hex>> [name=N] [rpm=N] [tpm=N] [weight=W] [max_queued=N] [max_inflight=N]
[allow_priority=true|false] [allow_fallback=true|false] [max_class=critical|standard|sheddable]
[batch_tokens=N]`; `#` at a line's start or after a space starts a comment (a key cannot start with `#` or hold spaces).
A key's name is its tenant in the fleet queue's fair share, `weight` its share (default 1), `max_queued` and
`max_inflight` its tenant's caps on requests waiting in the fleet queue and admitted but unfinished (default: the
gateway's --tenant-max-queued / --tenant-max-inflight); keys with the same name are one tenant, so they must give
the same weight and caps. `max_class` is the highest class (`x-kvfleet-priority`) the key may claim (default: the
gateway's --max-class; gateway/limits/class_grant.py refuses more); `allow_fallback` lets its requests go to their
model's fallback model while theirs is saturated, as `x-kvfleet-allow-fallback: true` does. `batch_tokens` is the
most tokens its tenant may have enqueued in unfinished Batch API batches (OpenAI's batch queue limit; default: the
gateway's --batch-max-tokens): batch work is counted there, never in rpm/tpm.
Hash a key for the file with `printf %s "$KEY" | sha256sum`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.fleet.headers import API_KEY, AUTHORIZATION, PRIORITY
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority

HASH_PREFIX = "sha256:"
LIMIT_OPTIONS = ("rpm", "tpm", "batch_tokens")
TENANT_CAP_OPTIONS = ("max_queued", "max_inflight")
BOOLEAN_OPTIONS = ("allow_priority", "allow_fallback")
WEIGHT_RANGE = (0.01, 1000.0)
COMMENT = re.compile(r"(^|\s)#.*")


@dataclass(frozen=True)
class KeyInfo:
    """Who a key belongs to and its limits; key_id (the hash's first 12 hex characters) is safe to log."""

    key_id: str
    name: str
    rpm: int | None = None
    tpm: int | None = None
    allow_priority: bool = False  # may set the engine's `priority` in the body; else the gateway drops it
    allow_fallback: bool = False  # its requests may go to a fallback model while theirs is saturated
    weight: float = 1.0  # its tenant's (its name's) share of the fleet queue, relative to other tenants
    max_queued: int | None = None  # its tenant's caps (None: the gateway's defaults)
    max_inflight: int | None = None
    max_class: Priority | None = None  # the highest class it may claim (None: the gateway's --max-class)
    batch_tokens: int | None = None  # its tenant's enqueued Batch API tokens (None: the gateway's --batch-max-tokens)


def hash_key(key: str) -> str:
    """The sha256 hex digest of a plaintext key, as the key file's `sha256:` entries hold it."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key_lines(
    text: str, source: str, default_rpm: int | None = None, default_tpm: int | None = None
) -> dict[str, KeyInfo]:
    """Key entries by sha256 hex; a malformed line raises ValueError naming `source` and the line number."""
    keys: dict[str, KeyInfo] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = COMMENT.sub("", raw).strip()
        if not line:
            continue
        try:
            digest, info = _parse_line(line, default_rpm, default_tpm)
        except ValueError as err:
            raise ValueError(f"{source} line {number}: {err}") from None
        if digest in keys:
            raise ValueError(f"{source} line {number}: the same key appears twice (key_id {info.key_id})")
        keys[digest] = info
    return keys


def _parse_line(line: str, default_rpm: int | None, default_tpm: int | None) -> tuple[str, KeyInfo]:
    first, *options = line.split()
    if "=" in first and first.split("=", 1)[0] in ("name", "weight", *LIMIT_OPTIONS, *TENANT_CAP_OPTIONS,
                                                   *BOOLEAN_OPTIONS, "max_class"):
        raise ValueError(f"the key must come first, before {first.split('=', 1)[0]}=")
    digest = _digest_of(first)
    settings: dict[str, Any] = {"name": digest[:12], "rpm": default_rpm, "tpm": default_tpm, "allow_priority": False,
                                "allow_fallback": False,
                                "weight": 1.0, "max_queued": None, "max_inflight": None, "max_class": None,
                                "batch_tokens": None}
    seen: set[str] = set()
    for option in options:
        field, sep, value = option.partition("=")
        if not sep or field not in settings:
            raise ValueError(f"unknown option {option!r}; expected name=, rpm=, tpm=, weight=, max_queued=, "
                             "max_inflight=, allow_priority=, allow_fallback=, max_class= or batch_tokens=")
        if field in seen:
            raise ValueError(f"{field}= is given twice")
        if not value:
            raise ValueError(f"{field}= needs a value")
        seen.add(field)
        if field == "name":
            settings[field] = value
        elif field == "weight":
            settings[field] = _parse_weight(value)
        elif field in BOOLEAN_OPTIONS:
            settings[field] = _parse_boolean(field, value)
        elif field == "max_class":
            settings[field] = _parse_class(value)
        else:
            settings[field] = _parse_limit(field, value)
    return digest, KeyInfo(key_id=digest[:12], **settings)


def _share(share: tuple[float, int | None, int | None]) -> str:
    weight, queued, inflight = share
    return f"weight={weight:g} max_queued={queued if queued is not None else '-'} " \
           f"max_inflight={inflight if inflight is not None else '-'}"


def _digest_of(token: str) -> str:
    if not token.startswith(HASH_PREFIX):
        return hash_key(token)
    digest = token[len(HASH_PREFIX):].lower()
    if len(digest) != 64 or any(c not in string.hexdigits for c in digest):
        raise ValueError(f"a sha256 hash must be 64 hex characters, got {len(digest)} characters")
    return digest


def _parse_boolean(field: str, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(f"{field}={value} must be true or false")
    return value.lower() == "true"


def _parse_class(value: str) -> Priority:
    try:
        return Priority(value.lower())
    except ValueError:
        raise ValueError(f"max_class={value} must be one of {PRIORITY_NAMES} (the highest {PRIORITY} the key may "
                         "send; default: the gateway's --max-class)") from None


def _parse_weight(value: str) -> float:
    low, high = WEIGHT_RANGE
    try:
        weight = float(value)
    except ValueError:
        weight = float("nan")
    if not low <= weight <= high:  # also refuses nan and inf
        raise ValueError(f"weight={value} must be a number from {low:g} to {high:g} (a tenant's share; default 1)")
    return weight


def _parse_limit(field: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{field}={value} must be a non-negative integer")
    return int(value)


class ApiKeyStore:
    """Checks presented keys against stored sha256 hashes; no plaintext key is kept."""

    def __init__(self, keys: Mapping[str, KeyInfo]):
        shares: dict[str, tuple[float, int | None, int | None]] = {}
        for info in keys.values():
            share = (info.weight, info.max_queued, info.max_inflight)
            if shares.setdefault(info.name, share) != share:
                raise ValueError(f"keys named {info.name!r} give different weights or caps ({_share(shares[info.name])}"
                                 f" and {_share(share)}); keys with one name are one tenant: give them the same "
                                 "weight=, max_queued= and max_inflight=")
        self._entries: list[tuple[bytes, KeyInfo]] = [(bytes.fromhex(h), info) for h, info in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def from_text(
        cls, text: str, source: str = "<keys>", default_rpm: int | None = None, default_tpm: int | None = None
    ) -> ApiKeyStore:
        """Keys from text in the key-line format; `source` names it in error messages."""
        keys = parse_key_lines(text, source, default_rpm, default_tpm)
        try:
            return cls(keys)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_file(
        cls, path: str | Path, default_rpm: int | None = None, default_tpm: int | None = None
    ) -> ApiKeyStore:
        """Keys from a UTF-8 file; an unreadable file raises OSError, a malformed line ValueError."""
        return cls.from_text(Path(path).read_text(encoding="utf-8"), str(path), default_rpm, default_tpm)

    @classmethod
    def from_secret(
        cls,
        namespace: str,
        name: str,
        api_client: Any = None,
        default_rpm: int | None = None,
        default_tpm: int | None = None,
    ) -> ApiKeyStore:
        """Keys from every data value of a Secret; blocking, so call it at start-up or in an executor."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = client.CoreV1Api(api_client or _default_api_client())
        try:
            secret = api.read_namespaced_secret(name=name, namespace=namespace)
        except ApiException as err:
            if err.status in (401, 403, 404):
                reason = {404: "not found"}.get(err.status, "not readable; grant `get` on secrets to the gateway")
                raise ValueError(f"Secret {namespace}/{name} is {reason}") from None
            raise
        keys: dict[str, KeyInfo] = {}
        for field, encoded in sorted((secret.data or {}).items()):
            source = f"Secret {namespace}/{name} key {field!r}"
            try:
                text = base64.b64decode(encoded, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                raise ValueError(f"{source} is not base64-encoded UTF-8 text") from None
            for digest, info in parse_key_lines(text, source, default_rpm, default_tpm).items():
                if digest in keys:
                    raise ValueError(f"{source}: key_id {info.key_id} also appears in another key of the Secret")
                keys[digest] = info
        return cls(keys)

    def authenticate(self, authorization_header: str | None) -> KeyInfo | None:
        """The key's info for `Bearer <key>`, else None."""
        scheme, _, token = (authorization_header or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.lookup(token.strip())

    def authenticate_headers(self, headers: Mapping[str, str]) -> KeyInfo | None:
        """`authorization: Bearer <key>` if it holds a valid key, else the raw key in `x-api-key`."""
        lowered = {k.lower(): v for k, v in headers.items()}
        info = self.authenticate(lowered.get(AUTHORIZATION))
        if info is None and lowered.get(API_KEY):
            info = self.lookup(lowered[API_KEY].strip())
        return info

    def lookup(self, key: str) -> KeyInfo | None:
        """Compares the key's hash with every stored hash in constant time, without stopping at a match."""
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, info in self._entries:
            if hmac.compare_digest(stored, digest):
                found = info
        return found


def _default_api_client() -> Any:
    """In-cluster service-account credentials, else the local kubeconfig."""
    from kubernetes import client, config

    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        return config.new_client_from_config()
