"""``actorflow launch``: mpiexec's argv, rank prefixes, exit statuses, Ctrl-C and cleanup.

The runs are real (mpich's hydra, forked on this machine over loopback) with plain
Python ranks that print, exit or sleep; hydra gives each its rank in PMI_RANK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actorflow import launch as launch_module
from actorflow.launch import _Demux, _HydraText, exit_status, find_mpiexec, mpiexec_command
from actorflow.world import RANK_CPUS, cpu_shares, cpus_of, listed_cpus, shares_listed
from test_cli import run_cli

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.xdist_group("mpi")  # one mpiexec at a time: two at once fail in MPI_Comm_dup
needs_mpiexec = pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec: pip install mpi4py mpich")

RANK = """
import os, signal, sys, time
rank = int(os.environ["PMI_RANK"])
mode = sys.argv[1]
if mode == "lines":
    print(f"out {rank} a")  # the text and the newline in two writes (PYTHONUNBUFFERED)
    os.write(1, f"out {rank} b".encode())
    time.sleep(0.05)
    os.write(1, b" end\\n")
    print(f"err {rank}", file=sys.stderr)
elif mode == "exit":
    code = sys.argv[2 + rank]
    if code == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(code))
elif mode == "sleep":
    if rank == 1:  # a rank that does not stop when asked
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(30)
"""


@pytest.fixture
def rank_script(tmp_path: Path) -> str:
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return str(path)


def start(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``actorflow launch ARGV`` from this checkout, with stdout and stderr piped."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "actorflow.cli", "launch", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def descendants(root: int) -> dict[int, str]:
    """pid -> name of every process below ``root``, from /proc."""
    parents, names = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        names[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found, new = set(), {root}
    while new:
        found |= new
        new = {pid for pid, ppid in parents.items() if ppid in new} - found
    return {pid: names[pid] for pid in found - {root}}


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie waiting for init to reap it does not."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(10)
def test_the_command_keeps_to_loopback_by_default():
    argv, env = mpiexec_command(2, ["python3", "x.py"], mpiexec="/bin/mpiexec", environ={"PATH": "/bin"})
    assert argv[:7] == ["/bin/mpiexec", "-launcher", "fork", "-iface", "lo", "-host", "localhost"]
    assert "-disable-auto-cleanup" in argv
    assert argv[-4:] == ["-n", "2", "python3", "x.py"]
    shares = listed_cpus(cpu_shares(sorted(os.sched_getaffinity(0)), 2))
    assert env == {"PATH": "/bin", "UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo", RANK_CPUS: shares}
    _, env = mpiexec_command(2, ["x"], environ={"UCX_TLS": "tcp"})
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "lo"


@pytest.mark.timeout(10)
def test_local_ranks_get_their_share_of_the_cpus_unless_told_otherwise():
    _, env = mpiexec_command(3, ["x"], environ={})
    listed = [cpus_of(share) for share in shares_listed(env[RANK_CPUS])]
    cpus = os.sched_getaffinity(0)
    assert len(listed) == 3 and set().union(*listed) == cpus
    if len(cpus) >= 3:  # disjoint where there is a CPU for each
        assert sum(map(len, listed)) == len(cpus)
    assert mpiexec_command(2, ["x"], environ={RANK_CPUS: ""})[1][RANK_CPUS] == ""
    assert RANK_CPUS not in mpiexec_command(2, ["x"], extra=["-bind-to", "core"], environ={})[1]


@pytest.mark.timeout(10)
def test_cpus_are_shared_out_in_even_blocks_or_in_turn():
    assert cpu_shares([0, 1], 2) == [[0], [1]]
    assert cpu_shares([0, 1], 4) == [[0], [1], [0], [1]]
    assert cpu_shares(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert cpu_shares([2, 5, 7], 1) == [[2, 5, 7]]


BINDING = """
import os, threading
from actorflow.runtime.mpi_world import mpi
before = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
before.start()  # a thread started before MPI is bound too
mpi()
print("cpus", os.environ["PMI_RANK"], sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(before.native_id)))
"""


@needs_mpiexec
@pytest.mark.timeout(30)
def test_each_rank_binds_every_thread_to_its_share(tmp_path):
    script = tmp_path / "binding.py"
    script.write_text(BINDING)
    unset = {k: v for k, v in os.environ.items() if k != RANK_CPUS}  # the launcher's default
    proc = start("-n", "2", "--", sys.executable, str(script), env=unset)
    out, err = proc.communicate(timeout=25)
    assert proc.returncode == 0, out + err
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), 2)
    got = sorted(line.split(" ", 1)[1] for line in out.splitlines() if " cpus " in f" {line}")
    assert got == [f"cpus {rank} {share} {share}" for rank, share in enumerate(shares)], out


@needs_mpiexec
@pytest.mark.timeout(30)
def test_a_bad_cpu_list_stops_the_rank_with_what_to_give(tmp_path):
    proc = start(
        "-n",
        "2",
        "--",
        sys.executable,
        "-c",
        "from actorflow.runtime.mpi_world import mpi; mpi()",
        env={**os.environ, RANK_CPUS: "x;x"},  # both fail before MPI starts: none waits in its start
    )
    out, err = proc.communicate(timeout=25)
    assert proc.returncode == 1, out + err
    assert "ACTORFLOW_RANK_CPUS='x;x': rank 1 cannot bind to CPUs 'x'" in err and "0,1;2,3" in err


@pytest.mark.timeout(10)
def test_a_hostfile_drops_the_loopback_defaults():
    argv, env = mpiexec_command(
        4, ["actorflow", "run", "c.yaml"], hostfile="hosts", extra=["-verbose"], environ={"PATH": "/bin"}
    )
    assert argv[1:3] == ["-f", "hosts"]
    assert not {"-launcher", "-iface", "-host"} & set(argv)
    assert argv[-6:] == ["-verbose", "-n", "4", "actorflow", "run", "c.yaml"]
    assert env == {"PATH": "/bin"}
    with pytest.raises(ValueError):
        mpiexec_command(0, ["x"])


@pytest.mark.timeout(10)
def test_the_exit_status_is_the_worst_ranks():
    def exited(code: int) -> int:
        return code << 8

    assert exit_status([exited(0), exited(0)]) == 0
    assert exit_status([exited(5), exited(200), exited(3)]) == 200  # hydra's own: 5 | 200 | 3 = 207
    assert exit_status([exited(3), signal.SIGKILL]) == 137
    # a peer's SIGUSR1 (hydra: "a rank died") counts only when nothing else failed
    assert exit_status([exited(3), signal.SIGUSR1]) == 3
    assert exit_status([signal.SIGUSR1]) == 128 + signal.SIGUSR1
    # after Ctrl-C the deaths it causes are not worse than it; a crash is
    assert exit_status([signal.SIGINT, signal.SIGKILL], signal.SIGINT) == 130  # hydra's own: 2 | 9 = 11
    assert exit_status([exited(1)], signal.SIGTERM) == 143
    assert exit_status([signal.SIGSEGV, signal.SIGKILL], signal.SIGINT) == 139


@pytest.mark.timeout(10)
def test_lines_are_rebuilt_per_rank_from_hydras_chunks():
    demux = _Demux()
    stream = (
        b"\x1f0\x1eout 0 a"  # rank 0 writes its text ...
        b"\x1f1\x1eout 1 a\n\x1f1\x1eout 1 b\n"  # ... rank 1 two lines in one chunk ...
        b"\x1f0\x1e\n"  # ... then rank 0 its newline
        b"\x1f0\x1e\r 10%\x1f0\x1e\r 20%\r 30%\x1f0\x1e\r"  # a progress bar redrawn
        b"\x1f1\x1eno newline[mpiexec@vm] Exit codes: [localhost] 0,0\n"
    )
    lines = [line for i in range(0, len(stream), 5) for line in demux.feed(stream[i : i + 5])]
    lines += demux.close()
    assert lines == [
        (1, b"out 1 a\n"),
        (1, b"out 1 b\n"),
        (0, b"out 0 a\n"),
        (0, b"\r"),
        (0, b" 10%\r"),
        (0, b" 20%\r"),
        (0, b" 30%\r"),
        (None, b"[mpiexec@vm] Exit codes: [localhost] 0,0\n"),
        (1, b"no newline\n"),
    ]


@pytest.mark.timeout(10)
def test_hydras_exit_codes_are_read_and_its_banner_and_ctrl_c_notes_dropped():
    lines = [  # as hydra wrote them for -hosts localhost:1,127.0.0.1:2 and ranks exiting 0, 3, SIGKILL
        b"[mpiexec@vm] Sending Ctrl-C to processes as requested\n",
        b"[mpiexec@vm] Exit codes: [localhost] 0\n",
        b"[127.0.0.1] 768,9\n",
        b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n",
        b"This typically refers to a problem with your application.\n",
        b"Please see the FAQ page for debugging suggestions\n",
    ]
    text = _HydraText()
    assert [text.line(line) for line in lines] == [None] * 6
    assert text.hosts == [("localhost", [0]), ("127.0.0.1", [768, 9])]
    assert launch_module._failures(text.hosts, None) == (
        "a rank on 127.0.0.1 exited with status 3; a rank on 127.0.0.1 was killed by SIGKILL (signal 9)"
    )


def test_the_rank_that_ended_first_by_a_signal_is_named_and_the_others_stopped_after_it():
    hosts = [("localhost", [9, 9, 1 << 8])]
    assert launch_module._failures(hosts, None, first=1) == (
        "rank 1 was killed by SIGKILL (signal 9) first; the others stopped after it: "
        "rank 0 (killed by SIGKILL (signal 9)), rank 2 (exited with status 1)"
    )
    assert launch_module._failures(hosts, None, first=None) == (
        "rank 0 was killed by SIGKILL (signal 9); rank 1 was killed by SIGKILL (signal 9); rank 2 exited with status 1"
    )
    assert launch_module._failures([("localhost", [1 << 8, 9])], None, first=0) == (
        "rank 0 exited with status 1; rank 1 was killed by SIGKILL (signal 9)"
    )


DIES = """
import os, signal, time
time.sleep(max(0.0, float(os.environ["AT"]) - time.time()))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(20)
def test_the_first_rank_to_end_is_known_even_when_the_watcher_wakes_after_both_ended():
    """Hydra kills the survivors of a killed rank within milliseconds: on a busy machine
    the watcher may not look in between. Here it does not: this process holds the GIL (a
    switch interval of 10 s) while rank 1 ends, then rank 0 100 ms later, and the watcher,
    told of a third rank that never starts, keeps looking for it every 50 ms, so it waits
    for the GIL, out of its poll, when the two end."""
    at = time.time() + 2.0  # both ranks started and found by the watcher well before
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", DIES], env={**os.environ, "PMI_RANK": str(r), "AT": str(at + dt)}
        )
        for r, dt in ((0, 0.1), (1, 0.0))
    ]
    ends = launch_module._Ends(os.getpid(), 3)
    time.sleep(max(0.0, at - 0.3 - time.time()))  # the watcher finds both meanwhile
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10)
    try:
        while time.time() < at + 0.4:  # holding the GIL until both ended
            pass
    finally:
        sys.setswitchinterval(interval)
    for rank in ranks:
        assert rank.wait(timeout=10) == -signal.SIGKILL
    ends.stop()
    assert ends.first() == 1


