"""A run's results for people (a table) and for programs (JSON)."""

from __future__ import annotations

from typing import Any

from ..compiler.schedules import ZERO_BUBBLE
from ..config import Config
from ..text import columns, count
from .runner import RunResult


def rate(per_second: float) -> str:
    """Whole numbers with thousands separators; below 100, three significant digits (a
    predicted run of a large model makes a fraction of a sample a second)."""
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


def table(config: Config, result: RunResult) -> str:
    parallel = config.parallel
    done = (
        f"{_steps(config, result)} of {config.train.batch_size} samples in {result.seconds:.2f} s: "
        f"{rate(result.samples_per_second)} samples/s"
    )
    lines = [
        f"predicted (simulated, no kernel run): {done}; step time {result.seconds / result.steps * 1e3:.3f} ms"
        if result.predicted
        else f"{done}; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}",
        f"pipeline: {count(len(parallel.stages), 'stage')} x {count(parallel.data_parallel, 'replica')}"
        + (f" x {parallel.tensor_parallel} tensor-parallel parts" if parallel.tensor_parallel > 1 else "")
        + (
            f" (the workers of {count(parallel.parameter_server.servers, 'parameter server')}, "
            f"{parallel.parameter_server.mode})"
            if parallel.parameter_server
            else ""
        )
        + f", {count(parallel.micro_batches, 'micro-batch', 'micro-batches')}, {parallel.schedule}; "
        + (
            "acts replayed in a simulated run's order"
            if result.ordered_by == "replay"
            else "acts decided as the run goes (" + result.ordered_by.removeprefix("dynamic: ") + ")"
        ),
        "",
    ]
    for told in result.lost:
        lines.insert(-1, told)
    if result.staleness is not None:
        ps = parallel.parameter_server
        assert ps is not None, "staleness is counted by async parameter servers"
        lines.insert(
            -1,
            f"staleness of the updates: mean {result.staleness[0]:.2f}, max {result.staleness[1]} steps "
            f"(at most {ps.staleness})",
        )
    rows = [
        (
            "stage",
            "devices",
            "layers",
            "bubble",
            "theory",
            "at these stage times",
            "peak activations",
            "quota",
        )
    ]
    for s, devices in enumerate(parallel.stages):
        rows.append(
            (
                str(s),
                ", ".join(devices),
                str(config.stage_layers[s]),
                f"{result.bubbles[s]:.3f}",
                f"{result.theory:.3f}",
                f"{result.balanced[s]:.3f}" if result.balanced else "-",
                str(result.peak_activations[s]),
                str(result.activation_quotas[s]),
            )
        )
    lines += columns(rows)
    lines.append(
        f"critical path: {result.handoff_share:.0%} between kernels (host hand-offs, the transport's "
        f"polls, queueing), {result.communication_share:.0%} in communication (sends, receives, "
        "collectives), the rest in compute and copy kernels"
    )
    lines.append(_theory_line(parallel.schedule, result))
    lines.append(
        "at these stage times: the bubble with each stage's measured kernel time and no time "
        "between kernels (uneven stages raise it above the theory)"
    )
    if result.bubble_steps < result.steps:
        lines.append(
            f"bubbles and kernel times of {result.bubble_steps} simulated steps, which the {result.steps} repeat"
            if result.predicted
            else f"bubble measured over steps {result.bubble_from}-{result.bubble_from + result.bubble_steps - 1} "
            f"({result.bubble_steps} of the {result.steps})"
        )
    lines += [
        "",
        "memory per device: planned (every buffer of every register), held (each register's most buffers at once)",
    ]
    lines += [
        f"  {device}: {nbytes / 2**20:.2f} MiB planned, {result.held_memory.get(device, 0) / 2**20:.2f} MiB held"
        for device, nbytes in sorted(result.memory.items())
    ]
    return "\n".join(lines)


def _theory_line(schedule: str, result: RunResult) -> str:
    if schedule not in ZERO_BUBBLE:
        return "theory: (p-1)/(m+p-1), the bubble of GPipe and 1F1B with even stages"
    f, b, w = (result.passes.get(k, 0.0) * 1e3 for k in ("forward", "backward", "weight"))
    return (
        "theory: ZB-H1's (p-1)(F+B-W) of a step of m(F+B+W) plus that, with F, B, W the measured "
        f"{f:.2f}, {b:.2f}, {w:.2f} ms a micro-batch"
    )


def _steps(config: Config, result: RunResult) -> str:
    if result.first_step:
        last = result.first_step + result.steps
        return f"{result.steps} steps ({result.first_step + 1}-{last} of {config.train.steps})"
    if result.steps == config.train.steps:
        return f"{result.steps} steps"
    return f"{result.steps} of {config.train.steps} steps"


def metrics(config: Config, result: RunResult) -> dict[str, Any]:
    return {
        "predicted": result.predicted,
        "config": config.to_dict(),
        "steps": config.train.steps,
        "first_step": result.first_step,
        "steps_run": result.steps,
        "stopped": result.stopped.text if result.stopped else None,
        "seconds": result.seconds,
        "step_seconds": result.seconds / result.steps,
        "samples_per_second": result.samples_per_second,
        "order": result.ordered_by,
        "staleness": None
        if result.staleness is None
        else {"mean": result.staleness[0], "max": result.staleness[1]},
        "losses": result.losses,
        "lost_workers": list(result.lost),
        "bubble_steps": result.bubble_steps,
        "bubble_from": result.bubble_from,
        "critical_path_handoff_share": result.handoff_share,
        "critical_path_communication_share": result.communication_share,
        "stages": [
            {
                "devices": list(devices),
                "layers": config.stage_layers[s],
                "bubble": result.bubbles[s],
                "bubble_theory": result.theory,
                "bubble_at_stage_times": result.balanced[s] if result.balanced else None,
                "kernel_seconds_per_step": result.kernel_seconds[s] if result.balanced else None,
                "peak_activations": result.peak_activations[s],
            }
            for s, devices in enumerate(config.parallel.stages)
        ],
        "memory": result.memory,
        "held_memory": result.held_memory,
    }
