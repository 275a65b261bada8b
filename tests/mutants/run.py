"""Apply known runtime bugs, one at a time, to a copy of the package and show which tests
catch each: every mutant must make some test fail (in its ``files``: the runtime's
mutants ``FILES``, a parameter-server run's survival ``test_survival.py``).

    python tests/mutants/run.py            # every mutant (38 of them: about 45 minutes on 2 cores)
    python tests/mutants/run.py releases   # the mutants whose name contains 'releases'

The working tree is never touched: each mutant is applied to a fresh copy of ``actorflow/``,
``tests/`` and ``configs/`` in a temporary directory, and pytest runs there with PYTHONPATH set to it.
Exits with status 1 if any mutant survives. (Named run.py, so pytest does not collect it.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    "tests/test_protocol.py",
    "tests/test_protocol_plans.py",
    "tests/test_properties.py",
    "tests/test_micro_batches.py",
    "tests/test_training.py",
]


class Mutant(NamedTuple):
    name: str
    what: str
    path: str
    old: str
    new: str
    files: tuple[str, ...] = tuple(FILES)
    """The test files that must catch it."""


PROTOCOL = "actorflow/runtime/protocol.py"
DRIVER = "actorflow/runtime/driver.py"
REPLAY = "actorflow/runtime/replay.py"
PROGRAM = "actorflow/runtime/program.py"
SURVIVAL = ("tests/test_survival.py",)

MUTANTS = [
    Mutant(
        "replay-waits-one-short",
        "a replayed act waits for one act fewer of the stream it depends on",
        REPLAY,
        "                        need = at[s] + c",
        "                        need = at[s] + c - 1",
    ),
    Mutant(
        "replay-wakes-one-late",
        "a replayed stream wakes a stream that waits on it one instruction after the one it waits for",
        REPLAY,
        "                    if waiting is not None and waiting[0] == me and done >= waiting[1]:",
        "                    if waiting is not None and waiting[0] == me and done > waiting[1]:",
    ),
    Mutant(
        "replay-comm-waits-on-the-latest",
        "over ranks, an act waits only on the latest of the sends and receives it needs, as if they ended in order",
        PROGRAM,
        "                if comm[stream]:",
        "                if False:",
        ("tests/test_replay.py",),
    ),
    Mutant(
        "replay-comm-read-when-started",
        "over ranks, a stream takes a send or receive it waits on as ended once it started",
        REPLAY,
        "                        if counts[s] < need and not (s == comm and need - 1 in ended):",
        "                        if counts[s] < need and not (s == comm and need - 1 < streams[comm].started):",
        ("tests/test_ranks.py",),
    ),
    Mutant(
        "rider-waits-for-every-request",
        "a rank's rider waits for all its sends and receives in flight, not for the first to end",
        REPLAY,
        "self.transport.wait([request for request, _ in self.live.values()], until, every=False)",
        "self.transport.wait([request for request, _ in self.live.values()], until, every=True)",
        ("tests/test_ranks.py",),
    ),
    Mutant(
        "wait-for-one-counts-past-it",
        "a wait for one of several requests goes on when two end at once",
        "actorflow/runtime/transport.py",
        "        while left > 0 and not woken:",
        "        while left and not woken:",
        ("tests/test_transport.py",),
    ),
    Mutant(
        "simulated-contention-of-all-python",
        "on the virtual clock, an act slows down beside others as if all of it held the GIL",
        "actorflow/runtime/virtual.py",
        "slowing = self.host.contention * gil",
        "slowing = self.host.contention",
        ("tests/test_simulate.py",),
    ),
    Mutant(
        "simulated-crowding-ignored",
        "on the virtual clock, an act slows down beside three others as much as beside one",
        "actorflow/runtime/virtual.py",
        "others**crowding if others else 0.0",
        "1.0 if others else 0.0",
        ("tests/test_simulate.py",),
    ),
    Mutant(
        "session-wakes-at-the-first-stream-to-finish",
        "a Session's run returns once any stream finished its part, not the last",
        "actorflow/runtime/runtime.py",
        "            finished = self._remaining == 0",
        "            finished = True",
        ("tests/test_runtime.py", "tests/test_properties.py"),
    ),
    Mutant(
        "session-waits-through-a-failure",
        "a Session's run that a failure reached before it started waits on for its end",
        "actorflow/runtime/runtime.py",
        "        if self.failed:  # and stopped the streams\n            wake()",
        "        if False:  # and stopped the streams\n            wake()",
        ("tests/test_runtime.py",),
    ),
    Mutant(
        "replay-runs-past-the-end",
        "a replayed stream runs the acts of the step after the run's last",
        REPLAY,
        "                if 0 <= step + shift < steps:  # else an act of a step outside this run: skipped",
        "                if 0 <= step + shift <= steps:",
    ),
    Mutant(
        "replay-times-every-traced-step",
        "a replayed run that traces some steps times and reports every act",
        REPLAY,
        "special.fetch or traced is None or iteration in traced",
        "special.fetch or traced is None or True",
        ("tests/test_pipeline.py",),
    ),
    Mutant(
        "replay-fetches-only-traced-steps",
        "a replayed run that traces some steps hands the host the fetches of those steps only",
        REPLAY,
        "special.fetch or traced is None or iteration in traced",
        "traced is None or iteration in traced",
        ("tests/test_pipeline.py",),
    ),
    Mutant(
        "report-counts-each-ranks-steps",
        "a report over ranks counts each step once per rank's step track",
        "actorflow/training/runner.py",
        'held = {s.args["iteration"] for s in parsed.spans if s.category == STEP}',
        'held = [s.args["iteration"] for s in parsed.spans if s.category == STEP]',
        ("tests/test_ranks.py",),
    ),
    Mutant(
        "chain-reads-the-wrong-part",
        "a fused chain's part of one source reads the output before the one it names",
        "actorflow/ops/chain.py",
        "            part_ins = [ins[k] if k >= 0 else outs[~k]]",
        "            part_ins = [ins[k] if k >= 0 else outs[max(0, ~k - 1)]]",
        ("tests/test_chains.py",),  # the runtime calls bind's code; this test compares chain with it
    ),
    Mutant(
        "releases-first-use",
        "a held register is released after its first use instead of its last",
        PROTOCOL,
        "                if number % hold == hold - 1:",
        "                if number % hold == 0:",
    ),
    Mutant(
        "publishes-first-write",
        "a periodic output is handed on after its first write instead of its last",
        PROTOCOL,
        "            if number % period == period - 1:  # its last write: handed on, or free again",
        "            if number % period == 0:",
    ),
    Mutant(
        "credit-one-free-early",
        "a buffer's credit comes back when one consumer is still to free it",
        PROTOCOL,
        "        if pending[index] == 0:",
        "        if pending[index] <= 1:",
    ),
    Mutant(
        "double-free-accepted",
        "a second free of a buffer passes silently",
        PROTOCOL,
        "        if not pending[index]:",
        "        if False:",
    ),
    Mutant(
        "uniform-releases-nothing",
        "an act of the common case releases none of its inputs",
        PROTOCOL,
        "            return Act(number, ins, outs, self._all_inputs, self._all_outputs, self._all_outputs, 0)",
        "            return Act(number, ins, outs, (), self._all_outputs, self._all_outputs, 0)",
    ),
    Mutant(
        "free-before-kernel",
        "a consumer frees its inputs when it launches, before its kernel has read them",
        DRIVER,
        "        self.stream.launch(unit.kernel, ins, outs, (unit, acts))",
        "        for k, (m, act) in enumerate(zip(unit.members, acts)):\n"
        "            for slot in act.releases:\n"
        "                self._send_free(m.fed[slot].producer, m.fed[slot].out, act.inputs[slot])\n"
        "            acts[k] = act._replace(releases=())\n"
        "        self.stream.launch(unit.kernel, ins, outs, (unit, acts))",
    ),
    Mutant(
        "run-ends-early",
        "a stream tells the runtime it is done before its last actor completed",
        DRIVER,
        "            if self.unfinished == 0:",
        "            if self.unfinished <= 1:",
    ),
    Mutant(
        "survivors-restart-the-data",
        "after a lost worker the smaller batches start from the data as if they always had been",
        "actorflow/training/runner.py",
        "step_feeds(config, self.data, s, self.parts, self.gone.origin)",
        "step_feeds(config, self.data, s, self.parts)",
        SURVIVAL,
    ),
    Mutant(
        "a-lost-worker-fails-the-run",
        "a losable rank's loss fails every rank, as a server's does",
        "actorflow/runtime/transport.py",
        "return RankLost(peer, text) if peer in self.losable and peer != self.rank else RankError(text)",
        "return RankError(text)",
        SURVIVAL,
    ),
    Mutant(
        "no-guard",
        "the ranks of a parameter-server run start without their guard, so hydra sees a rank die of a signal",
        "actorflow/cli.py",
        "        survival.guard()  # so that the run can lose a worker (see survival)",
        "        pass",
        SURVIVAL,
    ),
    Mutant(
        "any-worker-rank-is-losable",
        "a rank counts as losable though the workers left do not lay out over the ranks left",
        "actorflow/training/survival.py",
        "            parameter_server.rank_devices(parameter_server.without(config, workers), plan.world - 1)",
        "            pass",
        SURVIVAL,
    ),
    Mutant(
        "runtime-lets-full-collections-run",
        "a runtime opens without pausing the cyclic collector's collections over the whole heap",
        "actorflow/runtime/runtime.py",
        "            self._stack.enter_context(full_collections_paused())\n",
        "",
        ("tests/test_collector.py",),
    ),
    Mutant(
        "runtime-keeps-its-buffers",
        "a closed runtime keeps its buffers, for a collection over the whole heap to free",
        "actorflow/runtime/runtime.py",
        "            self._wiring.release({p.register for p in self.plan.parameters_of(self.rank)})\n",
        "            pass\n",
        ("tests/test_collector.py",),
    ),
    Mutant(
        "train-ignores-steps-per-run",
        "train gives the runtime one step a run whatever train.steps_per_run says",
        "actorflow/training/parameter_server.py",
        "else config.train.steps_per_run",
        "else 1",
        ("tests/test_pipeline.py",),
    ),
    Mutant(
        "feed-check-takes-any-dtype",
        "the quick feed check takes an array of the placeholder's shape in any dtype",
        "actorflow/runtime/feeds.py",
        "array.shape != shape or array.dtype != dtype:",
        "array.shape != shape:",
        ("tests/test_runtime.py",),
    ),
    Mutant(
        "bound-chain-notes-the-next-part",
        "a bound chain's failure is noted on the part after the one that failed",
        "actorflow/ops/chain.py",
        'lines += [f"        p = {p}",',
        'lines += [f"        p = {p + 1}",',
        ("tests/test_chains.py",),
    ),
    Mutant(
        "rider-blocks-beside-a-collective",
        "a rider's wait stays in MPI while a collective over ranks is in MPI on another thread",
        "actorflow/runtime/transport.py",
        "            if self._collective_elsewhere():\n                self._leave_mpi(until)\n                continue\n",
        "",
        ("tests/test_transport.py",),
    ),
    Mutant(
        "rider-spins-before-a-collective",
        "a rider's wait stays in MPI while a collective stream of its rank can start its next collective",
        "actorflow/runtime/transport.py",
        "            if self.stays() and not self._collective_next():\n",
        "            if self.stays():\n",
        ("tests/test_transport.py",),
    ),
    Mutant(
        "replay-block-short-of-a-buffer-cycle",
        "a replayed block spans a quota's steps divided by the micro-batches, as if every output were taken once a micro-batch",
        PROGRAM,
        "    return length // math.gcd(length, per_step) if per_step else 1",
        "    return max(1, length // max(1, per_step))",
        ("tests/test_replay.py",),
    ),
    Mutant(
        "a-quiet-rank-spins",
        "a rank that heard of nothing for QUIET_AFTER still waits inside MPI, spinning a core",
        "actorflow/runtime/transport.py",
        "        return not self._quiet and (self.spare_core or (self._cores_per_rank >= 1 and not self.busy()))",
        "        return self.spare_core or (self._cores_per_rank >= 1 and not self.busy())",
        ("tests/test_transport.py",),
    ),
    Mutant(
        "fetch-from-a-rank-wakes-a-copy-thread",
        "a small fetch of what another rank sent keeps its copy stream's thread",
        "actorflow/runtime/wiring.py",
        "                    stream = compute.get(unit.actor.device, own)\n",
        "                    stream = own\n",
        ("tests/test_replay.py",),
    ),
    Mutant(
        "schedule-takes-a-lagging-rank-for-no-repetition",
        "a rank's stream that has not run past the blocks yet counts as not repeating, and the check moves on",
        PROGRAM,
        "            if verdict == NOT_YET:  # a rank's stream gathers several simulated ones' acts",
        "            if False:",
        ("tests/test_replay.py",),
    ),
    Mutant(
        "schedule-checks-one-period",
        "a schedule takes a block as repeating when the period after it repeats it, not the two before",
        PROGRAM,
        "        for i in range(start - 2 * size, start + size):",
        "        for i in range(start, start + size):",
        ("tests/test_replay.py",),
    ),
    Mutant(
        "in-process-collectives-in-the-collective-order",
        "a collective stream within one process launches in the collective order, a micro-batch's backward all-reduces before the next one's forward ones",
        "actorflow/runtime/wiring.py",
        "        if stream.id in spanning:",
        '        if stream.kind == "collective":',
        ("tests/test_transformer.py",),
    ),
]


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in ("actorflow", "tests", "configs"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def apply(root: Path, mutant: Mutant) -> None:
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(
            f"{mutant.name}: the code it mutates is not in {mutant.path} exactly once; update the mutant"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def failures(root: Path, test_file: str) -> list[str]:
    """The tests of ``test_file`` that fail in ``root`` (up to the first, with -x)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.MULTILINE)