@needs_mpiexec
@pytest.mark.timeout(20)
def test_each_ranks_lines_come_back_prefixed_by_its_rank(rank_script):
    proc = start("-n", "2", "--", sys.executable, rank_script, "lines")
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, out + err
    assert sorted(out.splitlines()) == ["[0] out 0 a", "[0] out 0 b end", "[1] out 1 a", "[1] out 1 b end"]
    assert sorted(err.splitlines()) == ["[0] err 0", "[1] err 1"]


@needs_mpiexec
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "codes, status, report",
    [
        (
            ["5", "200", "3"],
            200,
            "rank 0 exited with status 5; rank 1 exited with status 200; rank 2 exited with status 3",
        ),
        (["kill"], 137, "rank 0 was killed by SIGKILL (signal 9)"),
    ],
)
def test_the_launcher_exits_with_the_worst_ranks_status(rank_script, codes, status, report):
    proc = start("-n", str(len(codes)), sys.executable, rank_script, "exit", *codes)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == status, out + err
    assert err.splitlines()[-1] == f"actorflow launch: {report}"
    assert "Exit codes" not in out + err and "YOUR APPLICATION TERMINATED" not in out + err


def stop(rank_script: str, sig: int, *, hang_mpiexec: bool = False) -> tuple[int, set[int], dict[int, str]]:
    """Start 2 sleeping ranks, send ``sig`` to the launcher, and wait for it to exit
    (at most 5 s): -> (its status, the ranks' pids, every process it had below it)."""
    proc = start("-n", "2", "--grace", "2", "--", sys.executable, rank_script, "sleep")
    ranks = {int(proc.stdout.readline().split()[-1]) for _ in range(2)}
    below = descendants(proc.pid)
    if hang_mpiexec:
        os.kill(next(pid for pid, name in below.items() if name == "mpiexec"), signal.SIGSTOP)
    proc.send_signal(sig)
    try:
        status = proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.communicate()
        for pid in below:  # a launcher that failed its test leaves nothing behind either (a stopped mpiexec)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return status, ranks, below


