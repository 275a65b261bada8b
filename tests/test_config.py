"""The training-run config: the baseline loads, overrides apply, and every malformed config
fails before anything runs, with a one-line message that starts with the YAML path."""

import itertools
import json

import attrs
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from actorflow.config import (
    Config,
    OptimizerConfig,
    RuntimeConfig,
    balanced,
    load_config,
    parse_config,
)
from actorflow.errors import ActorflowError, ConfigError

BASELINE_YAML = """\
model: {kind: mlp, sizes: [64, 256, 256, 256, 10], activation: relu}
data: {kind: synthetic_classification, samples: 8192, seed: 0}
train: {steps: 100, batch_size: 256, optimizer: {kind: sgd, lr: 0.05}}
parallel:
  stages: [cpu:0, cpu:1]        # one device per stage, in order
  data_parallel: 1              # replicas per stage (devices = stages x replicas)
  micro_batches: 4
  schedule: 1f1b                # or gpipe
runtime: {quota: 2, priority: true, fusion: true}
output: {metrics: null, trace: null}
"""


def _baseline_without(fragment: str) -> str:
    assert fragment in BASELINE_YAML
    return BASELINE_YAML.replace(fragment, "")


_UNKNOWN_DEVICE = "devices are 'cpu:N' or 'cuda:N' (N = 0, 1, ...)"
_DP3_STAGES = "parallel.stages=[[cpu:0, cpu:1, cpu:2], [cpu:3, cpu:4, cpu:5]]"

