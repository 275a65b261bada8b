"""The training-run config behind ``actorflow run configs/NAME.yaml``.

Loading goes in four steps, and nothing runs until all of them pass: PyYAML's safe
loader reads the file (numbers as YAML 1.2 reads them, so ``1e-3`` is one); each ``--set
dotted.path=value`` override replaces a value in the raw mapping; cattrs structures the
mapping into the frozen classes below (types, unknown and missing keys); plain functions
check what types can't say (ranges, divisibility, devices).
Every problem is a ConfigError whose message is one line starting with the dotted YAML
path (``parallel.stages[1]: ...``), or with the file for whole-document problems.
"""

import functools
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NewType, get_args, get_origin

import attrs
import cattrs
import yaml
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from .devices import parse_device
from .errors import ConfigError
from .plan import DEFAULT_RESOURCES
from .text import count
from .world import LOST_AFTER

Device = NewType("Device", str)
"""A canonical device name: structuring runs the YAML string through parse_device."""

Stage = NewType("Stage", tuple[Device, ...])
"""One pipeline stage's devices, one per data-parallel replica; the YAML may give a lone
device string, which becomes a 1-tuple."""


@attrs.frozen(kw_only=True)
class ModelConfig:
    """mlp: one dense layer between each pair of neighbouring sizes, with activation.
    transformer: a decoder-only (GPT) character model: token and position embeddings,
    ``layers`` blocks of causal self-attention (``heads`` heads) and a GELU MLP (4 x
    d_model wide), each behind a layer norm with a residual, a final layer norm and a
    projection onto the ``vocab`` characters, over sequences of ``seq_len``."""

    kind: Literal["mlp", "transformer"] = "mlp"
    sizes: tuple[int, ...] = ()
    activation: Literal["relu", "tanh", "gelu"] = "relu"
    vocab: int = 0
    d_model: int = 0
    heads: int = 0
    layers: int = 0
    seq_len: int = 0
    dtype: Literal["float32", "float64"] = "float32"


@attrs.frozen(kw_only=True)
class DataConfig:
    """synthetic_classification (for the mlp): samples from a random linear teacher;
    text (for the transformer): samples windows of model.seq_len + 1 characters of the
    UTF-8 file at ``path`` (default: the short text shipped with actorflow), each
    character predicting the next; ``path`` must be a regular file of at most 1 GiB
    (``training.data.MAX_TEXT_BYTES``), read once into about twice its size (its bytes,
    and an id a character in the smallest integer type the vocabulary fits);
    npy (for the mlp): the first ``samples`` rows of the .npy files at ``x`` (rows,
    model.sizes[0]) of model.dtype and ``labels`` (rows,) of int64 classes below
    model.sizes[-1], memory-mapped: each rank reads only the rows its devices are fed,
    and lets go of them once fed."""

    kind: Literal["synthetic_classification", "text", "npy"] = "synthetic_classification"
    samples: int
    seed: int = 0
    path: str | None = None
    x: str | None = None
    labels: str | None = None


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """sgd reads lr and momentum; adam reads lr, beta1, beta2 and eps. shard,
    shard_threshold_kb and gradient_accumulation_shard: optimizer parallel over the
    data-parallel replicas (``af.minimize``'s options of the same names)."""

    kind: Literal["sgd", "adam"] = "sgd"
    lr: float
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    shard: bool = False
    shard_threshold_kb: float = 64
    gradient_accumulation_shard: bool = True


@attrs.frozen(kw_only=True)
class TrainConfig:
    """stop_on_nonfinite: end the run at the step whose loss is NaN or infinite (exit 1).
    steps_per_run: steps given to one ``Session.run`` (without asynchronous parameter
    servers, which give 16): the host queues a step while the devices still run the one
    before, instead of all of them waiting at each step's end. The losses reach
    ``on_step``, and a Ctrl-C or a loss that is not finite stops the training, once the
    run's steps are done."""

    steps: int
    batch_size: int
    optimizer: OptimizerConfig
    log_every: int = 1
    stop_on_nonfinite: bool = True
    steps_per_run: int = 4


