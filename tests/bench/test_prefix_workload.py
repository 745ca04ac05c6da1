"""The shared-prefix routing benchmark's workloads: seeded, distinct tenants, skewed popularity, resent history."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.prefix_workload import TURNS, first_of_key_share, plan, plan_chats, plan_conversations, plan_tenants


def test_tenants_plan_is_a_function_of_its_seed() -> None:
    assert plan_tenants(200, 2.0, seed=3) == plan_tenants(200, 2.0, seed=3)
    assert plan_tenants(200, 2.0, seed=3) != plan_tenants(200, 2.0, seed=4)


def test_each_tenant_has_one_long_system_prompt_distinct_from_its_first_characters() -> None:
    requests = plan_tenants(600, 5.0, tenants=40)
    systems: dict[str, set[str]] = {}
    for r in requests:
        assert [m["role"] for m in r.messages] == ["system", "user"]
        systems.setdefault(r.key, set()).add(r.messages[0]["content"])
        assert 12 <= len(r.messages[1]["content"].split()) <= 24
    assert len(systems) == 40 and all(len(texts) == 1 for texts in systems.values())
    prompts = [texts.pop() for texts in systems.values()]
    assert all(320 <= len(p.split()) <= 420 for p in prompts)
    assert len({p[:8] for p in prompts}) == 40


def test_popularity_is_skewed_and_the_primer_names_every_tenant_first() -> None:
    requests = plan_tenants(2000, 5.0, tenants=40)
    assert {r.key for r in requests[:40]} == {f"tenant-{t}" for t in range(40)}
    counts = Counter(r.key for r in requests[40:]).most_common()
    assert counts[0][1] > 10 * counts[len(counts) // 2][1]
    assert [r.first_of_key for r in requests] == [True] * 40 + [False] * 1960
    assert first_of_key_share(requests[40:]) == 0.0
    unprimed = plan_tenants(2000, 5.0, tenants=40, prime=False)
    assert 0 < first_of_key_share(unprimed) <= 40 / 2000


def test_arrivals_are_poisson_at_the_rate() -> None:
    times = [r.send_at for r in plan_tenants(4000, 4.0)]
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.1)


def test_chat_turns_resend_their_history() -> None:
    requests = plan_chats(500, 3.0, conversations=10, max_turns=5)
    last: dict[str, list] = {}
    for r in requests:
        assert r.messages[-1]["role"] == "user" and len(r.messages) <= 1 + 2 * 5
        previous = last.get(r.key)
        assert r.first_of_key == (previous is None)
        if previous is not None:
            assert r.messages[:len(previous)] == previous and r.messages[len(previous)]["role"] == "assistant"
        last[r.key] = r.messages
    assert len(last) > 500 / 5  # finished conversations were replaced by new ones


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown open-loop workload"):
        plan("documents", 10, 1.0)
    with pytest.raises(ValueError, match="closed-loop"):  # its turns depend on the model's answers
        plan("conversations", 10, 1.0)


def test_conversations_are_4_to_8_turns_on_a_few_apps_prompts_with_think_times() -> None:
    talks = plan_conversations(3000, 2.0, seed=5, apps=4, think_mean_s=3.0)
    assert talks == plan_conversations(3000, 2.0, seed=5, apps=4, think_mean_s=3.0)
    assert talks != plan_conversations(3000, 2.0, seed=6, apps=4, think_mean_s=3.0)
    assert sum(len(c.questions) for c in talks) == pytest.approx(3000, rel=0.1)
    assert all(TURNS[0] <= len(c.questions) == len(c.think_s) <= TURNS[1] for c in talks)
    apps = Counter(c.system for c in talks).most_common()
    assert len(apps) == 4 and apps[0][1] > apps[-1][1]  # shared system prompts, Zipf-popular
    assert all(290 <= len(system.split()) <= 400 for system, _ in apps)
    thinks = [t for c in talks for t in c.think_s]
    assert sum(thinks) / len(thinks) == pytest.approx(3.0, rel=0.1)
    starts = [c.start_at for c in talks]
    assert starts == sorted(starts)
    # conversations start at rate / mean turns, so their turns arrive at about `rate` while answers are quick
    assert len(talks) / starts[-1] == pytest.approx(2.0 / (sum(TURNS) / 2), rel=0.15)
    assert len({c.key for c in talks}) == len(talks)


@pytest.mark.parametrize("flags, says", [(["--apps", "0"], "--apps must be at least 1"),
                                         (["--think-s", "-1"], "--think-s must be 0 or more"),
                                         (["--think-s", "nan"], "--think-s must be 0 or more")])
def test_the_benchmark_refuses_a_conversation_setting_it_cannot_plan(flags, says, monkeypatch, capsys) -> None:
    from bench.prefix_routing import parse_args
    monkeypatch.setattr("sys.argv", ["prefix_routing", "--workload", "conversations", *flags])
    with pytest.raises(SystemExit) as refused:
        parse_args()
    assert refused.value.code == 2 and says in capsys.readouterr().err