# (id, spec, message): spec is a whole YAML document (str) or a tuple of --set overrides
# applied to BASELINE_YAML. Messages about the document as a whole start with its source:
# "<string>" here, the file's path when the document is loaded from a file.
MALFORMED: list[tuple[str, str | tuple[str, ...], str]] = [
    (
        "document-not-mapping",
        "- model\n- data\n",
        (
            "<string>: expected a mapping of sections (data, model, output, parallel, runtime, train), "
            "got ['model', 'data']"
        ),
    ),
    (
        "document-empty",
        "",
        "<string>: expected a mapping of sections (data, model, output, parallel, runtime, train), got None",
    ),
    (
        "yaml-syntax",
        "model: {kind: mlp\ndata: {samples: 1}\n",
        "<string>: invalid YAML at line 2, column 5: expected ',' or '}', but got ':'",
    ),
    (
        "missing-section",
        _baseline_without("train: {steps: 100, batch_size: 256, optimizer: {kind: sgd, lr: 0.05}}\n"),
        "train: required",
    ),
    ("missing-field", _baseline_without("batch_size: 256, "), "train.batch_size: required"),
    (
        "unknown-key",
        ("train.optimizr={kind: sgd, lr: 0.1}",),
        "train.optimizr: unknown key (expected one of: batch_size, log_every, optimizer, steps, steps_per_run, stop_on_nonfinite)",
    ),
    (
        "misspelt-key",
        _baseline_without("batch_size: 256, ").replace("steps: 100", "steps: 100, batchsize: 256"),
        "train.batchsize: unknown key (expected one of: batch_size, log_every, optimizer, steps, steps_per_run, stop_on_nonfinite)",
    ),
    (
        "unknown-section",
        ("logging.level=debug",),
        "logging: unknown key (expected one of: data, model, output, parallel, runtime, train)",
    ),
    ("section-not-mapping", ("train=5",), "train: expected a mapping, got 5"),
    ("int-from-word", ("train.steps=ten",), "train.steps: expected an integer, got 'ten'"),
    ("int-from-bool", ("train.steps=true",), "train.steps: expected an integer, got True"),
    ("int-from-quoted", ("train.steps='3'",), "train.steps: expected an integer, got '3'"),
    ("int-from-float", ("train.batch_size=2.5",), "train.batch_size: expected an integer, got 2.5"),
    ("float-from-word", ("train.optimizer.lr=fast",), "train.optimizer.lr: expected a number, got 'fast'"),
    ("float-nan", ("train.optimizer.lr=.nan",), "train.optimizer.lr: expected a finite number, got nan"),
    ("bool-from-int", ("runtime.fusion=1",), "runtime.fusion: expected true or false, got 1"),
    ("str-from-int", ("output.metrics=3",), "output.metrics: expected a string, got 3"),
    ("list-from-int", ("model.sizes=64",), "model.sizes: expected a list, got 64"),
    ("list-from-str", ("parallel.stages=cpu:0",), "parallel.stages: expected a list, got 'cpu:0'"),
    ("list-entry", ("model.sizes=[64, x, 10]",), "model.sizes[1]: expected an integer, got 'x'"),
    ("model-kind", ("model.kind=cnn",), "model.kind: expected one of mlp, transformer, got 'cnn'"),
    (
        "activation",
        ("model.activation=sigmoid",),
        "model.activation: expected one of relu, tanh, gelu, got 'sigmoid'",
    ),
    ("dtype", ("model.dtype=float16",), "model.dtype: expected one of float32, float64, got 'float16'"),
    (
        "optimizer-kind",
        ("train.optimizer.kind=rmsprop",),
        "train.optimizer.kind: expected one of sgd, adam, got 'rmsprop'",
    ),
    (
        "schedule",
        ("parallel.schedule=zigzag",),
        "parallel.schedule: expected one of gpipe, 1f1b, zb1, zbh1, got 'zigzag'",
    ),
    (
        "sizes-too-few",
        ("model.sizes=[64]",),
        "model.sizes: expected at least 2 sizes (input and output), got [64]",
    ),
    ("size-zero", ("model.sizes=[64, 0, 10]",), "model.sizes[1]: must be >= 1, got 0"),
    ("steps-zero", ("train.steps=0",), "train.steps: must be >= 1, got 0"),
    ("seed-negative", ("data.seed=-1",), "data.seed: must be >= 0, got -1"),
    ("quota-zero", ("runtime.quota=0",), "runtime.quota: must be >= 1, got 0"),
    ("lr-zero", ("train.optimizer.lr=0",), "train.optimizer.lr: must be > 0, got 0.0"),
    ("momentum-one", ("train.optimizer.momentum=1",), "train.optimizer.momentum: must be in [0, 1), got 1.0"),
    (
        "momentum-with-adam",
        ("train.optimizer={kind: adam, lr: 0.001, momentum: 0.9}",),
        "train.optimizer.momentum: only sgd uses momentum, but train.optimizer.kind is adam "
        "(remove it, or --set train.optimizer.momentum=null)",
    ),
    (
        "beta-with-sgd",
        ("train.optimizer.beta1=0.5",),
        "train.optimizer.beta1: only adam uses beta1, but train.optimizer.kind is sgd "
        "(remove it, or --set train.optimizer.beta1=null)",
    ),
    ("samples-below-batch", ("data.samples=100",), "data.samples: 100 is less than train.batch_size 256"),
    (
        "micro-batches",
        ("parallel.micro_batches=3",),
        "parallel.micro_batches: 3 does not divide train.batch_size 256",
    ),
    (
        "replica-share",
        ("parallel.data_parallel=3", _DP3_STAGES),
        (
            "parallel.data_parallel: 3 does not divide the micro-batch size 64 "
            "(train.batch_size 256 / parallel.micro_batches 4): each replica gets an equal share"
        ),
    ),
    ("no-stages", ("parallel.stages=[]",), "parallel.stages: expected at least one stage"),
    (
        "more-stages-than-layers",
        ("parallel.stages=[cpu:0, cpu:1, cpu:2, cpu:3, cpu:4]",),
        "parallel.stages: 5 stages but model.sizes has only 4 layers",
    ),
    (
        "unknown-device",
        ("parallel.stages=[cpu:0, gpu:0]",),
        f"parallel.stages[1]: unknown device 'gpu:0': {_UNKNOWN_DEVICE}",
    ),
    (
        "unknown-replica-device",
        ("parallel.data_parallel=2", "parallel.stages=[[cpu:0, cpu:1], [cpu:2, tpu:3]]"),
        f"parallel.stages[1][1]: unknown device 'tpu:3': {_UNKNOWN_DEVICE}",
    ),
    (
        "stage-not-device",
        ("parallel.stages=[cpu:0, 7]",),
        "parallel.stages[1]: expected a device string or a list of them, got 7",
    ),
    (
        "replicas-need-list",
        ("parallel.data_parallel=2",),
        (
            "parallel.stages[0]: expected a list of 2 devices, one per replica (parallel.data_parallel is 2), "
            "got ['cpu:0']"
        ),
    ),
    (
        "replicas-without-data-parallel",
        ("parallel.stages=[[cpu:0, cpu:1], [cpu:2, cpu:3]]",),
        "parallel.stages[0]: expected one device (parallel.data_parallel is 1), got ['cpu:0', 'cpu:1']",
    ),
    (
        "duplicate-device",
        ("parallel.stages=[cpu:0, cpu:00]",),
        "parallel.stages[1]: device 'cpu:0' is used twice (first in parallel.stages[0])",
    ),
    (
        "partition-length",
        ("parallel.partition=[4]",),
        "parallel.partition: expected one entry per stage (2), got [4]",
    ),
    ("partition-zero", ("parallel.partition=[0, 4]",), "parallel.partition[0]: must be >= 1, got 0"),
    (
        "partition-sum",
        ("parallel.partition=[1, 2]",),
        "parallel.partition: sums to 3 but model.sizes has 4 layers",
    ),
    (
        "set-without-equals",
        ("parallel.micro_batches",),
        "--set parallel.micro_batches: expected dotted.path=value",
    ),
    ("set-empty-key", ("train..steps=1",), "--set train..steps=1: empty key in the path"),
    (
        "set-through-scalar",
        ("train.steps.max=1",),
        "--set train.steps.max: train.steps is 100, not a mapping",
    ),
    (
        "set-bad-yaml",
        ("train.steps=[1,",),
        "--set train.steps: invalid YAML value '[1,': expected the node content, but found '<stream end>'",
    ),
]


