"""The driver's waits on remote calls (remote.gather) with real Ray actors: an actor that dies ends the
wait at once, naming it, while its peer still hangs (as ranks blocked in a collective would); a call
past the timeout names every actor still silent; an error a call raises keeps its own type."""

import os
import time

import pytest
import ray

from moe_rl.driver.remote import RemoteCallError, gather

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Rank:
    def work(self, seconds: float, die: bool = False, fail: bool = False):
        time.sleep(seconds)
        if die:
            os._exit(1)
        if fail:
            raise KeyError("a bad batch")
        return seconds


def test_a_dead_rank_ends_the_wait_at_once_and_is_named(cluster):
    a, b = Rank.remote(), Rank.remote()
    t0 = time.monotonic()
    with pytest.raises(RemoteCallError, match=r"^policy rank 1 \(train\): the actor died"):
        gather([("policy rank 0 (train)", a.work.remote(60)),
                ("policy rank 1 (train)", b.work.remote(0, die=True))], 120)
    assert time.monotonic() - t0 < 30  # not the 60 s rank 0 stays blocked


def test_silence_past_the_timeout_names_who(cluster):
    a, b = Rank.remote(), Rank.remote()
    ray.get([a.work.remote(0), b.work.remote(0)])  # both started (on a busy machine that takes seconds)
    with pytest.raises(RemoteCallError,
                       match=r"^no answer within cluster.call_timeout_s=1 s from engine 1 \(rollout\)$"):
        gather([("engine 0 (rollout)", a.work.remote(0)), ("engine 1 (rollout)", b.work.remote(30))], 1.0)
    assert gather([("engine 0 (rollout)", a.work.remote(0.1))], 10) == [0.1]
    # a start-up is waited on by its own setting (the driver's: cluster.start_timeout_s), and named so
    with pytest.raises(RemoteCallError,
                       match=r"^no answer within cluster.start_timeout_s=1 s from policy rank 0 \(start\)$"):
        gather([("policy rank 0 (start)", b.work.remote(0))], 1.0, setting="cluster.start_timeout_s")


def test_an_error_raised_by_the_call_keeps_its_type(cluster):
    with pytest.raises(KeyError, match="a bad batch"):
        gather([("critic rank 0 (load)", Rank.remote().work.remote(0, fail=True))], 30)


def test_retry_replaces_a_failed_call_and_keeps_the_order(cluster):
    """gather's retry hook (driver/rollout_manager.py replaces a failed engine this way): asked about the
    dead call and the call that raised, with the error each got; the new refs' results land in their
    places."""
    asked = []

    def retry(index, err):
        asked.append((index, type(err).__name__ if isinstance(err, RemoteCallError) else "raised"))
        return Rank.remote().work.remote(index / 10)

    calls = [("engine 0 (rollout)", Rank.remote().work.remote(0)),
             ("engine 1 (rollout)", Rank.remote().work.remote(0, die=True)),
             ("engine 2 (rollout)", Rank.remote().work.remote(0, fail=True))]
    assert gather(calls, 60, retry) == [0, 0.1, 0.2]
    assert sorted(asked) == [(1, "RemoteCallError"), (2, "raised")]
    with pytest.raises(RemoteCallError, match=r"^engine 0 \(rollout\): the actor died"):
        gather([("engine 0 (rollout)", Rank.remote().work.remote(0, die=True))], 60, lambda i, err: None)


def test_fault_line_tells_faults_from_bugs(cluster):
    """What `moe-rl train` exits 3 for: a RemoteCallError, or a call that failed because an actor it
    waited on died; anything else (a bug, a bad batch) is not a fault."""
    from moe_rl.driver.remote import fault_line

    @ray.remote(num_cpus=0)
    def waits_on(ref_list):
        return ray.get(ref_list[0])

    dead = Rank.remote().work.remote(0, die=True)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(waits_on.remote([dead]), timeout=60)
    assert fault_line(info.value).startswith("a remote call failed because a process it worked with died")
    assert fault_line(RemoteCallError("engine 0 (rollout): the actor died (x)")) == ("engine 0 (rollout): "
                                                                                     "the actor died (x)")
    with pytest.raises(KeyError) as bug:
        gather([("critic rank 0 (load)", Rank.remote().work.remote(0, fail=True))], 30)
    assert fault_line(bug.value) is None and fault_line(ValueError("x")) is None


def test_a_peer_error_caused_by_a_dead_rank_names_the_dead_rank(cluster):
    """Rank 0's call fails first (its collective broke: here it raises at once) while rank 1's process
    is dying: the wait names rank 1's death, the fault, not rank 0's consequence."""
    a, b = Rank.remote(), Rank.remote()
    with pytest.raises(RemoteCallError, match=r"^policy rank 1 \(train\): the actor died"):
        gather([("policy rank 0 (train)", a.work.remote(0, fail=True)),
                ("policy rank 1 (train)", b.work.remote(0.5, die=True))],
               120)
