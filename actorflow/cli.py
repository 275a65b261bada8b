"""The ``actorflow`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CheckpointError, CompileError, ConfigError, DeviceError
from .trace.cli import add_commands as add_trace_commands


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    from .launch import GRACE

    p = argparse.ArgumentParser(
        prog="actorflow",
        description="An actor-model dataflow runtime: compile a graph into a Plan of actors and run it.",
    )
    p.add_argument("--version", action="version", version=f"actorflow {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="compile and run a small two-device graph, checked against numpy",
        description="Build a graph on cpu:0 and cpu:1 (matmuls, a copy, an all-reduce, a user "
        "kernel), print its plan, run it pipelined and print results and timing.",
    )
    demo.add_argument("--iterations", type=_positive, default=50, help="iterations to run (default 50)")
    demo.add_argument("--batch", type=_positive, default=64, help="rows of x (default 64)")
    demo.add_argument("--width", type=_positive, default=256, help="features (default 256)")
    demo.add_argument("--quota", type=_positive, default=2, help="buffers per register (default 2)")
    demo.add_argument("--trace", metavar="PATH", help="write a Chrome trace (ui.perfetto.dev) there")

    run = sub.add_parser(
        "run",
        help="train the model a YAML config describes, pipelined over its stages",
        description="Train the run CONFIG describes (see configs/): a progress bar with the loss, "
        "then a table of samples/s, measured pipeline bubble per stage beside the theory "
        "(p-1)/(m+p-1) (under zb1, ZB-H1's with the measured pass times) and the bubble its "
        "stages' measured kernel times alone would give, "
        "peak activations held per stage and planned and held memory per device. "
        "Under a launcher (actorflow launch -n 2 -- actorflow run CONFIG) the devices are "
        "spread over the ranks in order, one rank per stage replica when the counts match; "
        "rank 0 shows the progress and the report and writes --metrics, every rank writes "
        "its own trace (NAME.rankR.json) and rank 0 the merged one. Every file is written to a "
        "temporary name and renamed into place, and every output path is checked before the "
        "first step. Ctrl-C ends the run after the steps in flight (train.steps_per_run; "
        "exit 130), a loss that is NaN or infinite at its step (exit 1, unless "
        "train.stop_on_nonfinite is false), each "
        "with the report and files of the steps run. With output.checkpoint {path: DIR, every: N} "
        "the run keeps a checkpoint in DIR every N steps and at its end (Ctrl-C included), and "
        "--resume DIR goes on from it; a checkpoint that is missing, partial, corrupt or of "
        "another model, layout or data is refused (exit 2).",
    )
    _config_arguments(run)
    run.add_argument("--steps", type=_positive, help="override train.steps")
    run.add_argument("--trace", metavar="PATH", help="write a Chrome trace there (overrides output.trace)")
    run.add_argument(
        "--metrics", metavar="PATH", help="write the results as JSON there (overrides output.metrics)"
    )
    run.add_argument(
        "--parameters",
        metavar="PATH",
        help="write the trained parameters there as .npz, by name (overrides output.parameters)",
    )
    run.add_argument(
        "--resume",
        metavar="DIR",
        help="go on from the newest checkpoint in DIR (output.checkpoint.path of an earlier run) "
        "to --steps, the run's total, bit for bit as if it had not stopped",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar or per-step loss")

    sim = sub.add_parser(
        "simulate",
        help="predict a YAML config's run on a virtual clock, calibrated from a measured run",
        description="Run the plan CONFIG describes through the runtime's own protocol on a virtual "
        "clock, each act taking the time a cost model gives (no data read, no kernel run), and "
        "print what actorflow run prints, marked predicted. The cost model comes from --calibrate: "
        "a trace of actorflow run --trace on this machine (of any config of the same model), or "
        "a calibration file saved from one with --save-calibration. Without --calibrate, the one "
        "shipped for the config's model is used: fitted on actorflow's developers' machine (a "
        "2-core VM), not yours; make your own with, e.g., actorflow run configs/gpipe.yaml --steps 30 "
        "--trace t.json, then actorflow simulate configs/default.yaml --calibrate t.json "
        "--save-calibration cal.json.",
    )
    _config_arguments(sim)
    sim.add_argument("--steps", type=_positive, help="override train.steps")
    sim.add_argument(
        "--calibrate",
        metavar="FILE",
        help="a trace written by actorflow run --trace, or a calibration file; default: the one "
        "shipped for the config's model (a 2-core VM's)",
    )
    sim.add_argument(
        "--crowding",
        metavar="TRACE",
        help="a trace written by actorflow run --trace of the same model with more than two devices "
        "in one process (e.g. configs/2x2.yaml): fits how much more acts slow each other down "
        "the more of them run at once (default: the calibration's own figure, 0 for a trace: "
        "four at once as slow as two)",
    )
    sim.add_argument("--save-calibration", metavar="FILE", help="write the fitted cost model there")
    sim.add_argument(
        "--layout",
        metavar="D,T,P",
        help="data-parallel, tensor-parallel and pipeline degrees over D x T x P devices, "
        "replacing parallel.stages",
    )
    sim.add_argument(
        "--layouts",
        type=_positive,
        metavar="N",
        help="instead, the fastest layouts on N devices (degrees, micro-batches, schedule) "
        "that fit runtime.max_memory; a process a core simulates them",
    )
    sim.add_argument(
        "--ranks",
        type=_positive,
        default=1,
        metavar="N",
        help="a run over N ranks (processes, as actorflow launch -n N starts), the devices spread "
        "over them in order",
    )
    sim.add_argument("--trace", metavar="PATH", help="write the simulated run's Chrome trace there")
    sim.add_argument("--metrics", metavar="PATH", help='write the results as JSON there ("predicted": true)')

    comp = sub.add_parser(
        "compile",
        help="print the plan of a YAML config's run without running it",
        description="Compile the run CONFIG describes and print an overview of its plan (streams, "
        "actors per kind, planned memory), or all of it with --dump, or its actor graph with --dot "
        "(render with: dot -Tsvg).",
    )
    _config_arguments(comp)
    view = comp.add_mutually_exclusive_group()
    view.add_argument(
        "--dump",
        action="store_true",
        help="every actor with its stream, priority, inputs and outputs (quota, consumers); "
        "events; collective order; planned memory per device",
    )
    view.add_argument(
        "--dot", action="store_true", help="the actor graph as Graphviz text, streams as clusters"
    )
    comp.add_argument(
        "--ranks",
        type=_positive,
        metavar="N",
        help="plan for N ranks (processes), the devices spread over them in order; "
        "default: as many as the launcher started, else 1",
    )
    launch = sub.add_parser(
        "launch",
        help="start N ranks of a command with MPICH's mpiexec, on this machine by default",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"""\