def load_case(spec: str | tuple[str, ...]) -> Config:
    """Load one MALFORMED spec the way the cases are meant: text alone, or baseline plus overrides."""
    if isinstance(spec, str):
        return parse_config(spec)
    return parse_config(BASELINE_YAML, spec)


def test_the_baseline_loads_normalised():
    config = parse_config(BASELINE_YAML)
    assert config.model.sizes == (64, 256, 256, 256, 10)
    assert (config.model.kind, config.model.activation, config.model.dtype) == ("mlp", "relu", "float32")
    assert (config.data.samples, config.data.seed) == (8192, 0)
    assert (config.train.steps, config.train.batch_size, config.train.log_every) == (100, 256, 1)
    assert config.train.optimizer == OptimizerConfig(kind="sgd", lr=0.05)
    assert config.parallel.stages == (("cpu:0",), ("cpu:1",))
    assert config.parallel.devices == ("cpu:0", "cpu:1")
    assert (config.parallel.micro_batches, config.parallel.schedule, config.parallel.partition) == (
        4,
        "1f1b",
        None,
    )
    assert config.runtime == RuntimeConfig(quota=2, priority=True, fusion=True)
    assert (config.output.metrics, config.output.trace) == (None, None)
    assert (config.layers, config.features, config.classes) == (4, 64, 10)
    assert (config.micro_batch_size, config.replica_batch_size, config.stage_layers) == (64, 64, (2, 2))


