"""API keys: plaintext and hashed entries from a file or a Kubernetes Secret, checked from request headers."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path

import kmock
import pytest
from kubernetes import client

from kvfleet.gateway.limits.keys import ApiKeyStore, KeyInfo, hash_key

ALICE = "sk-alice-0123456789"
BOB = "sk-bob-abcdefghij"


def write_keys(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


@pytest.fixture
def store(tmp_path: Path) -> ApiKeyStore:
    text = f"# gateway keys\n\n{ALICE} name=alice rpm=60 tpm=10000\nsha256:{hash_key(BOB)} name=bob  # hashed\n"
    return ApiKeyStore.from_file(write_keys(tmp_path, text), default_rpm=5)


def test_a_valid_key_passes_and_carries_its_name_and_limits(store: ApiKeyStore) -> None:
    alice = store.authenticate(f"Bearer {ALICE}")
    assert alice == KeyInfo(key_id=hash_key(ALICE)[:12], name="alice", rpm=60, tpm=10000)
    assert store.authenticate(f"bearer  {ALICE} ") == alice


def test_a_hashed_entry_accepts_its_plaintext_key_and_gets_the_defaults(store: ApiKeyStore) -> None:
    assert store.authenticate(f"Bearer {BOB}") == KeyInfo(key_id=hash_key(BOB)[:12], name="bob", rpm=5, tpm=None)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", f"Basic {ALICE}", ALICE, "Bearer sk-alice",
                                    f"Bearer {ALICE}x", f"Bearer sha256:{hash_key(ALICE)}", f"Bearer {hash_key(BOB)}"])
def test_a_missing_or_wrong_key_is_refused(store: ApiKeyStore, header: str | None) -> None:
    assert store.authenticate(header) is None


def test_only_keys_marked_allow_priority_may_set_the_engine_priority(tmp_path: Path) -> None:
    store = ApiKeyStore.from_file(write_keys(tmp_path, f"{ALICE} allow_priority=true\n{BOB} allow_priority=False\n"))
    assert store.authenticate(f"Bearer {ALICE}").allow_priority
    assert not store.authenticate(f"Bearer {BOB}").allow_priority
    assert not ApiKeyStore.from_text(f"{ALICE} name=alice").authenticate(f"Bearer {ALICE}").allow_priority


def test_headers_take_the_bearer_key_then_x_api_key(store: ApiKeyStore) -> None:
    assert store.authenticate_headers({"Authorization": f"Bearer {ALICE}"}).name == "alice"
    assert store.authenticate_headers({"X-API-Key": BOB}).name == "bob"
    # The OpenAI SDK always sends a bearer token; a placeholder there must not hide the real key in x-api-key.
    assert store.authenticate_headers({"authorization": "Bearer EMPTY", "x-api-key": BOB}).name == "bob"
    assert store.authenticate_headers({"authorization": "Bearer EMPTY", "x-api-key": "nope"}) is None
    assert store.authenticate_headers({}) is None


def reachable_text(obj: object, seen: set[int] | None = None) -> list[str | bytes]:
    """Every str and bytes value reachable from an object's attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, str | bytes):
        return [obj]
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set | frozenset):
        children = list(obj)
    elif dataclasses.is_dataclass(obj):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [text for child in children for text in reachable_text(child, seen)]


def test_the_store_holds_no_plaintext_key(store: ApiKeyStore) -> None:
    values = reachable_text(store)
    assert values, "the walk found nothing; the store's layout changed"
    for key in (ALICE, BOB):
        assert not any(key in v if isinstance(v, str) else key.encode() in v for v in values)
    assert ALICE not in repr(store.authenticate(f"Bearer {ALICE}"))