@attrs.frozen(kw_only=True)
class ParameterServerConfig:
    """Parameter-server training (see ``training.parameter_server``): the stages'
    data-parallel replicas are the workers, ``servers`` more devices (and ranks) hold the
    parameters and the optimizer state and run the updates. ``mode``: sync (a server
    updates once it has every worker's gradient of the step: data-parallel training) or
    async (each worker's gradient as it arrives, a worker at most ``staleness`` steps
    ahead of the parameters it last pulled)."""

    servers: int = 1
    mode: Literal["sync", "async"] = "sync"
    staleness: int = 0


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """stages[i] holds stage i's devices, data_parallel x tensor_parallel of them (each
    tensor-parallel group k consecutive devices); partition, if given, holds each
    stage's number of layers (transformer blocks); recompute: true to recompute every
    stage's layers in the backward pass instead of keeping their activations
    (``af.recompute``), or one flag per stage."""

    stages: tuple[Stage, ...]
    data_parallel: int = 1
    tensor_parallel: int = 1
    micro_batches: int = 1
    schedule: Literal["gpipe", "1f1b", "zb1", "zbh1"] = "1f1b"
    partition: tuple[int, ...] | None = None
    recompute: bool | tuple[bool, ...] = False
    parameter_server: ParameterServerConfig | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device, stage-major: all of stage 0's replicas first."""
        return tuple(device for stage in self.stages for device in stage)

    @property
    def recomputed(self) -> tuple[bool, ...]:
        """Per stage, whether its layers are recomputed."""
        if isinstance(self.recompute, bool):
            return (self.recompute,) * len(self.stages)
        return self.recompute


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """The keyword arguments of ``actorflow.compiler.compile`` of the same names
    (link_bandwidth in bytes/s, None for no link emulation; link_latency in seconds;
    the device resource model: max_streams, max_ops_per_stream, max_labels, and
    max_memory in bytes per device, None for what the machine has available;
    comm_reuse: communication subgraph reuse, -1 or a positive limit for on, None for
    off, where ACTORFLOW_COMM_REUSE, when set, wins); and ``order`` and ``lost_after``,
    the Runtime's (replay each stream's simulated order, or decide every act as the run
    goes; over ranks, the seconds of silence after which a rank counts as lost)."""

    quota: int = 2
    priority: bool = True
    fusion: bool = True
    fuse_kernels: bool = True
    link_bandwidth: float | None = None
    link_latency: float = 0.0
    max_streams: int = DEFAULT_RESOURCES.max_streams
    max_ops_per_stream: int = DEFAULT_RESOURCES.max_ops_per_stream
    max_labels: int = DEFAULT_RESOURCES.max_labels
    max_memory: int | None = None
    comm_reuse: int | None = None
    order: Literal["replay", "dynamic"] = "replay"
    lost_after: float = LOST_AFTER


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """A checkpoint of the run in the folder ``path`` every ``every`` steps and at the
    run's end (see ``training.checkpoint``); ``actorflow run --resume PATH`` goes on from it."""

    path: str
    every: int


@attrs.frozen(kw_only=True)
class OutputConfig:
    """Paths to write the metrics JSON, the Chrome trace and the trained parameters
    (``.npz``, by name) to; None writes none."""

    metrics: str | None = None
    trace: str | None = None
    parameters: str | None = None
    checkpoint: CheckpointConfig | None = None