def test_load_config_reads_a_file_with_overrides(tmp_path):
    path = tmp_path / "baseline.yaml"
    path.write_text(BASELINE_YAML)
    assert load_config(path) == parse_config(BASELINE_YAML)
    assert load_config(str(path), ["train.steps=7"]).train.steps == 7


def test_optional_sections_take_their_defaults():
    text = _baseline_without("runtime: {quota: 2, priority: true, fusion: true}\n")
    text = text.replace("output: {metrics: null, trace: null}\n", "")
    config = parse_config(text)
    assert config.runtime == RuntimeConfig()
    assert (config.output.metrics, config.output.trace) == (None, None)


def test_replicas_are_canonical_and_stage_major():
    config = parse_config(
        BASELINE_YAML,
        ["parallel.data_parallel=2", "parallel.stages=[[cpu:00, cpu:1], [cpu:2, ' cpu:3']]"],
    )
    assert config.parallel.stages == (("cpu:0", "cpu:1"), ("cpu:2", "cpu:3"))
    assert config.parallel.devices == ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    assert config.replica_batch_size == 32


def test_stage_layers_balance_cost_unless_partitioned():
    three = ["parallel.stages=[cpu:0, cpu:1, cpu:2]", "model.sizes=[8, 8, 8, 8, 8, 8]"]
    assert sorted(parse_config(BASELINE_YAML, three).stage_layers) == [1, 2, 2]
    assert parse_config(BASELINE_YAML, [*three, "parallel.partition=[1, 1, 3]"]).stage_layers == (1, 1, 3)
    # one wide layer (64 x 64) outweighs three narrow ones (8 x 8 each) together
    wide = ["parallel.stages=[cpu:0, cpu:1]", "model.sizes=[64, 64, 8, 8, 8]"]
    assert parse_config(BASELINE_YAML, wide).stage_layers == (1, 3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.integers(1, 7))
def test_balanced_split_is_optimal(costs, parts):
    parts = min(parts, len(costs))
    lengths = balanced(costs, parts)
    assert len(lengths) == parts and all(n >= 1 for n in lengths) and sum(lengths) == len(costs)

    def worst(cut):
        bounds = [0, *itertools.accumulate(cut)]
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

    every_split = (
        [b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))]
        for cuts in itertools.combinations(range(1, len(costs)), parts - 1)
    )
    assert worst(lengths) == min(worst(cut) for cut in every_split)


def test_to_dict_round_trips_through_json_and_yaml():
    overrides = [
        "train.optimizer={kind: adam, lr: 0.001, beta2: 0.99}",
        "parallel.data_parallel=2",
        "parallel.stages=[[cpu:0, cpu:1], [cpu:2, cpu:3]]",
        "parallel.partition=[3, 1]",
        "runtime={link_bandwidth: 1.0e+9, link_latency: 0.00001}",
        "output.metrics=out/metrics.json",
    ]
    for config in (parse_config(BASELINE_YAML), parse_config(BASELINE_YAML, overrides)):
        plain = config.to_dict()
        assert parse_config(plain) == config
        assert parse_config(json.loads(json.dumps(plain))) == config
        assert parse_config(yaml.safe_dump(plain)) == config


def test_overrides_set_scalars_lists_and_whole_sections():
    config = parse_config(
        BASELINE_YAML,
        [
            "parallel.micro_batches=8",
            "parallel.schedule=gpipe",
            "parallel.stages=[cpu:1,cpu:0]",
            "train.optimizer.momentum=0.9",
            "data={samples: 512, seed: 3}",
            "train.steps=5",
            "train.steps=6",
        ],
    )
    assert (config.parallel.micro_batches, config.parallel.schedule) == (8, "gpipe")
    assert config.parallel.stages == (("cpu:1",), ("cpu:0",))
    assert config.train.optimizer.momentum == 0.9
    assert (config.data.samples, config.data.seed) == (512, 3)
    assert config.train.steps == 6  # the last override wins


