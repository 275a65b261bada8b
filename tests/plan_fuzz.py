"""Flip every bit of a small serialized Plan and see what each flip does.

``fuzz_sealed``: the bytes as ``to_bytes`` writes them; the digest refuses every flip.
``fuzz_payload``: the msgpack payload inside, flipped and sealed again with a fresh digest,
so the schema and ``plan_check.validate`` meet every flip. A flipped plan that loads is
run, bounded by a short stall timeout and a deadline, and its outcome classified by what
the flip changed (see ``outcome``).

``python tests/plan_fuzz.py`` prints the counts, for this plan and for a pipeline training
plan (several minutes).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import trio

import actorflow as af
from actorflow.errors import CompileError, DeadlockError
from actorflow.ops.gradient_ops import scale
from actorflow.plan_bytes import _converter, _seal, _unseal

STALL_TIMEOUT = 0.5
DEADLINE = 5.0

# What a flip may change and still legitimately change the result: values the plan carries
# but cannot check (a parameter's initial value, an op's numeric attribute).
VALUE_FIELDS = ("parameters", "value"), ("actors", "attrs")


def small_plan() -> af.Plan:
    """A feed, a parameter, a float attribute, two devices (so a copy and two events).
    Short names, and no ``where`` (the user's line, only ever shown in messages), so that
    most flips land in what the runtime acts on."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 3), dtype="float32", device="cpu:0")
        w = af.parameter("w", np.arange(6, dtype=np.float32).reshape(3, 2) / 4, device="cpu:0")
        h = af.ops.relu(scale(af.ops.matmul(x, w, name="m"), 0.5, name="s"), name="r")
        af.output("y", af.ops.to_device(h, "cpu:1", name="c"))
    plan = af.compile(g)
    return attrs.evolve(plan, actors=tuple(attrs.evolve(a, where="") for a in plan.actors))


FEEDS = {"x": (np.arange(6, dtype=np.float32).reshape(2, 3) - 2)}


def training_plan(ranks: int = 1) -> af.Plan:
    """Two pipeline stages, two micro-batches a step (GPipe), SGD with momentum: variables,
    updates, control registers, held parameters and accumulate actors, rates; over ``ranks``
    processes, sends and receives."""
    rng = np.random.default_rng(0)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 3), "float64", "cpu:0")
        labels = af.placeholder("l", (4,), "int64", "cpu:1")
        w1 = af.parameter("w1", rng.standard_normal((3, 4)), "cpu:0")
        w2 = af.parameter("w2", rng.standard_normal((4, 2)), "cpu:1")
        h = af.ops.to_device(af.ops.relu(af.ops.matmul(x, w1, name="m1"), name="r"), "cpu:1", name="c")
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(h, w2, name="m2"), labels, name="ce")
        af.minimize(loss, af.optim.SGD(lr=0.1, momentum=0.9))
        af.output("loss", loss)
    plan = af.compile(g, micro_batches=2, stages=["cpu:0", "cpu:1"], schedule="gpipe", ranks=ranks)
    return attrs.evolve(plan, actors=tuple(attrs.evolve(a, where="") for a in plan.actors))


def training_feeds(steps: int = 2) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((4, 3)), "l": rng.integers(0, 2, 4)} for _ in range(2 * steps)]


