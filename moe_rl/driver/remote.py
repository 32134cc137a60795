"""Remote calls as the driver waits on them: `gather` (results in order; a dead actor or a call past its
timeout named with what it was doing), the errors that mean a process of the run died, and the count of
the driver's waits (`round_trips`)."""

from __future__ import annotations

import time

import ray

_round_trips = 0  # the driver's waits on remote calls (`gather`)


class RemoteCallError(RuntimeError):
    """A remote call that did not answer in time, or whose actor died; the message names both."""


class RayStartError(RuntimeError):
    """Ray did not come up (a local Ray whose processes did not start in time on a loaded machine, a cluster
    that did not answer): a fault a later try may get past, like a process that died."""


def last_line(err: BaseException) -> str:
    """An error's last non-empty line (a remote error's own message), or its type's name."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def fault_line(err: BaseException) -> str | None:
    """One line for an error that means a process of the run died or hung: RemoteCallError, RayStartError,
    or a remote call that failed because a process it worked with died (a peer rank, an engine); None
    otherwise."""
    if isinstance(err, (RemoteCallError, RayStartError)):
        return str(err)
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    if isinstance(cause, LOST):
        return f"a remote call failed because a process it worked with died ({last_line(cause)})"
    return None


def round_trips() -> int:
    """How many times this process has waited on remote calls so far: one per `gather`, whose calls
    travel together (the loop logs the count from one step's log to the next, timing/round_trips: a
    checkpoint or an evaluation between two steps counts in the later one)."""
    return _round_trips


def gather(calls: list[tuple[str, object]], timeout_s: float, retry=None,
           setting: str = "cluster.call_timeout_s") -> list:
    """The results of remote calls [(label, ref)], in order. The wait ends at the first call whose actor
    died (a rank's peers may be blocked in a collective with it) or once `timeout_s` has passed with a
    call unanswered: RemoteCallError names the actor and what it was doing (`label`). An exception the
    call raised itself comes back as Ray raises it (an instance of its own type).

    `retry(index, err)`, where given, is asked first about a call that failed (its actor lost, or the
    call raised): it returns a new ref to wait on instead (the call submitted again, with `timeout_s`
    from now), or None to fail as above. `setting`: the config field `timeout_s` comes from (named by the
    error)."""
    global _round_trips
    _round_trips += 1
    labels = {ref: (i, label) for i, (label, ref) in enumerate(calls)}
    pending, results, deadline = [ref for _, ref in calls], {}, time.monotonic() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise RemoteCallError(f"no answer within {setting}={timeout_s:g} s from "
                                  f"{', '.join(labels[r][1] for r in pending)}")
        i, label = labels[done[0]]
        try:
            results[i] = ray.get(done[0])
            continue
        # the call itself raised (also when something it waited on died)
        except ray.exceptions.RayTaskError as err:
            if retry is None or (again := retry(i, err)) is None:
                dead = _dead_peer(pending, labels)
                if dead is not None:  # e.g. a rank's collective broke because its peer died: name the peer
                    raise dead from err
                raise
        except LOST as err:
            what = "is unreachable" if isinstance(err, ray.exceptions.ActorUnavailableError) else "died"
            failure = RemoteCallError(f"{label}: the actor {what} ({last_line(err)})")
            if retry is None or (again := retry(i, failure)) is None:
                raise failure from err
        labels[again] = (i, label)
        pending.append(again)
        deadline = max(deadline, time.monotonic() + timeout_s)
    return [results[i] for i in range(len(calls))]


def _dead_peer(pending: list, labels: dict, grace_s: float = 5.0) -> RemoteCallError | None:
    """After a call raised: whether one of the calls still pending lost its actor within `grace_s`
    (Ray notices a death within about a second). A rank's error is often the consequence of a peer's
    death (its collective broke): then the dead peer is the fault to report."""
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except LOST as err:
            return RemoteCallError(f"{labels[ref][1]}: the actor died ({last_line(err)})")
        except Exception:
            continue
    return None


# a call's process gone (crashed, killed for memory, never started) or its result lost with a node
LOST = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, ray.exceptions.ActorUnschedulableError,
         ray.exceptions.RuntimeEnvSetupError, ray.exceptions.ObjectLostError)

