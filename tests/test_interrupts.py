"""A Ctrl-C whose KeyboardInterrupt Python swallows still stops the run. The handler raises
KeyboardInterrupt wherever the main thread is; inside a finalizer (a `__del__`, as in Ray's and
grpc's objects during start-up) Python prints "Exception ignored ..." and carries on: 1 in 5 Ctrl-Cs
during Ray's start were lost this way. The signal is recorded, and the run's next safe point
(`session.check_interrupted`, after Ray's start and between steps) raises it again."""

import gc
import os
import signal
import sys
import time

import pytest

from moe_rl.driver import session


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    session.INTERRUPTED.clear()
    yield
    session.INTERRUPTED.clear()
    for s, h in saved.items():
        signal.signal(s, h)


class SignalledWhileFinalized:
    """An object whose finalizer is running when the signal arrives."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)
        time.sleep(0.5)  # the handler runs here; its KeyboardInterrupt cannot leave a finalizer


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_interrupt_stops_the_run_at_the_next_safe_point(handlers, signum, monkeypatch):
    swallowed = []  # what Python reports as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    session.handle_signals()
    session.check_interrupted()  # nothing received: a safe point passes
    obj = SignalledWhileFinalized(signum)
    del obj
    gc.collect()
    assert swallowed == [KeyboardInterrupt]
    assert session.INTERRUPTED == [signum]
    with pytest.raises(KeyboardInterrupt):
        session.check_interrupted()