@attrs.frozen(kw_only=True)
class Config:
    """A whole training run; build it with load_config or parse_config, which validate it."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig
    runtime: RuntimeConfig = RuntimeConfig()
    output: OutputConfig = OutputConfig()

    @property
    def layers(self) -> int:
        """Dense layers of the mlp, blocks of the transformer: what stages split."""
        return self.model.layers if self.model.kind == "transformer" else len(self.model.sizes) - 1

    @property
    def features(self) -> int:
        return self.model.sizes[0]

    @property
    def classes(self) -> int:
        return self.model.sizes[-1]

    @property
    def micro_batch_size(self) -> int:
        return self.train.batch_size // self.parallel.micro_batches

    @property
    def replica_batch_size(self) -> int:
        """Rows of a micro-batch that each data-parallel replica of a stage gets."""
        return self.micro_batch_size // self.parallel.data_parallel

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers per stage: parallel.partition if given, else balanced by cost: the split
        whose costliest stage costs least. A layer's forward costs fan_in x fan_out
        multiply-adds, and so does each gradient its backward computes: of the weights,
        and of the input for every layer but the first."""
        if self.parallel.partition is not None:
            return self.parallel.partition
        if self.model.kind == "transformer":
            return balanced([1] * self.layers, len(self.parallel.stages))
        sizes = self.model.sizes
        costs = [a * b * (2 if k == 0 else 3) for k, (a, b) in enumerate(zip(sizes, sizes[1:]))]
        return balanced(costs, len(self.parallel.stages))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, numbers, bools, None) that parse_config reads back."""
        return _CONVERTER.unstructure(self)


def balanced(costs: Sequence[int], parts: int) -> tuple[int, ...]:
    """Cut ``costs`` into ``parts`` non-empty runs, minimising the largest run's sum;
    returns the run lengths (ties: the earliest cuts)."""

    @functools.cache
    def best(start: int, left: int) -> tuple[int, tuple[int, ...]]:
        if left == 1:
            return sum(costs[start:]), (len(costs) - start,)
        options = []
        for end in range(start + 1, len(costs) - left + 2):
            rest, lengths = best(end, left - 1)
            options.append((max(sum(costs[start:end]), rest), (end - start, *lengths)))
        return min(options, key=lambda o: o[0])

    return best(0, parts)[1]


def load_config(
    path: str | os.PathLike[str], overrides: Sequence[str] = (), tell: Callable[[str], None] = lambda _: None
) -> Config:
    """Read, override (``dotted.path=value`` each) and validate the YAML config at ``path``;
    ``tell`` hears what an override dropped (see ``_override``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeError) as err:
        raise _fail(str(path), f"cannot read: {getattr(err, 'strerror', None) or err}") from None
    return parse_config(text, overrides, source=str(path), tell=tell)


def parse_config(
    document: str | Mapping[str, Any],
    overrides: Sequence[str] = (),
    source: str = "<string>",
    tell: Callable[[str], None] = lambda _: None,
) -> Config:
    """Validate a config given as YAML text or as an already-loaded mapping (which is not
    modified), after applying ``overrides``; ``source`` names the text in errors about
    the document as a whole."""
    raw = _load_yaml(document, source) if isinstance(document, str) else document
    if not isinstance(raw, Mapping):
        raise _fail(source, f"expected a mapping of sections ({_names(Config)}), got {_shown(raw)}")
    for override in overrides:
        raw = _override(raw, override, tell)
    config = _structure(raw)
    _check(config)
    return config


def _fail(path: str, problem: str) -> ConfigError:
    return ConfigError(f"{path}: {problem}")


def _shown(value: Any) -> str:
    """A value for a message: its repr, abbreviated so the message stays one short line."""
    return reprlib.repr(value)


def _names(cls: type) -> str:
    return ", ".join(sorted(field.name for field in attrs.fields(cls)))