def flips(data: bytes) -> Iterator[bytes]:
    """``data`` with one bit flipped, for every bit."""
    buffer = bytearray(data)
    for bit in range(len(data) * 8):
        buffer[bit // 8] ^= 1 << (bit % 8)
        yield bytes(buffer)
        buffer[bit // 8] ^= 1 << (bit % 8)


def rejection(error: af.PlanSerializationError) -> str:
    """Which check refused a flipped plan at load."""
    message = str(error)
    if "digest" in message:
        return "digest"
    if "of format" in message:
        return "envelope (format, keys)"
    if isinstance(error.__cause__, DeadlockError):
        return "deadlock check"
    if isinstance(error.__cause__, CompileError):
        return "consistency"
    if message.startswith("not a valid Plan"):
        return "schema"
    if "cannot import" in message:
        return "function import"
    return "msgpack decode"


def changed_fields(original: Any, flipped: Any, path: tuple = ()) -> list[tuple]:
    """The paths (field names and indices) where two unstructured plans differ."""
    if isinstance(original, dict) and isinstance(flipped, dict):
        keys = original.keys() | flipped.keys()
        return [p for k in keys for p in changed_fields(original.get(k), flipped.get(k), (*path, k))]
    if (
        isinstance(original, (list, tuple))
        and isinstance(flipped, (list, tuple))
        and len(original) == len(flipped)
    ):
        return [
            p for k, (a, b) in enumerate(zip(original, flipped)) for p in changed_fields(a, b, (*path, k))
        ]
    if isinstance(original, np.ndarray) and isinstance(flipped, np.ndarray):
        same = (
            original.shape == flipped.shape
            and original.dtype == flipped.dtype
            and np.array_equal(original, flipped)
        )
        return [] if same else [path]
    if (
        isinstance(original, float)
        and isinstance(flipped, float)
        and math.isnan(original)
        and math.isnan(flipped)
    ):
        return []
    return [] if type(original) is type(flipped) and original == flipped else [path]


def _named_fields(path: tuple) -> tuple:
    return tuple(p for p in path if isinstance(p, str))


def load(data: bytes) -> af.Plan | str:
    """The plan, or which check refused it."""
    try:
        return af.Plan.from_bytes(data, allow=["userfns"])
    except af.PlanSerializationError as e:
        return f"rejected at load: {rejection(e)}"


async def run_bounded(plan: af.Plan, feeds: Any) -> Any:
    """The plan's outputs for ``feeds``, or what it raised; a run that outlasts DEADLINE is
    cancelled (trio.TooSlowError)."""
    try:
        with trio.fail_after(DEADLINE):
            async with af.Runtime(plan, stall_timeout=STALL_TIMEOUT) as rt:
                return await rt.run(feeds)
    except Exception as e:  # noqa: BLE001 - what it raised is the outcome
        return e


def outcome(original: af.Plan, want: Any, plan: af.Plan, got: Any) -> str:
    """How a loaded flipped plan ran: to the original's result; to another result because a
    value changed; to one of actorflow's errors that says the run can't be (a feed that no
    longer fits, a world of more ranks than were launched); or, where an op's attribute
    changed, to its kernel's error with the runtime's note naming the actor (a plan can't
    know what attributes fit its kernels' inputs). Anything else (another exception,
    another result where no value changed, a stall or a hang) is a failure of the checks."""
    if isinstance(got, trio.TooSlowError):
        return "FAILED: hung"
    if isinstance(got, af.StallError):
        return "FAILED: stalled"
    if isinstance(got, af.ActorflowError):
        return f"ran to {type(got).__name__}"
    if not isinstance(got, BaseException) and _results(plan, got) == _results(original, want):
        return "ran equal"
    paths = changed_fields(_unstructure(original), _unstructure(plan))
    value_changed = bool(paths) and all(_named_fields(p)[:2] in VALUE_FIELDS for p in paths)
    if isinstance(got, BaseException):
        named = any(note.startswith("actorflow: raised by actor") for note in getattr(got, "__notes__", ()))
        if value_changed and named:  # e.g. a matmul told to transpose what doesn't fit
            return "ran to a kernel's error naming its actor: an attribute changed"
        return f"FAILED: {type(got).__name__}: {got}"
    if value_changed:
        return "ran different: a value changed"
    return f"FAILED: different result, changed {paths}"


def fuzz(original: af.Plan, flipped: Iterator[bytes], feeds: Any, concurrent: int = 8) -> collections.Counter:
    """Load every flipped form of ``original``; run those that load on ``feeds``,
    ``concurrent`` at a time."""
    want = af.run(original, feeds)
    counts: collections.Counter = collections.Counter()
    loaded = []
    for data in flipped:
        plan = load(data)
        if isinstance(plan, str):
            counts[plan] += 1
        else:
            loaded.append(plan)

    async def main() -> None:
        limit = trio.CapacityLimiter(concurrent)

        async def one(plan: af.Plan) -> None:
            async with limit:
                got = await run_bounded(plan, feeds)
            counts[outcome(original, want, plan, got)] += 1

        async with trio.open_nursery() as nursery:
            for plan in loaded:
                nursery.start_soon(one, plan)

    trio.run(main)
    return counts


def _results(plan: af.Plan, outputs: Any) -> list[tuple]:
    """The outputs (of each iteration) in plan order, by value: a flip that renames an
    output changes no result."""
    arrays = [np.asarray(out[o.name]) for out in _listed(outputs) for o in plan.outputs]
    return [(a.shape, a.dtype.str, a.tobytes()) for a in arrays]


def _listed(outputs: Any) -> list[dict[str, np.ndarray]]:
    return outputs if isinstance(outputs, list) else [outputs]


def _unstructure(plan: af.Plan) -> Any:
    return _converter.unstructure(plan)


def fuzz_sealed(plan: af.Plan, feeds: Any = FEEDS) -> collections.Counter:
    return fuzz(plan, flips(plan.to_bytes()), feeds)


def fuzz_payload(plan: af.Plan, feeds: Any = FEEDS) -> collections.Counter:
    return fuzz(plan, (_seal(data) for data in flips(_unseal(plan.to_bytes()))), feeds)


def table(counts: collections.Counter) -> str:
    width = max(map(len, counts), default=0)
    return "\n".join(f"  {name:<{width}}  {n:>6}" for name, n in sorted(counts.items()))


def load_counts(plan: af.Plan) -> collections.Counter:
    """Load every re-sealed flip of ``plan``'s payload without running it (a plan over
    ranks runs only under a launcher): each is refused or loads, never anything else."""
    loaded = (load(_seal(data)) for data in flips(_unseal(plan.to_bytes())))
    return collections.Counter(p if isinstance(p, str) else "loaded (not run)" for p in loaded)


def main() -> None:
    plan = small_plan()
    sealed = plan.to_bytes()
    payload = _unseal(sealed)
    print(f"small plan ({len(plan.actors)} actors), sealed: {len(sealed)} bytes, {len(sealed) * 8} flips")
    print(table(fuzz_sealed(plan)))
    print(f"small plan, payload re-sealed after each flip: {len(payload) * 8} flips")
    print(table(fuzz_payload(plan)))
    plan = training_plan()
    payload = _unseal(plan.to_bytes())
    print(
        f"pipeline training plan ({len(plan.actors)} actors, 2 steps), payload re-sealed: {len(payload) * 8} flips"
    )
    print(table(fuzz_payload(plan, training_feeds())))
    plan = training_plan(ranks=2)
    payload = _unseal(plan.to_bytes())
    print(
        f"the same over 2 ranks ({len(plan.actors)} actors), payload re-sealed, loaded only: {len(payload) * 8} flips"
    )
    print(table(load_counts(plan)))


if __name__ == "__main__":
    main()