BAD_LINES = [
    ("sha256:abc123", "a sha256 hash must be 64 hex characters, got 6"),
    (f"sha256:{'g' * 64}", "64 hex characters"),
    (f"sha256:{hash_key(ALICE)}0", "got 65"),
    ("sk-x rpm=ten", "rpm=ten must be a non-negative integer"),
    ("sk-x rpm=-1", "rpm=-1 must be a non-negative integer"),
    ("sk-x tpm=1.5", "tpm=1.5 must be a non-negative integer"),
    ("sk-x batch_tokens=1e6", "batch_tokens=1e6 must be a non-negative integer"),
    ("batch_tokens=5 sk-x", "the key must come first"),
    ("sk-x rpm=", "rpm= needs a value"),
    ("sk-x color=red", "unknown option 'color=red'"),
    ("sk-x rpm", "unknown option 'rpm'"),
    ("sk-x rpm=1 rpm=2", "rpm= is given twice"),
    ("name=alice sk-x", "the key must come first"),
    ("allow_priority=true sk-x", "the key must come first"),
    ("sk-x allow_priority=yes", "allow_priority=yes must be true or false"),
    ("sk-x allow_priority=", "allow_priority= needs a value"),
    (ALICE, "the same key appears twice"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_a_malformed_line_names_its_line_number(tmp_path: Path, line: str, message: str) -> None:
    """Bad inputs: short, non-hex and over-long hashes; non-integer, negative, fractional and empty limits;
    an unknown option, an option without a value, a repeated option, an option before the key, a duplicate key."""
    path = write_keys(tmp_path, f"# keys\n{ALICE} name=alice\n\n{line}\n")
    with pytest.raises(ValueError, match=f"keys.txt line 4: .*{message}"):
        ApiKeyStore.from_file(path)


def secret(namespace: str, name: str, data: dict[str, str]) -> dict:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": encoded,
            "metadata": {"name": name, "namespace": namespace}}


def load_from_emulator(objects: dict[str, dict], namespace: str, name: str) -> ApiKeyStore:
    """ApiKeyStore.from_secret against KMock's Kubernetes emulator on loopback, holding the given Secrets."""

    async def run() -> ApiKeyStore:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            for secret_name, body in objects.items():
                emulator.objects["v1/secrets", body["metadata"]["namespace"], secret_name] = body
            configuration = client.Configuration(host=str(server.url).rstrip("/"))
            configuration.api_key = {"authorization": "Bearer test-token"}
            with client.ApiClient(configuration) as api_client:
                # The kubernetes client blocks; the emulator serves from this event loop.
                return await asyncio.to_thread(ApiKeyStore.from_secret, namespace=namespace, name=name,
                                               api_client=api_client, default_tpm=1000)

    return asyncio.run(run())


# kmock 0.8 reads its bundled resource list with a deprecated importlib call.
kmock_warnings = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


@kmock_warnings
def test_keys_load_from_every_value_of_a_kubernetes_secret() -> None:
    body = secret("llm", "gateway-keys", {"team-a": f"{ALICE} name=alice rpm=10\n# comment\nsk-carol name=carol\n",
                                          "team-b": f"sha256:{hash_key(BOB)} name=bob tpm=50"})
    store = load_from_emulator({"gateway-keys": body}, "llm", "gateway-keys")
    assert len(store) == 3
    assert store.authenticate(f"Bearer {ALICE}") == KeyInfo(hash_key(ALICE)[:12], "alice", rpm=10, tpm=1000)
    assert store.authenticate("Bearer sk-carol").name == "carol"
    assert store.authenticate(f"Bearer {BOB}").tpm == 50
    assert store.authenticate("Bearer sk-mallory") is None


@kmock_warnings
def test_a_missing_or_malformed_secret_gives_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Secret llm/absent is not found"):
        load_from_emulator({}, "llm", "absent")
    body = secret("llm", "keys", {"keys": "sk-ok\nsk-bad rpm=many\n"})
    with pytest.raises(ValueError, match="Secret llm/keys key 'keys' line 2: rpm=many"):
        load_from_emulator({"keys": body}, "llm", "keys")
