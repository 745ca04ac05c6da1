"""Shared-prefix workloads for the routing benchmark, pure and seeded: the same plan for every routing arm.

`tenants`: T tenants, each with a distinct ~400-token system prompt of natural-looking text, popularity Zipf-skewed;
each request is [system, a short user question]. `chats`: multi-turn conversations that resend their history, each
turn adding the previous answer (synthetic, so the plan does not depend on what the model says) and a new question.
Arrivals are Poisson at `rate` requests per second.

`conversations` (plan_conversations) is closed-loop per conversation, as guidellm's and aiperf's multi-turn
scenarios: conversations of 4-8 turns start as a Poisson process, each on one of a few apps' shared system prompts
(Zipf-popular); each turn resends the whole conversation with the model's own earlier answers, and is sent a think
time (exponential) after the previous answer ended. Only the questions, the think times and the starts are planned;
the answers come from the model at run time (bench/prefix_client.py run_conversations).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvfleet.loadgen import WORDS, arrival_times

WORKLOADS = ("tenants", "chats", "conversations")
SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "sa", "bel", "dun", "ex", "qua", "zi", "pro", "nor", "vel", "ari",
             "cor", "fen", "gal", "hul", "iso", "jun", "kip", "lum", "mor", "nex", "ost", "pax", "rin", "sul")
TRADES = ("logistics", "insurance", "dental care", "bookkeeping", "travel", "gardening", "legal aid", "pet care",
          "banking", "home repair", "tutoring", "fitness", "catering", "car rental", "real estate", "pharmacy")
OPENERS = ("How do I", "Can you explain how to", "What is the best way to", "Why does my", "Is it possible to",
           "Please tell me how to", "When should I", "Who can help me")
Message = dict[str, str]


@dataclass(frozen=True)
class PlannedChat:
    """One request of the plan: when to send it, its messages, whose prefix it carries."""

    index: int
    send_at: float  # seconds from the start of the run
    messages: list[Message]
    key: str  # the tenant or conversation whose prefix the request carries
    first_of_key: bool  # nobody sent this prefix before: a miss under any routing


def _sentence(rng: random.Random, lo: int = 8, hi: int = 16) -> str:
    words = rng.choices(WORDS, k=rng.randint(lo, hi))
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, words: int) -> str:
    """About `words` words of sentences; common English words are one token each, so words ≈ tokens."""
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(_sentence(rng))
    return " ".join(out)


def tenant_names(count: int, rng: random.Random) -> list[str]:
    """Distinct made-up company names, so every system prompt differs from its first characters on."""
    if count > len(SYLLABLES) ** 2:
        raise ValueError(f"at most {len(SYLLABLES) ** 2} tenants, not {count}")
    heads: set[str] = set()
    names: list[str] = []
    while len(names) < count:
        head = "".join(rng.choices(SYLLABLES, k=2))
        if head not in heads:  # distinct in the first two syllables, not only somewhere in the name
            heads.add(head)
            names.append((head + rng.choice(SYLLABLES)).capitalize())
    return names


def system_prompts(count: int, words: int, rng: random.Random) -> list[str]:
    """One distinct system prompt per tenant: its name, its trade, then `words` words of house rules."""
    return [f"{name} {rng.choice(TRADES)} assistant. You answer questions from customers of {name}. "
            + _text(rng, words) for name in tenant_names(count, rng)]


def question(rng: random.Random) -> str:
    """A short user question, ~15-25 tokens."""
    return f"{rng.choice(OPENERS)} {' '.join(rng.choices(WORDS, k=rng.randint(10, 18)))}?"


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(count)]


def plan_tenants(num_requests: int, rate: float, seed: int = 0, tenants: int = 40, system_words: int = 340,
                 zipf_s: float = 1.1, prime: bool = True) -> list[PlannedChat]:
    """Requests from Zipf-popular tenants, each [system prompt of its tenant, a fresh question]. With `prime`, the
    first `tenants` requests name each tenant once (shuffled), so a run that leaves them out of its figures measures
    no tenant's unavoidable first miss."""
    rng = random.Random(seed)
    prompts = system_prompts(tenants, system_words, rng)
    primer = rng.sample(range(tenants), tenants) if prime else []
    picks = primer + rng.choices(range(tenants), weights=zipf_weights(tenants, zipf_s), k=num_requests)
    picks = picks[:num_requests]
    times = arrival_times(num_requests, rate, rng)
    seen: set[int] = set()
    plan = []
    for i, (tenant, at) in enumerate(zip(picks, times, strict=True)):
        messages = [{"role": "system", "content": prompts[tenant]}, {"role": "user", "content": question(rng)}]
        plan.append(PlannedChat(i, at, messages, f"tenant-{tenant}", tenant not in seen))
        seen.add(tenant)
    return plan