@needs_mpiexec
@pytest.mark.timeout(20)
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_stops_every_rank_and_leaves_nothing_behind(rank_script, sig, status):
    code, ranks, below = stop(rank_script, sig)
    assert code == status
    assert ranks <= below.keys()
    assert {"mpiexec", "hydra_pmi_proxy"} <= set(below.values())
    assert [pid for pid in below if alive(pid)] == []


@needs_mpiexec
@pytest.mark.timeout(20)
def test_a_hung_mpiexec_is_killed_with_its_ranks_after_the_grace(rank_script):
    code, ranks, below = stop(rank_script, signal.SIGINT, hang_mpiexec=True)
    assert code == 130
    assert ranks <= below.keys()
    assert [pid for pid in below if alive(pid)] == []


@pytest.mark.timeout(10)
def test_no_mpiexec_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(launch_module, "find_mpiexec", lambda: None)
    code, out, err = run_cli(capsys, "launch", "-n", "2", "--", "true")
    assert code == 2
    assert out == ""
    assert err.startswith("actorflow launch: error: ") and err.count("\n") == 1
    assert "pip install mpi4py mpich" in err


@pytest.mark.timeout(10)
def test_another_mpis_mpiexec_is_a_one_line_error(capsys, monkeypatch, tmp_path):
    openmpi = tmp_path / "mpiexec"
    openmpi.write_text(
        "#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3'\necho\necho 'Report bugs to https://www.open-mpi.org/'\n"
    )
    openmpi.chmod(0o755)
    monkeypatch.setattr(launch_module, "find_mpiexec", lambda: str(openmpi))
    code, out, err = run_cli(capsys, "launch", "-n", "2", "--", "true")
    assert code == 2
    assert out == ""
    assert err.startswith("actorflow launch: error: ") and err.count("\n") == 1
    assert f"{openmpi} is Open MPI's mpiexec (mpiexec (Open MPI) 5.0.3)" in err
    assert "pip install mpi4py mpich" in err


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv", [["-n", "0", "true"], ["-n", "two", "true"], ["true"], ["-n", "2"], ["-n", "2", "--"]]
)
def test_bad_arguments_exit_2(capsys, argv):
    code, _, err = run_cli(capsys, "launch", *argv)
    assert code == 2
    assert "error:" in err


@pytest.mark.timeout(10)
def test_the_help_says_what_it_sets_and_how_to_go_across_machines(capsys):
    code, out, _ = run_cli(capsys, "launch", "--help")
    assert code == 0
    text = " ".join(out.split())
    for part in (
        "-launcher fork -iface lo -host localhost",
        "UCX_TLS=self,sm",
        "-disable-auto-cleanup",
        "actorflow launch -n 4 --hostfile hosts -- actorflow run configs/2x2.yaml",
        "mpiexec -n N",
    ):
        assert part in text, part
