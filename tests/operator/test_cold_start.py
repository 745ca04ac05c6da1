"""The fleet's cold start from its pods' timestamps (operator/cold_start.py): creation to Ready, the figure the
autoscaler plans with, and the samples kept in status across operator restarts."""

from __future__ import annotations

import datetime

from kvfleet.operator.cold_start import KEEP, add_starts, cold_start_figure, cold_start_status, pod_start, saved_samples

T0 = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC)


def pod(uid: str, ready_after_s: float | None, restarts: int = 0, as_text: bool = False) -> dict:
    """A pod as the API returns it: created at T0, Ready `ready_after_s` later (None: not Ready yet)."""
    def stamp(t: datetime.datetime):
        return t.strftime("%Y-%m-%dT%H:%M:%SZ") if as_text else t
    ready = ({"type": "Ready", "status": "False"} if ready_after_s is None else
             {"type": "Ready", "status": "True",
              "lastTransitionTime": stamp(T0 + datetime.timedelta(seconds=ready_after_s))})
    return {"metadata": {"uid": uid, "name": f"engine-{uid}", "creationTimestamp": stamp(T0)},
            "status": {"conditions": [{"type": "PodScheduled", "status": "True"}, ready],
                       "containerStatuses": [{"name": "engine", "restartCount": restarts}]}}


def test_a_ready_pod_gives_its_creation_to_ready_time() -> None:
    assert pod_start(pod("a", 42)) == ("a", 42.0)
    assert pod_start(pod("b", 7, as_text=True)) == ("b", 7.0)  # RFC 3339 text, as in a raw watch event
    assert pod_start(pod("c", None)) is None  # not ready yet
    assert pod_start(pod("d", 42, restarts=1)) is None  # Ready again after a crash: not a start
    assert pod_start({"metadata": {"uid": "e"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                     ) is None  # no timestamps (KMock's test pods)


def test_the_figure_is_a_high_percentile_of_the_last_starts() -> None:
    samples = add_starts([], [pod(str(i), 10 + i) for i in range(10)])
    assert cold_start_figure(samples) == 18.0  # 90th percentile of 10..19 (nearest rank), not the mean
    assert cold_start_figure([]) is None
    again = add_starts(samples, [pod("3", 500), pod("new", 30)])  # a pod seen before is not counted twice
    assert [k for k, _ in again][-2:] == ["9", "new"] and len(again) == 11
    many = add_starts(again, [pod(f"x{i}", 60) for i in range(30)])
    assert len(many) == KEEP and cold_start_figure(many) == 60.0  # the last KEEP starts only


def test_the_samples_survive_the_status_round_trip_and_garbage_is_dropped() -> None:
    samples = add_starts([], [pod("a", 12.5), pod("b", 31)])
    assert saved_samples(cold_start_status(samples)) == samples
    hostile = {"samples": [{"pod": "a", "seconds": 12.5}, {"pod": "b", "seconds": "NaN"}, {"pod": 3, "seconds": 1},
                           {"seconds": 4}, ["c", 5], {"pod": "d", "seconds": -1}, {"pod": "e", "seconds": 1e9}]}
    assert saved_samples(hostile) == [("a", 12.5)]
    assert saved_samples(None) == [] and saved_samples("x") == [] and saved_samples({"samples": 5}) == []