# -- YAML and overrides ------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does: PyYAML follows YAML 1.1,
    where ``1e-3`` and ``2E5`` (no dot, or no exponent sign) are strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return _safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise _fail(source, f"invalid YAML{where}: {_yaml_problem(err)}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    return getattr(err, "problem", None) or str(err).partition("\n")[0]


def _override(raw: Mapping[str, Any], override: str, tell: Callable[[str], None]) -> dict[str, Any]:
    """``raw`` with the override's value put at its path; mappings missing on the way are
    created, so an unknown key fails later exactly as one written in the file. A null
    value removes the key, which resets it to its default; a new ``kind`` drops the
    section's keys that only another kind takes (``tell`` says which)."""
    path, equals, text = override.partition("=")
    path = path.strip()
    if not equals:
        raise _fail(f"--set {override}", "expected dotted.path=value")
    keys = [key.strip() for key in path.split(".")]
    if "" in keys:
        raise _fail(f"--set {override}", "empty key in the path")
    try:
        value = _safe_load(text)
    except yaml.YAMLError as err:
        raise _fail(f"--set {path}", f"invalid YAML value {text!r}: {_yaml_problem(err)}") from None
    node: Any = raw
    for depth, key in enumerate(keys[:-1]):
        node = node.get(key, {})
        if not isinstance(node, Mapping):
            raise _fail(f"--set {path}", f"{'.'.join(keys[: depth + 1])} is {_shown(node)}, not a mapping")
    section = ".".join(keys[:-1])
    if keys[-1] == "kind" and isinstance(value, str) and value in _ONLY_FOR.get(section, {}):
        others = {name for kind, names in _ONLY_FOR[section].items() if kind != value for name in names}
        dropped = [key for key in node if key in others]
        for key in dropped:
            raw = _replaced(raw, [*keys[:-1], key], None)
        if dropped:
            tell(
                f"--set {path}={text}: dropped {', '.join(f'{section}.{k}' for k in dropped)}, which {value} does not take"
            )
    return _replaced(raw, keys, value)


def _replaced(mapping: Mapping[str, Any], keys: Sequence[str], value: Any) -> dict[str, Any]:
    """``mapping`` with ``value`` at ``keys``; a None value removes the key."""
    key, *rest = keys
    if rest:
        return {**mapping, key: _replaced(mapping.get(key, {}), rest, value)}
    if value is None:
        return {k: v for k, v in mapping.items() if k != key}
    return {**mapping, key: value}


# -- structuring: types, unknown and missing keys ----------------------------------------


def _structure_int(value: Any, _: type) -> int:
    if type(value) is not int:  # not bool: YAML's true is no count
        raise TypeError(f"expected an integer, got {_shown(value)}")
    return value


def _structure_float(value: Any, _: type) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"expected a number, got {_shown(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {_shown(value)}")
    return float(value)


def _structure_bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected true or false, got {_shown(value)}")
    return value


def _structure_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_shown(value)}")
    return value


def _structure_choice(value: Any, literal: Any) -> Any:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}, got {_shown(value)}")
    return value


def _is_homogeneous_tuple(cls: Any) -> bool:
    return get_origin(cls) is tuple and len(get_args(cls)) == 2 and get_args(cls)[1] is Ellipsis


def _list_hook(cls: Any, converter: cattrs.Converter) -> Callable[[Any, Any], tuple]:
    """cattrs' own tuple hook, but only for a list: it would split a string into items."""
    structure_items = homogenous_tuple_structure_factory(cls, converter)

    def structure(value: Any, _: Any) -> tuple:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {_shown(value)}")
        return structure_items(value, cls)

    return structure


