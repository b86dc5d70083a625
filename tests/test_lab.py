"""The throttled-network lab: set-up, a TCP exchange between two namespaces, shaping, teardown.

The namespace tests need root and a kernel that permits network namespaces; they skip otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lab  # noqa: E402


def _namespaces_permitted() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"{lab.NAME_PREFIX}-{os.getpid()}-probe"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


needs_netns = pytest.mark.skipif(not _namespaces_permitted(),
                                 reason="needs root and permission to create network namespaces")

# one worker listens, the other connects to worker 0's lab address and sends a line
_EXCHANGE = r"""
import os, socket, sys
rank, master = int(os.environ["RANK"]), os.environ["MASTER_ADDR"]
port = int(os.environ["MASTER_PORT"])
if rank == 0:
    srv = socket.create_server((master, port)); srv.settimeout(10)
    conn, _ = srv.accept(); data = conn.recv(100); conn.sendall(data.upper())
else:
    for _ in range(100):
        try:
            c = socket.create_connection((master, port), timeout=10); break
        except OSError:
            import time; time.sleep(0.05)
    c.sendall(b"hello from %d" % rank)
    assert c.recv(100) == b"HELLO FROM %d" % rank
"""


def test_parse_rate():
    assert lab.parse_rate("100mbit") == 100e6
    assert lab.parse_rate("1gbit") == 1e9
    assert lab.parse_rate("12.5MB/s") == 100e6
    assert lab.parse_rate("none") is None and lab.parse_rate(None) is None
    with pytest.raises(ValueError, match="rate"):
        lab.parse_rate("fast")


def test_burst_follows_the_documented_sizes():
    assert lab.tbf_burst_bytes(100e6) == 256 * 1024
    assert lab.tbf_burst_bytes(1e9) == 1_000_000


def test_bad_worker_count_is_named():
    with pytest.raises(ValueError, match="workers"):
        lab.Lab(0)


def test_not_root_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(lab.LabError, match="root"):
        with lab.Lab(2):
            pass


@needs_netns
def test_two_workers_exchange_and_teardown_leaves_nothing():
    with lab.Lab(2, rate="100mbit", master_port=29611) as the_lab:
        names = set(the_lab.namespaces + [the_lab.bridge_ns])
        assert names <= set(lab.list_lab_namespaces())
        qdisc = subprocess.run(["ip", "netns", "exec", the_lab.namespaces[1], "tc", "qdisc",
                                "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        the_lab.set_rate("1gbit")
        qdisc = subprocess.run(["ip", "netns", "exec", the_lab.namespaces[1], "tc", "qdisc",
                                "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "1Gbit" in qdisc
        the_lab.set_rate(None, ranks=[0])
        assert the_lab.rates_bps == [None, 1e9]
        with pytest.raises(ValueError, match="ranks"):
            the_lab.set_rate("1gbit", ranks=[2])
        codes = the_lab.run([sys.executable, "-c", _EXCHANGE], timeout=30)
        assert codes == [0, 0]
    assert not names & set(lab.list_lab_namespaces())


@needs_netns
def test_host_interfaces_are_untouched():
    before = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    with lab.Lab(2):
        during = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert before == during


@needs_netns
def test_error_inside_the_block_still_tears_down():
    with pytest.raises(RuntimeError, match="boom"):
        with lab.Lab(2) as the_lab:
            names = set(the_lab.namespaces + [the_lab.bridge_ns])
            the_lab.start(["sleep", "30"])
            raise RuntimeError("boom")
    assert not names & set(lab.list_lab_namespaces())


@needs_netns
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_killed_lab_process_tears_down(sig):
    import signal
    import time

    script = Path(lab.__file__)
    proc = subprocess.Popen([sys.executable, str(script), "--workers", "2", "--rate", "100mbit",
                             "--", "sleep", "30"], stderr=subprocess.PIPE)
    mine = f"{lab.NAME_PREFIX}-{proc.pid}-"
    deadline = time.monotonic() + 15
    while sum(n.startswith(mine) for n in lab.list_lab_namespaces()) < 3:
        assert time.monotonic() < deadline, "lab did not come up"
        time.sleep(0.05)
    time.sleep(0.3)  # let the workers start
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=15) == 130
    assert not [n for n in lab.list_lab_namespaces() if n.startswith(mine)]


@needs_netns
def test_cleanup_removes_namespaces_of_dead_labs_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{lab.NAME_PREFIX}-{dead.pid}-0-w0"
    alive = f"{lab.NAME_PREFIX}-{os.getpid()}-0-w0"
    for name in (leftover, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert leftover in lab.cleanup()
        assert alive in lab.list_lab_namespaces()
    finally:
        lab.delete_namespaces([alive])
    assert leftover not in lab.list_lab_namespaces() and alive not in lab.list_lab_namespaces()


# Imports every bench script as a module and asks each argparse main for --help, in one process (one torch import).
_BENCH_HELP = r"""
import contextlib, importlib.util, inspect, io, json, sys, traceback
from pathlib import Path
bench = Path(sys.argv[1])
sys.path.insert(0, str(bench))
report = {}
for path in sorted(bench.glob("*.py")):
    try:
        spec = importlib.util.spec_from_file_location("bench_" + path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main = getattr(module, "main", None)
        if main is None or "ArgumentParser" not in inspect.getsource(main):
            report[path.name] = "imported"
            continue
        sys.argv, shown = [str(path), "--help"], io.StringIO()
        with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
            main()
        report[path.name] = "help" if shown.getvalue().startswith("usage:") else "no help: " + shown.getvalue()[-300:]
    except BaseException:
        report[path.name] = traceback.format_exc(limit=-3)
print(json.dumps(report))
"""


def test_every_bench_script_imports_and_answers_help():
    """Benches run by hand, not by the suite: a syntax newer than this Python, an import of something moved
    out of netgain, or a broken option would otherwise surface only when someone reruns them."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    run = subprocess.run([sys.executable, "-c", _BENCH_HELP, str(bench)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert sorted(report) == sorted(p.name for p in bench.glob("*.py"))
    broken = {name: outcome for name, outcome in report.items() if outcome not in ("help", "imported")}
    assert not broken, broken
    # the scripts a user runs all take options; only the helpers (and plan_bench, which takes none) are imported
    assert {name for name, outcome in report.items() if outcome == "imported"} == {
        "gac_models.py", "plan_bench.py", "provenance.py", "runs.py"}


def test_bench_readme_lists_every_script():
    bench = Path(__file__).resolve().parents[1] / "bench"
    readme = (bench / "README.md").read_text()
    assert [p.name for p in sorted(bench.glob("*.[ps][yh]")) if f"`{p.name}`" not in readme] == []


def test_time_to_accuracy_reads_its_curves():
    """The target's crossing and the loss at a time budget, interpolated between validations (step, seconds, loss);
    none where the curve never gets there."""
    import time_to_accuracy as tta

    curve = [(0, 0.0, 5.0), (10, 2.0, 3.0), (20, 4.0, 2.0)]
    assert tta.crossing(curve, 4.0) == (5.0, 1.0) and tta.crossing(curve, 1.0) is None
    assert tta.loss_at(curve, 1.0) == 4.0 and tta.loss_at(curve, 4.0) == 2.0 and tta.loss_at(curve, 0.5) == 4.5
    assert tta.loss_at(curve, 4.5) is None and tta.loss_at(curve[:1], 0.5) is None and tta.loss_at([], 1.0) is None
