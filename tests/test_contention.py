"""CpuWatch: other processes' share of the machine while timing, and the warning it gives."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_trt import contention
from dflash_trt.contention import CpuWatch, contention_warning


def _fake(monkeypatch, *snaps):
    it = iter(snaps)
    monkeypatch.setattr(contention, "_snapshot", lambda: next(it))


def test_share_is_machine_busy_minus_own_time_over_capacity(monkeypatch):
    # 2 s wall on 2 cores = 4 CPU-s of capacity; machine busy 3 CPU-s, 1 of them ours -> others 2 -> 50%
    _fake(monkeypatch, (100.0, 10.0, 5.0), (103.0, 11.0, 7.0))
    with CpuWatch(cpus=2) as w:
        pass
    assert w.others_share == pytest.approx(0.5)
    assert "50%" in contention_warning(w.others_share) and "not reliable" in contention_warning(w.others_share)
    _fake(monkeypatch, (100.0, 10.0, 5.0), (102.0, 11.0, 7.0))  # others 1 CPU-s of 4: at the threshold, quiet
    with CpuWatch(cpus=2) as w:
        pass
    assert w.others_share == pytest.approx(contention.WARN_SHARE) and contention_warning(w.others_share) is None
    _fake(monkeypatch, (100.0, 10.0, 5.0), (100.5, 11.0, 7.0))  # own time counted at a coarser tick: not < 0
    with CpuWatch(cpus=2) as w:
        pass
    assert w.others_share == 0.0


def test_no_proc_stat_means_no_figure_and_no_warning(monkeypatch):
    monkeypatch.setattr(contention, "_machine_busy_s", lambda: None)
    with CpuWatch() as w:
        time.sleep(0.01)
    assert w.others_share is None and contention_warning(None) is None


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="CpuWatch reads /proc/stat (Linux)")
def test_a_busy_child_counts_and_our_own_work_does_not():
    with CpuWatch() as idle:
        time.sleep(0.5)
    if idle.others_share > 0.1:
        pytest.skip(f"the machine is already busy ({idle.others_share:.0%} of it): nothing to compare against")
    cpus = CpuWatch().cpus
    with CpuWatch() as own:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:  # one core busy, in this process
            pass
    assert own.others_share < idle.others_share + 0.4 / cpus
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.2)  # the child is running
        with CpuWatch() as busy:
            time.sleep(1.0)
    finally:
        child.wait()
    assert busy.others_share > idle.others_share + 0.6 / cpus  # one core of `cpus`, minus scheduling slack


def test_children_count_as_our_own_time(monkeypatch):
    # a server we started and waited for used 1.5 of the 3 busy CPU-s: others 0.5 of 4 -> 12.5%
    _fake(monkeypatch, (100.0, 10.0, 5.0), (103.0, 11.0, 7.0))
    kids = iter([2.0, 3.5])
    monkeypatch.setattr(contention, "_children_s", lambda: next(kids))
    with CpuWatch(cpus=2, children=True) as w:
        pass
    assert w.others_share == pytest.approx(0.125)