def main(selected: list[str]) -> int:
    mutants = [m for m in MUTANTS if not selected or any(s in m.name for s in selected)]
    if not mutants:
        raise SystemExit(
            f"no mutant's name contains any of {selected}; the names: {[m.name for m in MUTANTS]}"
        )
    rows = []
    for mutant in [None, *mutants]:
        with tempfile.TemporaryDirectory(prefix="actorflow-mutant-") as tmp:
            root = Path(tmp)
            copy_tree(root)
            if mutant is not None:
                apply(root, mutant)
            files = mutant.files if mutant else dict.fromkeys(f for m in mutants for f in m.files)
            caught_by = [t.removeprefix("tests/") for f in files for t in failures(root, f)]
        name = mutant.name if mutant else "(none: the tree as it is)"
        if mutant is None:
            ok = not caught_by
            verdict = "all pass" if ok else "FAILS"
        else:
            ok = bool(caught_by)
            verdict = "yes" if ok else "NO"
        rows.append((name, verdict, ", ".join(caught_by) or "-", ok))
        print(f"{name}: {verdict} {', '.join(caught_by)}", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant':<{width}}  caught    by")
    for name, verdict, by, _ in rows:
        print(f"{name:<{width}}  {verdict:<8}  {by}")
    for m in mutants:
        print(f"  {m.name}: {m.what}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