def _mapping_hook(cls: type[Any], converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """cattrs' own attrs-class hook, but with a clear message when the value isn't a mapping."""
    structure_fields = make_dict_structure_fn(cls, converter)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping, got {_shown(value)}")
        return structure_fields(value, cls)

    return structure


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook_func(lambda cls: get_origin(cls) is Literal, _structure_choice)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _list_hook)
    converter.register_structure_hook_factory(attrs.has, _mapping_hook)
    converter.register_structure_hook(Device, lambda value, _: parse_device(value))

    def structure_stage(value: Any, _: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return (parse_device(value),)
        if isinstance(value, list | tuple):
            return converter.structure(value, tuple[Device, ...])
        raise TypeError(f"expected a device string or a list of them, got {_shown(value)}")

    converter.register_structure_hook(Stage, structure_stage)

    def structure_flags(value: Any, _: Any) -> bool | tuple[bool, ...]:
        if isinstance(value, list | tuple):
            return converter.structure(value, tuple[bool, ...])
        return _structure_bool(value, bool)

    converter.register_structure_hook_func(lambda cls: cls == bool | tuple[bool, ...], structure_flags)
    return converter


_CONVERTER = _make_converter()


def _structure(raw: Mapping[str, Any]) -> Config:
    try:
        return _CONVERTER.structure(raw, Config)
    except ClassValidationError as err:
        problems = list(_problems(err, ""))
        # A misspelt key also leaves the intended one missing: name the misspelling first.
        problems.sort(key=lambda problem: not isinstance(problem[1], ForbiddenExtraKeysError))
        raise _as_config_error(*problems[0]) from None


def _problems(err: BaseException, path: str) -> Iterator[tuple[str, BaseException]]:
    """Each leaf of cattrs' nested validation errors, with its dotted path, in field order."""
    if not isinstance(err, ClassValidationError | IterableValidationError):
        yield path, err
        return
    located, unlocated = err.group_exceptions()
    for sub, note in located:
        if isinstance(note, IterableValidationNote):
            yield from _problems(sub, f"{path}[{note.index}]")
        else:
            yield from _problems(sub, _key_path(path, note.name))
    for sub in unlocated:
        yield from _problems(sub, path)


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _as_config_error(path: str, err: BaseException) -> ConfigError:
    if isinstance(err, ForbiddenExtraKeysError):
        key = min(map(str, err.extra_fields))
        return _fail(_key_path(path, key), f"unknown key (expected one of: {_names(err.cl)})")
    if isinstance(err, KeyError):  # how cattrs reports a missing field
        return _fail(path, "required")
    return _fail(path, str(err))


# -- checks beyond types --------------------------------------------------------------


def _check(config: Config) -> None:
    """Values first, section by section; then the rules that tie sections together."""
    _check_values(config)
    _check_data(config)
    _check_kind_keys("train.optimizer", config.train.optimizer)
    _check_batching(config)
    _check_stages(config)
    _check_partition(config)
    _check_recompute(config.parallel)
    _check_parameter_server(config)


def _at_least(path: str, value: float, low: float) -> None:
    if value < low:
        raise _fail(path, f"must be >= {low}, got {value!r}")


def _above(path: str, value: float, low: float) -> None:
    if not value > low:
        raise _fail(path, f"must be > {low}, got {value!r}")


def _fraction(path: str, value: float) -> None:
    if not 0 <= value < 1:
        raise _fail(path, f"must be in [0, 1), got {value!r}")


def _check_values(config: Config) -> None:
    model, data, train, parallel, runtime = (
        config.model,
        config.data,
        config.train,
        config.parallel,
        config.runtime,
    )
    _check_model(model)
    _at_least("data.samples", data.samples, 1)
    _at_least("data.seed", data.seed, 0)
    _at_least("train.steps", train.steps, 1)
    _at_least("train.batch_size", train.batch_size, 1)
    _above("train.optimizer.lr", train.optimizer.lr, 0)
    _fraction("train.optimizer.momentum", train.optimizer.momentum)
    _fraction("train.optimizer.beta1", train.optimizer.beta1)
    _fraction("train.optimizer.beta2", train.optimizer.beta2)
    _above("train.optimizer.eps", train.optimizer.eps, 0)
    _at_least("train.optimizer.shard_threshold_kb", train.optimizer.shard_threshold_kb, 0)
    if train.optimizer.shard and parallel.data_parallel == 1:
        raise _fail(
            "train.optimizer.shard", "shards over data-parallel replicas: needs parallel.data_parallel > 1"
        )
    _at_least("train.log_every", train.log_every, 1)
    _at_least("train.steps_per_run", train.steps_per_run, 1)
    _at_least("parallel.data_parallel", parallel.data_parallel, 1)
    _at_least("parallel.tensor_parallel", parallel.tensor_parallel, 1)
    _at_least("parallel.micro_batches", parallel.micro_batches, 1)
    for i, layers in enumerate(parallel.partition or ()):
        _at_least(f"parallel.partition[{i}]", layers, 1)
    _at_least("runtime.quota", runtime.quota, 1)
    if runtime.link_bandwidth is not None:
        _above("runtime.link_bandwidth", runtime.link_bandwidth, 0)
    _at_least("runtime.link_latency", runtime.link_latency, 0)
    _above("runtime.lost_after", runtime.lost_after, 0)
    for name in ("max_streams", "max_ops_per_stream", "max_labels"):
        _at_least(f"runtime.{name}", getattr(runtime, name), 1)
    if runtime.max_memory is not None:
        _at_least("runtime.max_memory", runtime.max_memory, 1)
    if config.output.checkpoint is not None:
        _at_least("output.checkpoint.every", config.output.checkpoint.every, 1)


_ONLY_FOR = {
    "model": {
        "mlp": ("sizes", "activation"),
        "transformer": ("vocab", "d_model", "heads", "layers", "seq_len"),
    },
    "train.optimizer": {"sgd": ("momentum",), "adam": ("beta1", "beta2", "eps")},
}
"""Per section with a ``kind``, the keys only one kind takes: a key of another kind than
the section's is refused unless left at its default, and ``--set SECTION.kind=K`` drops
them."""


def _check_kind_keys(section: str, value: Any) -> None:
    """A key only another kind than ``value.kind`` takes is a mistake, unless it is left at
    its default (see ``_ONLY_FOR``)."""
    fields = attrs.fields_dict(type(value))
    for kind, names in _ONLY_FOR[section].items():
        for name in names:
            if kind != value.kind and getattr(value, name) != fields[name].default:
                raise _fail(
                    f"{section}.{name}",
                    f"only {kind} uses {name}, but {section}.kind is {value.kind} "
                    f"(remove it, or --set {section}.{name}=null)",
                )


def _check_model(model: ModelConfig) -> None:
    _check_kind_keys("model", model)
    if model.kind == "mlp":
        if len(model.sizes) < 2:
            raise _fail(
                "model.sizes", f"expected at least 2 sizes (input and output), got {list(model.sizes)}"
            )
        for i, size in enumerate(model.sizes):
            _at_least(f"model.sizes[{i}]", size, 1)
        return
    for name in _ONLY_FOR["model"]["transformer"]:
        if getattr(model, name) == 0:
            raise _fail(f"model.{name}", "required for model.kind transformer")
        _at_least(f"model.{name}", getattr(model, name), 1)
    if model.d_model % model.heads:
        raise _fail("model.heads", f"{model.heads} does not divide model.d_model {model.d_model}")


def _check_data(config: Config) -> None:
    data = config.data
    wanted = ("text",) if config.model.kind == "transformer" else ("synthetic_classification", "npy")
    if data.kind not in wanted:
        raise _fail(
            "data.kind", f"model.kind {config.model.kind} trains on {' or '.join(wanted)}, got {data.kind}"
        )
    if data.path is not None and data.kind != "text":
        raise _fail("data.path", "only text data reads data.path")
    for key in ("x", "labels"):
        if (getattr(data, key) is None) == (data.kind == "npy"):
            raise _fail(
                f"data.{key}", "required for npy data" if data.kind == "npy" else "only npy data reads it"
            )


def _check_batching(config: Config) -> None:
    samples, batch = config.data.samples, config.train.batch_size
    micro_batches, replicas = config.parallel.micro_batches, config.parallel.data_parallel
    if samples < batch:
        raise _fail("data.samples", f"{samples} is less than train.batch_size {batch}")
    if batch % micro_batches:
        raise _fail("parallel.micro_batches", f"{micro_batches} does not divide train.batch_size {batch}")
    if config.micro_batch_size % replicas:
        raise _fail(
            "parallel.data_parallel",
            f"{replicas} does not divide the micro-batch size {config.micro_batch_size} "
            f"(train.batch_size {batch} / parallel.micro_batches {micro_batches}): "
            "each replica gets an equal share",
        )


def _check_stages(config: Config) -> None:
    parallel, layers = config.parallel, config.layers
    stages, replicas, tp = parallel.stages, parallel.data_parallel, parallel.tensor_parallel
    if not stages:
        raise _fail("parallel.stages", "expected at least one stage")
    if len(stages) > layers:
        raise _fail(
            "parallel.stages",
            f"{len(stages)} stages but {_layers_of(config)} has only {count(layers, 'layer')}",
        )
    if tp > 1 and config.model.kind != "transformer":
        raise _fail("parallel.tensor_parallel", "only the transformer model splits its layers over devices")
    if tp > 1 and replicas > 1 and config.train.optimizer.shard:
        raise _fail("train.optimizer.shard", "not with tensor and data parallelism at once")
    if config.model.heads % tp:
        raise _fail("parallel.tensor_parallel", f"{tp} does not divide model.heads {config.model.heads}")
    per_stage = replicas * tp
    if per_stage == 1:
        wanted = "one device"
    elif tp == 1:
        wanted = f"a list of {replicas} devices, one per replica"
    else:
        wanted = f"a list of {per_stage} devices, one per tensor-parallel part"
    first_use: dict[str, int] = {}
    for i, stage in enumerate(stages):
        path = f"parallel.stages[{i}]"
        if len(stage) != per_stage:
            counts = f"parallel.data_parallel is {replicas}" + (f", tensor_parallel {tp}" if tp > 1 else "")
            raise _fail(path, f"expected {wanted} ({counts}), got {list(stage)}")
        for device in stage:
            if device in first_use:
                raise _fail(
                    path, f"device {device!r} is used twice (first in parallel.stages[{first_use[device]}])"
                )
            first_use[device] = i


def _layers_of(config: Config) -> str:
    return "model.layers" if config.model.kind == "transformer" else "model.sizes"


def _check_partition(config: Config) -> None:
    partition, stages, layers = config.parallel.partition, len(config.parallel.stages), config.layers
    if partition is None:
        return
    if len(partition) != stages:
        raise _fail("parallel.partition", f"expected one entry per stage ({stages}), got {list(partition)}")
    if sum(partition) != layers:
        raise _fail(
            "parallel.partition",
            f"sums to {sum(partition)} but {_layers_of(config)} has {count(layers, 'layer')}",
        )


def _check_recompute(parallel: ParallelConfig) -> None:
    flags, stages = parallel.recompute, len(parallel.stages)
    if not isinstance(flags, bool) and len(flags) != stages:
        raise _fail(
            "parallel.recompute", f"expected true, false or one flag per stage ({stages}), got {list(flags)}"
        )


def _check_parameter_server(config: Config) -> None:
    ps = config.parallel.parameter_server
    if ps is None:
        return
    _at_least("parallel.parameter_server.servers", ps.servers, 1)
    _at_least("parallel.parameter_server.staleness", ps.staleness, 0)
    if ps.staleness and ps.mode == "sync":
        raise _fail("parallel.parameter_server.staleness", "only async mode lets a worker run ahead")
    if config.model.kind != "mlp":
        raise _fail("parallel.parameter_server", "only the mlp model trains with parameter servers")
    if config.train.optimizer.shard:
        raise _fail("train.optimizer.shard", "the parameter servers hold the optimizer state; not with shard")
    if ps.servers > 2 * config.layers:
        raise _fail(
            "parallel.parameter_server.servers",
            f"{ps.servers} servers but the model has {2 * config.layers} parameters to spread over them",
        )