def plan_chats(num_requests: int, rate: float, seed: int = 0, conversations: int = 24, max_turns: int = 8,
               system_words: int = 60, answer_words: int = 20) -> list[PlannedChat]:
    """Each arrival sends the next turn of one of `conversations` open conversations, chosen at random; a
    conversation that has had `max_turns` turns is replaced by a new one, so histories stay bounded."""
    rng = random.Random(seed)
    times = arrival_times(num_requests, rate, rng)
    started = 0

    def new_conversation() -> tuple[str, list[Message]]:
        nonlocal started
        started += 1
        name = f"conversation-{started - 1}"
        return name, [{"role": "system", "content": f"Conversation {started - 1}. " + _text(rng, system_words)}]

    open_ones = [new_conversation() for _ in range(conversations)]
    plan = []
    for i, at in enumerate(times):
        slot = rng.randrange(conversations)
        name, history = open_ones[slot]
        first = len(history) == 1
        history = [*history, {"role": "user", "content": question(rng)}]
        plan.append(PlannedChat(i, at, history, name, first))
        history = [*history, {"role": "assistant", "content": _text(rng, answer_words)}]
        open_ones[slot] = new_conversation() if len(history) >= 1 + 2 * max_turns else (name, history)
    return plan


@dataclass(frozen=True)
class PlannedConversation:
    """One conversation of the closed-loop multi-turn workload: when it starts, its app's system prompt, its
    questions in order, and the think time after each answer before the next question."""

    key: str
    start_at: float  # seconds from the start of the run
    system: str
    questions: tuple[str, ...]
    think_s: tuple[float, ...]


TURNS = (4, 8)  # turns per conversation, uniform in this range (inclusive)


def plan_conversations(num_requests: int, rate: float, seed: int = 0, apps: int = 4, think_mean_s: float = 3.0,
                       system_words: int = 300, zipf_s: float = 1.1) -> list[PlannedConversation]:
    """Conversations of about `num_requests` turns in all, starting at `rate` / (mean turns) per second so that
    turns arrive at about `rate` per second while answers are quick; each on one of `apps` system prompts."""
    rng = random.Random(seed)
    systems = system_prompts(apps, system_words, rng)
    mean_turns = sum(TURNS) / 2
    count = max(1, round(num_requests / mean_turns))
    weights = zipf_weights(apps, zipf_s)
    conversations = []
    for i, at in enumerate(arrival_times(count, rate / mean_turns, rng)):
        turns = rng.randint(*TURNS)
        app = rng.choices(range(apps), weights=weights)[0]
        conversations.append(PlannedConversation(
            f"conversation-{i}", at, systems[app], tuple(question(rng) for _ in range(turns)),
            tuple(rng.expovariate(1.0 / think_mean_s) if think_mean_s > 0 else 0.0 for _ in range(turns))))
    return conversations


def plan(workload: str, num_requests: int, rate: float, seed: int = 0, tenants: int = 40,
         zipf_s: float = 1.1) -> list[PlannedChat]:
    """The named open-loop workload's requests; `tenants` is the number of tenants, or of open conversations for
    chats (`conversations` is closed-loop: plan_conversations)."""
    if workload == "tenants":
        return plan_tenants(num_requests, rate, seed, tenants, zipf_s=zipf_s)
    if workload == "chats":
        return plan_chats(num_requests, rate, seed, conversations=tenants)
    raise ValueError(f"unknown open-loop workload {workload!r}; use tenants or chats "
                     "(conversations is closed-loop: plan_conversations)")


def first_of_key_share(requests: list[PlannedChat]) -> float:
    """The fraction of requests that were their tenant's (or conversation's) first: misses under any policy."""
    return sum(r.first_of_key for r in requests) / len(requests) if requests else 0.0