Start N ranks of COMMAND with the mpiexec of the mpich wheel (pip install mpi4py mpich).

By default every rank runs on this machine, over loopback only:
  mpiexec -launcher fork -iface lo -host localhost -disable-auto-cleanup -n N COMMAND
with UCX_TLS=self,sm and UCX_NET_DEVICES=lo unless they are set already.
-disable-auto-cleanup lets the other ranks report a lost peer instead of being killed.
Each actorflow rank binds itself to its share of the CPUs this command may use
(ACTORFLOW_RANK_CPUS, e.g. 0;1 for 2 ranks on 2 CPUs; set it empty to leave the ranks
unbound, or bind them yourself with --mpiexec-arg=-bind-to ...).
Each rank's lines are prefixed with [rank]; the exit status is the worst rank's (128+N
for one killed by signal N). Ctrl-C and SIGTERM are passed on to the ranks, and what
is left {GRACE:g} s later (--grace) is killed. stdin goes to rank 0.

examples:
  actorflow launch -n 2 -- actorflow run configs/2x2.yaml
  actorflow launch -n 4 --hostfile hosts -- actorflow run configs/2x2.yaml
      across machines: hosts holds one 'host[:slots]' a line
  mpiexec -n 2 actorflow run configs/2x2.yaml
      plain mpiexec -n N works too, without the prefixes, the exit status and the cleanup""",
    )
    launch.add_argument(
        "-n", dest="ranks", metavar="N", type=_positive, required=True, help="number of ranks"
    )
    launch.add_argument(
        "--hostfile",
        metavar="FILE",
        help="run across the hosts listed there (mpiexec -f FILE) instead of the loopback defaults",
    )
    launch.add_argument(
        "--grace",
        metavar="SECONDS",
        type=float,
        default=GRACE,
        help="after Ctrl-C or SIGTERM, kill what is left of the ranks this much later "
        f"(default {GRACE:g}: an interrupted actorflow run writes its report and files first)",
    )
    launch.add_argument(
        "--mpiexec-arg",
        dest="mpiexec_args",
        metavar="ARG",
        action="append",
        default=[],
        help="pass ARG to mpiexec, e.g. --mpiexec-arg=-verbose (repeatable)",
    )
    launch.add_argument(
        "argv",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="the command each rank runs, after an optional --",
    )
    add_trace_commands(sub)
    return p


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="the run's YAML config, e.g. configs/default.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="PATH=VALUE",
        action="append",
        default=[],
        help="override a config value, e.g. --set parallel.micro_batches=8 (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    code = _command(argv)
    world = sys.modules.get("actorflow.runtime.mpi_world")
    if world is not None and (least := world.unfinalized()) is not None:
        world.leave(max(code, least))  # without MPI_Finalize (see mpi_world)
    return code


def _command(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo(args.iterations, args.batch, args.width, args.quota, args.trace)
    if args.command in ("run", "compile", "simulate"):
        from .config import load_config
        from .world import this_rank

        overrides = list(args.overrides)
        if getattr(args, "steps", None) is not None:
            overrides.append(f"train.steps={args.steps}")

        def tell(text: str) -> None:
            if this_rank() == 0:
                print(f"actorflow {args.command}: {text}", file=sys.stderr)

        try:
            config = load_config(args.config, overrides, tell)
        except ConfigError as err:
            print(f"actorflow {args.command}: error: {err}", file=sys.stderr)
            return 2
        if args.command == "simulate":
            return _simulate(config, args)
        return _run(config, args) if args.command == "run" else _compile(config, args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "trace":
        from .trace.cli import run as trace

        return trace(args)
    parser().print_help()
    return 2


def _launch(args) -> int:
    from .launch import MpiexecNotFound, launch

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print(
            "actorflow launch: error: give the COMMAND each rank runs, "
            "e.g. actorflow launch -n 2 -- actorflow run configs/2x2.yaml",
            file=sys.stderr,
        )
        return 2
    try:
        return launch(args.ranks, command, hostfile=args.hostfile, extra=args.mpiexec_args, grace=args.grace)
    except MpiexecNotFound as err:
        print(f"actorflow launch: error: {err}", file=sys.stderr)
        return 2


def _compile(config, args) -> int:
    from .training import compile_config
    from .views import dot, overview

    try:
        plan = compile_config(config, args.ranks)
    except (CompileError, ConfigError) as err:
        print(f"actorflow compile: error: {err}", file=sys.stderr)
        return 2
    print(plan.summary() if args.dump else dot(plan) if args.dot else overview(plan))
    if config.parallel.parameter_server is not None and not args.dot:
        from .training.parameter_server import roles

        print("\n".join(roles(config, plan)))
    return 0


def _simulate(config, args) -> int:
    from .files import check_outputs, replaced
    from .simulate import cost_model, predict
    from .simulate.layouts import parse_layout, predict_layout, search
    from .trace.recorder import write_chrome
    from .training.report import rate

    try:
        check_outputs(
            {"--trace": args.trace, "--metrics": args.metrics, "--save-calibration": args.save_calibration},
            {"config": args.config, "calibration": args.calibrate, "crowding trace": args.crowding},
        )
        if args.calibrate is None:
            print(
                f"actorflow simulate: no --calibrate: the calibration shipped for the {config.model.kind} "
                "model, fitted on a 2-core VM, not this machine",
                file=sys.stderr,
            )
        model = cost_model(args.calibrate, config.model.kind, args.crowding)
        if args.save_calibration:
            with replaced(args.save_calibration) as f:
                f.write(model.to_json())
        if args.layouts:
            found = search(config, args.layouts, model, workers=len(os.sched_getaffinity(0)))
            if not found:
                raise ConfigError(f"--layouts: no layout of {args.layouts} devices fits this model")
            print(f"predicted: the fastest layouts of {args.layouts} devices (data,tensor,pipeline)")
            for c in found:
                print(
                    f"  {','.join(map(str, c.layout))}  {c.micro_batches} micro-batches  {c.schedule:<5}  "
                    f"step {c.step_seconds * 1e3:.3f} ms  {c.memory / 2**20:.1f} MiB a device at most"
                )
            return 0
        if args.layout:
            layout = parse_layout(args.layout)
            config, prediction = predict_layout(
                config, model, layout, ranks=args.ranks if args.ranks > 1 else None
            )
            print(
                f"one of {layout[0]} data-parallel replicas simulated over {layout[1] * layout[2]} devices in "
                f"{args.ranks if args.ranks > 1 else layout[2]} ranks; its gradients' all-reduce charged by the "
                f"links; all {layout[0]} together: {layout[0] * config.train.batch_size} samples a step, "
                f"{rate(layout[0] * prediction.result.samples_per_second)} samples/s"
            )
        else:
            prediction = predict(config, model, ranks=args.ranks)
    except (CompileError, ConfigError) as err:
        print(f"actorflow simulate: error: {err}", file=sys.stderr)
        return 2
    if args.trace:
        write_chrome(prediction.chrome, args.trace)
    _report(config, prediction.result, {"trace": args.trace, "metrics": args.metrics, "parameters": None})
    return 0


def _run(config, args) -> int:
    from tqdm import tqdm

    from .files import check_outputs
    from .training import survival, train
    from .world import this_rank, world_size

    outputs = {
        "trace": (args.trace, config.output.trace),
        "metrics": (args.metrics, config.output.metrics),
        "parameters": (args.parameters, config.output.parameters),
    }
    paths = {name: flag or key for name, (flag, key) in outputs.items()}
    keep = config.output.checkpoint
    try:
        check_outputs(
            {f"--{name}" if flag else f"output.{name}": paths[name] for name, (flag, _) in outputs.items()},
            {
                "config": args.config,
                "data": config.data.path,
                "data.x": config.data.x,
                "data.labels": config.data.labels,
            },
            {"output.checkpoint.path": keep.path if keep else None},
        )
    except ConfigError as err:
        print(f"actorflow run: error: {err}", file=sys.stderr)
        return 2
    if config.parallel.parameter_server is not None and world_size() > 1:
        survival.guard()  # so that the run can lose a worker (see survival)
    lead = this_rank() == 0  # under a launcher, rank 0 alone reports
    quiet = args.quiet or not lead
    bar = tqdm(
        total=config.train.steps, unit="step", disable=quiet or not sys.stderr.isatty(), file=sys.stderr
    )

    done = 0

    def on_step(step: int, loss: float) -> None:
        nonlocal done
        if not done:
            bar.update(step)  # a resumed run's steps before its checkpoint
        done = step + 1
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}")
        if not args.quiet and this_rank() == 0 and (step + 1) % config.train.log_every == 0:
            bar.write(f"step {step + 1}/{config.train.steps} loss {loss:.4f}", file=sys.stderr)

    def on_lost(told: str, step: int) -> None:
        nonlocal done
        done = step
        bar.n = step  # the steps past it run again
        if this_rank() == 0:  # of the survivors
            bar.write(f"actorflow run: {told}", file=sys.stderr)

    try:
        result = train(config, on_step, paths["trace"], args.resume, on_lost)
    except (CheckpointError, CompileError, ConfigError, DeviceError) as err:
        print(f"actorflow run: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if lead:
            print(f"actorflow run: interrupted at step {done} of {config.train.steps}", file=sys.stderr)
        return 130
    finally:
        bar.close()
    lead = this_rank() == 0
    if lead:
        _report(result.ended_with or config, result, paths)
    code = 0 if result.stopped is None else result.stopped.exit_status
    if lead and result.stopped is not None:
        print(f"actorflow run: {result.stopped.text}", file=sys.stderr)
    return code


def _report(config, result, paths: dict[str, str | None]) -> None:
    """Print the run's table and write its metrics and parameters (the trace is written)."""
    import numpy as np

    from .files import replaced, write_json
    from .text import count
    from .training.report import metrics, table

    print(table(config, result))
    if paths["trace"]:
        print(f"trace written to {paths['trace']}" + (f" ({result.trace_note})" if result.trace_note else ""))
    if paths["metrics"]:
        nulls = write_json(metrics(config, result), paths["metrics"], indent=2)
        print(
            f"metrics written to {paths['metrics']}"
            + (f" ({count(nulls, 'NaN or infinite number')} as null)" if nulls else "")
        )
    if paths["parameters"]:
        with replaced(paths["parameters"], "wb") as f:
            np.savez(f, **result.parameters)
        print(f"parameters written to {paths['parameters']} ({len(result.parameters)} arrays)")


if __name__ == "__main__":
    sys.exit(main())
