"""The restart policy of a service's replicas (services/keeper/restarts.py): pure rules, then the options and profile
keys that set it (one ``pbstk: error:`` line, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MODEL, pbstk
from test_service import svc_profile  # noqa: F401  (fixture)

from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.services.keeper import restarts
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.state import service_state

POLICY = restarts.RestartPolicy(max_restarts=2, window_s=100.0, backoff_s=10.0)


def test_a_failure_waits_its_backoff_doubling_then_the_slot_gives_up_with_the_cause() -> None:
    slot = Slot(0, current="j1")
    assert restarts.judge(POLICY, slot, "j1", "j1 FAILED: boom", now=1000.0) == restarts.WAIT
    assert slot.retry_at == 1010.0 and slot.last_failure == "j1 FAILED: boom"
    assert restarts.judge(POLICY, slot, "j1", "j1 FAILED: boom", now=1009.0) == restarts.WAIT  # noted once
    assert restarts.judge(POLICY, slot, "j1", "j1 FAILED: boom", now=1010.0) == restarts.RESTART
    restarts.restarted(slot, now=1010.0)
    assert restarts.judge(POLICY, slot, "j2", "j2 FAILED: boom", now=1020.0) == restarts.WAIT
    assert slot.retry_at == 1040.0  # one restart in the window: 10 s doubled
    restarts.restarted(slot, now=1040.0)
    assert restarts.judge(POLICY, slot, "j3", "j3 FAILED: oom", now=1050.0) == restarts.STOP
    assert slot.restarts == 2 and "not restarted after 2 restart(s)" in slot.gave_up and "j3 FAILED: oom" in \
        slot.gave_up
    assert restarts.judge(POLICY, slot, "j3", "j3 FAILED: oom", now=5000.0) == restarts.STOP  # for good


def test_restarts_older_than_the_window_do_not_count() -> None:
    slot = Slot(0, restarts=2, restart_times=[0.0, 10.0])
    assert restarts.judge(POLICY, slot, "j3", "j3 FAILED", now=105.0) == restarts.WAIT  # the first has left
    assert slot.restart_times == [10.0] and slot.retry_at == 125.0 and not slot.gave_up


def test_no_restart_at_all_and_a_backoff_capped() -> None:
    never = restarts.RestartPolicy(max_restarts=0)
    slot = Slot(0)
    assert restarts.judge(never, slot, "j1", "j1 FAILED", now=1.0) == restarts.STOP
    assert restarts.RestartPolicy(backoff_s=10.0).delay(20) == restarts.MAX_BACKOFF_S


def test_a_service_short_of_a_replica_for_good_is_degraded_or_down_never_starting() -> None:
    rec = ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=2, request={},
                        slots=[Slot(0), Slot(1, gave_up="not restarted after 3 restart(s) ...")])
    assert service_state(rec, 0, starting=True) == "DOWN"
    assert service_state(rec, 1, starting=True) == "DEGRADED"
    assert restarts.reason(rec) == "replica r1 not restarted after 3 restart(s) ..."
    rec.slots[1].retiring = True  # a slot being scaled away is no failure
    assert service_state(rec, 0, starting=True) == "STARTING" and restarts.reason(rec) is None


@pytest.mark.parametrize(("args", "words"), [
    (("--max-restarts", "-1"), "--max-restarts"),
    (("--restart-window", "soon"), "--restart-window 'soon'"),
    (("--restart-backoff", "0"), "--restart-backoff '0'"),
])
def test_a_bad_restart_option_is_one_error_line_and_starts_nothing(svc_profile: str,  # noqa: F811
                                                                   args: tuple[str, ...], words: str) -> None:
    result = pbstk("serve", MODEL, "--profile", svc_profile, "--preset", "single", "--name", "bad", *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("pbstk: error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert JobStore().service_rows() == [] and JobStore().all() == []


def test_a_bad_profile_restart_key_names_the_key(isolated_user: Path) -> None:
    from pbs_toolkit.settings.profiles import load_profile

    profiles = isolated_user / "config" / "pbstk" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "r.yaml").write_text("name: r\nscheduler: local\nmax_restarts: many\n")
    with pytest.raises(Exception, match="max_restarts"):
        load_profile("r")
    (profiles / "r.yaml").write_text("name: r\nscheduler: local\nrestart_window: soon\n")
    with pytest.raises(Exception, match="restart_window"):
        load_profile("r")


def test_the_policy_from_values_refuses_a_bad_count() -> None:
    with pytest.raises(UsageError, match="--max-restarts"):
        restarts.policy(True, "30m", "10s")
    assert restarts.policy(0, "1h", "5s") == restarts.RestartPolicy(0, 3600.0, 5.0)


def test_only_a_slot_still_waiting_for_its_replacement_brings_the_next_tick_forward() -> None:
    rec = ServiceRecord(name="s", model="m", served_model_name="m", profile="p", replicas=3, request={}, slots=[
        Slot(0, current="j1", failed_job="j1", retry_at=50.0),  # waiting out its backoff
        Slot(1, current="j5", failed_job="j2", retry_at=20.0),  # a successor took the slot meanwhile
        Slot(2, current="j3", failed_job="j3", retry_at=10.0, gave_up="no more")])
    assert restarts.next_due(rec) == 50.0