@pytest.mark.parametrize(
    ("text", "value"), [("1e-3", 1e-3), ("2E-2", 2e-2), ("5e1", 50.0), ("1.5e-3", 1.5e-3)]
)
def test_exponent_floats_read_as_numbers_in_files_and_overrides(text, value):
    in_file = BASELINE_YAML.replace("lr: 0.05", f"lr: {text}")
    assert in_file != BASELINE_YAML
    assert parse_config(in_file).train.optimizer.lr == value
    assert parse_config(BASELINE_YAML, [f"train.optimizer.lr={text}"]).train.optimizer.lr == value


def test_an_override_of_kind_drops_the_keys_only_another_kind_takes_and_says_so():
    told: list[str] = []
    momentum = "train.optimizer.momentum=0.9"
    config = parse_config(BASELINE_YAML, [momentum, "train.optimizer.kind=adam"], tell=told.append)
    assert (config.train.optimizer.kind, config.train.optimizer.momentum) == ("adam", 0.0)
    assert told == [
        "--set train.optimizer.kind=adam: dropped train.optimizer.momentum, which adam does not take"
    ]
    told.clear()
    config = parse_config(BASELINE_YAML, [momentum, "train.optimizer.kind=sgd"], tell=told.append)
    assert config.train.optimizer.momentum == 0.9
    assert told == []


def test_a_null_override_resets_a_key_to_its_default():
    config = parse_config(BASELINE_YAML, ["train.optimizer.momentum=null", "runtime.quota=null"])
    assert (config.train.optimizer.momentum, config.runtime.quota) == (0.0, 2)
    with pytest.raises(ConfigError, match="train.optimizer.lr"):
        parse_config(BASELINE_YAML, ["train.optimizer.lr=null"])


def test_overrides_create_omitted_sections_and_leave_the_input_alone():
    raw = yaml.safe_load(_baseline_without("runtime: {quota: 2, priority: true, fusion: true}\n"))
    before = json.dumps(raw)
    assert parse_config(raw, ["runtime.quota=4", "train.optimizer.lr=0.5"]).runtime.quota == 4
    assert json.dumps(raw) == before


@pytest.mark.parametrize(
    ("spec", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_configs_fail_with_one_line(spec, message):
    with pytest.raises(ConfigError) as caught:
        load_case(spec)
    assert "\n" not in str(caught.value)
    assert str(caught.value) == message


def test_malformed_cases_have_unique_ids():
    ids = [case[0] for case in MALFORMED]
    assert len(ids) == len(set(ids)) >= 14


def test_file_problems_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert str(caught.value) == f"{missing}: cannot read: No such file or directory"
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {kind: mlp\ndata: {samples: 1}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(broken)
    assert (
        str(caught.value) == f"{broken}: invalid YAML at line 2, column 5: expected ',' or '}}', but got ':'"
    )


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ActorflowError) and issubclass(ConfigError, ValueError)


def test_configs_are_frozen():
    config = parse_config(BASELINE_YAML)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.train.steps = 1  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 48), micro_batches=st.integers(1, 8), replicas=st.integers(1, 4))
def test_batches_load_iff_every_replica_gets_an_equal_share(batch, micro_batches, replicas):
    stages = [[f"cpu:{stage * replicas + r}" for r in range(replicas)] for stage in range(2)]
    raw = {
        "model": {"sizes": [4, 8, 3]},
        "data": {"samples": 64},
        "train": {"steps": 1, "batch_size": batch, "optimizer": {"lr": 0.1}},
        "parallel": {"stages": stages, "data_parallel": replicas, "micro_batches": micro_batches},
    }
    if batch % micro_batches == 0 and batch // micro_batches % replicas == 0:
        config = parse_config(raw)
        assert config.replica_batch_size * replicas * micro_batches == batch
    else:
        with pytest.raises(
            ConfigError, match=r"^parallel\.(micro_batches|data_parallel): \d+ does not divide "
        ):
            parse_config(raw)
