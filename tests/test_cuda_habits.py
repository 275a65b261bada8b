"""Seed 004's kernel habits (``ops.cuda_habits``): on the CPU, the CUDA code a fused
chain becomes (its text, which chains are refused, and its arithmetic, compiled for the
host with a C++ compiler and run against the parts one by one), that every CUDA source
compiles (nvcc, where found), the compiler pass that picks the fused kernel, and the
numpy references of the mask and gather kernels; on a GPU (marker ``gpu``), each habit
against its plain version."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest

import actorflow as af
from actorflow.compiler.chains import cuda_chains
from actorflow.ops import cuda_habits as habits
from actorflow.ops import gradient_kernels as grads
from actorflow.ops import kernels
from actorflow.ops.chain import chain
from actorflow.ops.micro_batch import accumulate
from actorflow.plan import Plan


def _gpu_unavailable() -> str | None:
    """Why the GPU tests can't run here, or None (the runtime's own answer where this
    tree has it)."""
    try:
        from actorflow.runtime.cuda import unavailable
    except ImportError:
        pass
    else:
        return unavailable()
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU found"
    except Exception as exc:  # ImportError, or CuPy's CUDARuntimeError without a driver
        return f"CuPy or a CUDA GPU is unavailable ({type(exc).__name__}: {exc})"
    return None


GPU_REASON = _gpu_unavailable()


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")(test))


def part(kernel, sources, target, attrs=None, phased=False):
    return (
        kernel,
        attrs or {},
        tuple(sources),
        (target,),
        phased,
        kernel.__name__,
        "tests/test_cuda_habits.py",
    )


# name: (parts, the fused actor's input shapes, output shapes, written, micro-batches)
# (written None: all; micro-batches: acts of a phased chain, one per phase)
B, N = 8, 33
CHAINS = {
    "bias_gelu": (
        (part(kernels.add, (0, 1), 0), part(kernels.gelu, (~0,), 1)),
        [(B, N), (N,)],
        [(B, N), (B, N)],
        None,
        1,
    ),
    "forward_last_only": (
        (
            part(kernels.mul, (0, 1), 0),
            part(kernels.add, (~0, 2), 1),
            part(kernels.tanh, (~1,), 2),
            part(grads.scale, (~2,), 3, {"factor": -0.75}),
            part(kernels.exp, (~3,), 4),
            part(kernels.sub, (~4, 0), 5),
            part(kernels.relu, (~5,), 6),
            part(kernels.log, (~4,), 7),
        ),
        [(B, N), (B, N), (N,)],
        [(B, N)] * 8,
        [6, 7],
        1,
    ),
    "backward": (
        (
            part(grads.gelu_grad, (0, 1), 0),
            part(grads.relu_grad, (~0, 2), 1),
            part(grads.tanh_grad, (~1, 3), 2),
            part(kernels.div, (~2, 4), 3),
        ),
        [(B, N)] * 5,
        [(B, N)] * 4,
        [3],
        1,
    ),
    "gradient_accumulated": (
        (
            part(grads.gelu_grad, (0, 1), 0),
            part(grads.scale, (~0,), 1, {"factor": 2.0}),
            part(accumulate, (~1,), 2, {"micro_batches": 3}, phased=True),
        ),
        [(B, N), (B, N)],
        [(B, N)] * 3,
        [],
        3,
    ),
    "broadcast_mask": (
        (
            part(grads.broadcast_to, (0,), 0),
            part(grads.equal_mask, (~0, 1), 1),
            part(kernels.mul, (~1, 1), 2),
        ),
        [(N,), (B, N)],
        [(B, N)] * 3,
        [2],
        1,
    ),
}


def chain_inputs(name, rng, shapes):
    """Inputs where each chain's math is defined: divisors away from 0, equal_mask's
    operands equal about half the time."""
    ins = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for x in ins:  # relu and relu_grad's edge
        x.reshape(-1)[::7] = 0.0
    if name == "backward":
        ins[4] = rng.uniform(0.5, 2.0, shapes[4]).astype(np.float32)
    if name == "broadcast_mask":
        ins[1] = np.where(rng.random(shapes[1]) < 0.5, ins[0], ins[1]).astype(np.float32)
    return ins


def run_plain(parts, ins, outs, micro_batches):
    for phase in range(micro_batches):
        chain([*ins, phase] if micro_batches > 1 else ins, outs, parts)


# -- code generation (CPU) --------------------------------------------------------------


def test_a_bias_add_and_gelu_become_one_kernel_reading_each_input_once():
    parts, *_ = CHAINS["bias_gelu"]
    code = habits.chain_code(parts, written=[1])
    assert code == habits.ChainCode(
        name="af_chain_add_gelu",
        in_params="float32 x0, float32 x1",
        out_params="float32 y1",
        operation="\n".join(
            [
                "const float a0 = x0;",
                "const float a1 = x1;",
                "const float v0 = a0 + a1;",
                "const float v1 = (tanhf((v0 * v0 * v0 * 0.044714998453855515f + v0)"
                " * 0.7978845834732056f) + 1.0f) * v0 * 0.5f;",
                "y1 = v1;",
            ]
        ),
        inputs=(0, 1),
        outputs=(1,),
        phased=False,
    )
    assert habits.chain_code(parts).out_params == "float32 y0, float32 y1"


def test_a_backward_chain_ending_in_an_accumulate_takes_the_phase_and_keeps_its_sum():
    parts, *_ = CHAINS["gradient_accumulated"]
    code = habits.chain_code(parts, written=[])
    assert code.in_params == "float32 x0, float32 x1, int32 phase" and code.phased
    assert code.out_params == "float32 y2" and code.outputs == (2,)
    lines = code.operation.split("\n")
    assert lines[2:4] == [
        "const float v0_x2 = a1 * a1;",
        "const float v0_t = tanhf(0.7978845834732056f * a1 * (1.0f + 0.044714998453855515f * v0_x2));",
    ]
    assert lines[-4:] == [
        "const float v1 = v0 * 2.0f;",
        "float v2 = phase == 0 ? v1 : y2 + v1;",
        "if (phase == 2) v2 = v2 / 3.0f;",
        "y2 = v2;",
    ]


def test_a_negative_factor_is_a_parenthesized_float32_literal():
    code = habits.chain_code((part(grads.scale, (0,), 0, {"factor": -0.1}),))
    assert "const float v0 = a0 * (-0.10000000149011612f);" in code.operation


@pytest.mark.parametrize(
    "parts",
    [
        (part(kernels.add, (0, 1), 0), part(kernels.matmul, (~0, 2), 1)),
        (part(kernels.softmax, (0,), 0, {"axis": -1}),),
        (part(kernels.call, (0,), 0, {"fn": abs}),),
        (part(grads.scale, (0,), 0, {"factor": float("inf")}),),
        (part(grads.scale, (0,), 0, {"factor": 2.0, "extra": 1}),),
        (part(kernels.relu, (0,), 0, {"unknown": True}),),
        (part(kernels.add, (0,), 0),),  # wrong arity
        ((kernels.add, {}, (0, 1), (0, 1), False, "two", "here"),),  # two outputs
        (part(kernels.relu, (0,), 0, phased=True),),  # phased, but not an accumulate
        (part(accumulate, (0,), 0, {"micro_batches": 2}),),  # an accumulate without its phase
        (part(kernels.relu, (~0,), 0),),  # reads an output no part wrote yet
        (part(kernels.relu, (0,), 0), part(kernels.relu, (0,), 0)),  # one output twice
    ],
    ids=[
        "matmul",
        "softmax",
        "call",
        "inf-factor",
        "unknown-scale-attr",
        "attrs-on-relu",
        "arity",
        "two-outputs",
        "phased-relu",
        "unphased-accumulate",
        "unwritten-source",
        "output-twice",
    ],
)
def test_a_chain_with_a_part_not_element_wise_or_not_understood_is_refused(parts):
    assert habits.chain_code(parts) is None
    assert habits.fused_chain_kernel(parts) is None


def test_a_chain_whose_outputs_nobody_reads_is_refused():
    parts, *_ = CHAINS["backward"]
    assert habits.chain_code(parts, written=[]) is None


def test_every_kernel_named_supported_has_code():
    made = set()
    for parts, *_ in CHAINS.values():
        made.update(p[0].__name__ for p in parts)
    assert made == set(habits.SUPPORTED)


def test_registers_fit_one_kernel_where_outputs_have_the_broadcast_shape_and_all_are_float32():
    parts, ins, outs, _, _ = CHAINS["bias_gelu"]
    code = habits.chain_code(parts)
    f32 = "float32"
    assert habits.fits_one_kernel(code, [(s, f32) for s in ins], [(s, f32) for s in outs])
    assert not habits.fits_one_kernel(code, [(ins[0], "float64"), (ins[1], f32)], [(s, f32) for s in outs])
    # an output smaller than an input: CuPy broadcasts outputs too, and refuses that
    smaller = (part(grads.scale, (1,), 0, {"factor": 2.0}), part(kernels.add, (0, ~0), 1))
    both, last = habits.chain_code(smaller), habits.chain_code(smaller, written=[1])
    assert not habits.fits_one_kernel(both, [(s, f32) for s in ins], [((N,), f32), ((B, N), f32)])
    assert habits.fits_one_kernel(last, [(s, f32) for s in ins], [((N,), f32), ((B, N), f32)])


# -- the generated code, compiled for the host and run ----------------------------------


def shim(code: habits.ChainCode, device: bool) -> str:
    """``code``'s operation in a loop over flat arrays bound as CuPy binds them (each
    parameter a reference to its element): a host function for a C++ compiler, or a
    __global__ kernel for nvcc."""
    binds = [f"const float &x{k} = xs[{j}][i];" for j, k in enumerate(code.inputs)]
    binds += [f"float &y{t} = ys[{j}][i];" for j, t in enumerate(code.outputs)]
    body = "\n".join([*binds, code.operation])
    if device:
        head = (
            'extern "C" __global__ void check(const float* const* xs, float* const* ys, long long n, int phase) {\n'
            "const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\nif (i >= n) return;\n"
        )
        return head + body + "\n}\n"
    head = (
        '#include <math.h>\nextern "C" void check(const float* const* xs, float* const* ys, long long n, int phase) {\n'
        "for (long long i = 0; i < n; ++i) {\n"
    )
    return head + body + "\n}\n}\n"


def host_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(host_compiler() is None, reason="no C++ compiler found")
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_the_generated_code_computes_what_the_parts_do_one_by_one(name, tmp_path):
    parts, in_shapes, out_shapes, written, micro_batches = CHAINS[name]
    code = habits.chain_code(parts, written)
    source = tmp_path / "chain.cpp"
    source.write_text(shim(code, device=False))
    library = tmp_path / "chain.so"
    done = subprocess.run(
        [host_compiler(), "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", library, source],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    check = ctypes.CDLL(str(library)).check
    rng = np.random.default_rng(1)
    ins = chain_inputs(name, rng, in_shapes)
    want = [np.zeros(s, np.float32) for s in out_shapes]
    run_plain(parts, ins, want, micro_batches)
    full = np.broadcast_shapes(*out_shapes)
    xs = [np.ascontiguousarray(np.broadcast_to(ins[k], full)) for k in code.inputs]
    got = [np.zeros(full, np.float32) for _ in code.outputs]
    pointers = ctypes.c_void_p * 8
    for phase in range(micro_batches):
        check(
            pointers(*(x.ctypes.data for x in xs)),
            pointers(*(y.ctypes.data for y in got)),
            ctypes.c_longlong(int(np.prod(full))),
            ctypes.c_int(phase),
        )
    for t, y in zip(code.outputs, got):
        np.testing.assert_allclose(y, want[t], rtol=2e-6, atol=2e-6, err_msg=f"output {t}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_every_cuda_source_compiles_with_nvcc(tmp_path):
    """What a GPU would compile, checked where the CUDA compiler is (NVRTC, which CuPy
    uses, takes the same CUDA C++; the chains' code in a shim binding it as CuPy does)."""
    sources = {
        f"chain_{name}": shim(habits.chain_code(p, w), device=True)
        for name, (p, _, _, w, _) in CHAINS.items()
    }
    sources["relu_bits"] = habits.RELU_BITS_SOURCE
    for index in ("int", "long long"):
        for ids in ("int", "long long"):
            sources[f"gather_{index}_{ids}".replace(" ", "_")] = habits.gather_source(index, ids)
    for name, text in sources.items():
        (tmp_path / f"{name}.cu").write_text(text)
    done = subprocess.run(
        [
            "nvcc",
            "-ptx",
            "-arch=sm_80",
            "--output-directory",
            tmp_path,
            *(tmp_path / f"{n}.cu" for n in sources),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "relu_bits.ptx").read_text()
    assert "vote.sync.ballot.b32" in ptx and ".entry af_relu_bits_grad" in ptx
    assert "div.s32" in (tmp_path / "gather_int_int.ptx").read_text()
    assert "div.s64" in (tmp_path / "gather_long_long_int.ptx").read_text()


# -- the compiler pass ------------------------------------------------------------------


def mlp_block() -> af.Graph:
    with af.Graph() as g:
        x = af.placeholder("x", (B, N), "float32")
        bias = af.placeholder("bias", (N,), "float32")
        dy = af.placeholder("dy", (B, N), "float32")
        h = af.ops.bias_add(x, bias, name="h")
        y = af.ops.scale(af.ops.gelu(h, name="g"), 0.5, name="half")
        af.output("y", y)
        (dh,) = af.gradients(y, [h], dy)
        af.output("dh", af.ops.relu(af.ops.exp(dh)))
    return g


def fused_actors(plan: Plan) -> list:
    return [a for a in plan.actors if a.kernel is habits.fused_chain]


def test_the_pass_makes_each_element_wise_chain_and_actor_one_kernel_writing_what_is_read(tmp_path):
    plan = af.compile(mlp_block())
    chains = [a for a in plan.actors if a.kernel is chain]
    assert chains
    assert cuda_chains(plan) == plan  # on cpu devices: nothing to do
    fused = cuda_chains(plan, on=lambda device: True)
    alone = [
        a
        for a in plan.actors
        if a.kind == "compute" and habits.element_wise(a.kernel) and a.kernel not in habits.ONE_PASS
    ]
    assert alone  # an element-wise actor alone is a chain of one part, where it saves passes
    one_pass = [a for a in plan.actors if a.kind == "compute" and a.kernel in habits.ONE_PASS]
    assert one_pass and all(fused.actors[a.id].kernel is a.kernel for a in one_pass)
    assert {a.name for a in fused_actors(fused)} == {a.name for a in chains + alone}
    for actor in fused_actors(fused):
        code = habits.chain_code(actor.attrs["parts"], actor.attrs["written"])
        outs = [r for r in (fused.registers[o] for o in actor.outputs) if not r.control]
        assert [outs[t].name for t in code.outputs] == [r.name for r in outs if r.consumers]
    again = Plan.from_bytes(fused.to_bytes())
    assert [a.attrs.get("written") for a in again.actors] == [a.attrs.get("written") for a in fused.actors]
    assert all("code" not in a.attrs for a in again.actors)  # no CUDA source travels in a plan
    rng = np.random.default_rng(2)
    feeds = {
        name: rng.standard_normal(s).astype(np.float32)
        for name, s in [("x", (B, N)), ("bias", (N,)), ("dy", (B, N))]
    }
    want, got = af.run(plan, feeds), af.run(again, feeds)  # numpy arrays: the plain chain
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def mixed_block() -> af.Graph:
    """A chain of a matmul, a bias add and a gelu, then a matmul: element-wise parts
    between parts that are not."""
    rng = np.random.default_rng(3)
    with af.Graph() as g:
        x = af.placeholder("x", (B, N), "float32")
        w = af.parameter("w", rng.standard_normal((N, N)).astype(np.float32))
        bias = af.parameter("bias", rng.standard_normal(N).astype(np.float32))
        v = af.parameter("v", rng.standard_normal((N, N)).astype(np.float32))
        h = af.ops.gelu(af.ops.bias_add(af.ops.matmul(x, w), bias))
        af.output("y", af.ops.matmul(h, v))
    return g


def test_a_run_of_element_wise_parts_inside_a_chain_becomes_one_part():
    plan = af.compile(mixed_block())
    (mixed,) = [a for a in plan.actors if a.kernel is chain]
    assert [p[0].__name__ for p in mixed.attrs["parts"]] == ["matmul", "add", "gelu", "matmul"]
    fused = cuda_chains(plan, on=lambda device: True)
    parts = fused.actors[mixed.id].attrs["parts"]
    assert [p[0] for p in parts][1] is habits.fused_chain
    assert [p[0].__name__ for p in parts] == ["matmul", "fused_chain", "matmul"]
    inner = parts[1][1]["parts"]
    assert [p[0].__name__ for p in inner] == ["add", "gelu"]
    code = habits.chain_code(parts[1][1]["parts"], parts[1][1]["written"])
    assert len(code.outputs) == 1  # only the gelu's output, which the last matmul reads, is written
    assert [k.__name__ for k, _ in fused.actors[mixed.id].kernels()] == ["matmul", "add", "gelu", "matmul"]
    again = Plan.from_bytes(fused.to_bytes())  # checked: one part may run several ops
    feeds = {"x": np.random.default_rng(4).standard_normal((B, N)).astype(np.float32)}
    np.testing.assert_array_equal(af.run(again, feeds)["y"], af.run(plan, feeds)["y"])


def test_a_nested_part_counts_its_ops_for_the_cost_model_as_the_plain_chain_does():
    from actorflow.simulate.costs import features

    plan = af.compile(mixed_block())
    fused = cuda_chains(plan, on=lambda device: True)
    (mixed,) = [a for a in plan.actors if a.kernel is chain]
    assert features(fused, fused.actors[mixed.id]) == features(plan, mixed)
    assert fused.actors[mixed.id].kernels() == mixed.kernels()


def attention_block(causal: bool) -> af.Graph:
    """Attention's scores and their gradient: q k^T, a scale, a (causal) softmax; back
    through them, a softmax gradient and a scale."""
    rng = np.random.default_rng(5)
    with af.Graph() as g:
        q = af.placeholder("q", (2, 3, 6, 4), "float32")
        k = af.parameter("k", rng.standard_normal((2, 3, 6, 4)).astype(np.float32))
        dy = af.placeholder("dy", (2, 3, 6, 6), "float32")
        scores = af.ops.scale(af.ops.matmul(q, k, transpose_b=True), 0.5, name="scaled")
        p = af.ops.causal_softmax(scores) if causal else af.ops.softmax(scores, axis=-1)
        af.output("p", p)
        (dq,) = af.gradients(p, [q], dy)
        af.output("dq", dq)
    return g


@pytest.mark.parametrize("causal", [True, False])
def test_a_scale_beside_a_softmax_is_one_part_of_its_chain(causal):
    """scale, then softmax; softmax_grad, then scale: each pair one part, which on a GPU
    is one kernel (``transformer_kernels.scaled_softmax``, ``scaled_softmax_grad``); here
    its numpy path computes what the plain chain does, and the plan travels."""
    plan = af.compile(attention_block(causal))
    fused = cuda_chains(plan, on=lambda device: True)
    names = [[p[0].__name__ for p in a.attrs["parts"]] for a in fused.actors if a.kernel is chain]
    assert ["matmul", "scaled_softmax"] in names and any("scaled_softmax_grad" in n for n in names)
    assert not any("scale" in n for n in names)  # no scale part is left alone
    again = Plan.from_bytes(fused.to_bytes())
    rng = np.random.default_rng(6)
    feeds = {
        "q": rng.standard_normal((2, 3, 6, 4)).astype(np.float32),
        "dy": rng.standard_normal((2, 3, 6, 6)).astype(np.float32),
    }
    want, got = af.run(plan, feeds), af.run(again, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_on_a_gpu_the_scaled_parts_take_one_row_kernel_with_their_factor(monkeypatch):
    """What a GPU array takes: the row kernel, told the scale part's factor (the kernels
    themselves are checked against the separate multiply by ``test_cuda_rows``' host
    simulator and on a GPU)."""
    from actorflow.ops import cuda_rows
    from actorflow.ops import transformer_kernels as tk

    launched = []
    monkeypatch.setattr(cuda_rows, "fits", lambda *arrays: True)
    for name in ("softmax", "causal_softmax"):
        monkeypatch.setattr(
            cuda_rows, name, lambda x, out, scale, name=name: launched.append((name, out, scale))
        )
    monkeypatch.setattr(
        cuda_rows, "softmax_grad", lambda dy, y, out, scale: launched.append(("softmax_grad", out, scale))
    )
    x, dy, y, out = (object() for _ in range(4))  # stand-ins for CuPy arrays
    scale = part(grads.scale, [0], 0, {"factor": 0.25})
    for soft, name in [
        (part(tk.causal_softmax, [~0], 1), "causal_softmax"),
        (part(kernels.softmax, [~0], 1, {"axis": -1}), "softmax"),
    ]:
        tk.scaled_softmax([x], [None, out], parts=(scale, soft))
        assert launched.pop() == (name, out, 0.25)
    backward = (
        part(grads.softmax_grad, [0, 1], 0, {"axis": -1}),
        part(grads.scale, [~0], 1, {"factor": 0.5}),
    )
    tk.scaled_softmax_grad([dy, y], [None, out], parts=backward)
    assert launched == [("softmax_grad", out, 0.5)]


def test_a_scale_whose_output_another_reads_keeps_its_part():
    rng = np.random.default_rng(7)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 6), "float32")
        w = af.parameter("w", rng.standard_normal((6, 6)).astype(np.float32))
        scores = af.ops.scale(af.ops.matmul(x, w), 0.5)
        af.output("p", af.ops.softmax(scores, axis=-1))
        af.output("e", af.ops.exp(scores))
    fused = cuda_chains(af.compile(g), on=lambda device: True)
    names = [[p[0].__name__ for p in a.attrs["parts"]] for a in fused.actors if a.kernel is chain]
    assert names == [["matmul", "scale", "softmax"]]


def test_element_wise_parts_are_known_by_identity_not_name():
    class Twice:  # a kernel that is a callable object, with no __name__
        def __call__(self, ins, outs):
            outs[0][...] = 2 * ins[0]

    def add(ins, outs):  # another function named add
        outs[0][...] = ins[0] + ins[1]

    assert habits.element_wise(kernels.add) and habits.element_wise(grads.gelu_grad)
    assert not habits.element_wise(Twice()) and not habits.element_wise(add)


def test_a_nested_part_reading_past_its_inputs_is_refused_when_a_plan_loads():
    from actorflow.errors import PlanSerializationError
    from actorflow.records import evolve

    fused = cuda_chains(af.compile(mixed_block()), on=lambda device: True)
    (mixed,) = [a for a in fused.actors if a.kernel is chain]
    parts = list(mixed.attrs["parts"])
    kernel, attrs, sources, targets, *rest = parts[1]
    inner = list(attrs["parts"])
    inner[0] = (inner[0][0], inner[0][1], (99,), *inner[0][3:])
    parts[1] = (kernel, {**attrs, "parts": tuple(inner)}, sources, targets, *rest)
    actors = list(fused.actors)
    actors[mixed.id] = evolve(mixed, attrs={**mixed.attrs, "parts": tuple(parts)})
    with pytest.raises(PlanSerializationError, match="reads \\[99\\]"):
        Plan.from_bytes(evolve(fused, actors=tuple(actors)).to_bytes())


# -- relu's bit mask and the gather, numpy references (CPU) -----------------------------


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 100, 1025])
def test_the_bit_mask_packs_element_i_at_bit_i_mod_32_of_word_i_div_32(n):
    rng = np.random.default_rng(n)
    positive = rng.random(n) < 0.5
    words = habits.pack_mask(positive)
    assert words.dtype == np.uint32 and words.shape == (habits.mask_words(n),)
    want = [
        sum(int(positive[i]) << (i % 32) for i in range(w * 32, min(n, w * 32 + 32)))
        for w in range(words.size)
    ]
    assert words.tolist() == want
    np.testing.assert_array_equal(habits.unpack_mask(words, n), positive)


def test_relu_bits_and_its_gradient_equal_relu_and_relu_grad_on_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 45)).astype(np.float32)
    x[0, :5] = 0.0
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, bits, dx = np.empty_like(x), np.empty(habits.mask_words(x.size), np.uint32), np.empty_like(x)
    habits.relu_bits([x], [y, bits])
    habits.relu_bits_grad([dy, bits], [dx])
    want_y, want_dx = np.empty_like(x), np.empty_like(x)
    kernels.relu([x], [want_y])
    grads.relu_grad([dy, x], [want_dx])
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    assert bits.nbytes * 32 == habits.mask_words(x.size) * 128 and bits.nbytes < x.nbytes / 31


def test_the_index_type_is_int_while_every_index_fits():
    assert habits.index_type(8 << 20, 32 << 20) == "int"
    assert habits.index_type(2**31 - habits.BLOCK) == "int"
    assert habits.index_type(2**31 - habits.BLOCK + 1) == "long long"
    assert habits.index_type(10, 2**31) == "long long"


def test_the_gather_is_numpys_take_with_ids_clipped_on_numpy():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([[0, 3], [5, -1]], np.int64)
    out = np.empty((2, 2, 3), np.float32)
    habits.gather_rows([ids, table], [out])
    np.testing.assert_array_equal(out, table[[[0, 3], [3, 0]]])


# -- on a GPU: each habit against its plain version ------------------------------------

GPU_SHAPES = {(B, N): (512, 1000), (N,): (1000,)}


def to_gpu(arrays):
    import cupy

    return [cupy.asarray(a) for a in arrays]


def gpu_chain_case(name):
    parts, in_shapes, out_shapes, written, micro_batches = CHAINS[name]
    rng = np.random.default_rng(4)
    ins = chain_inputs(name, rng, [GPU_SHAPES[s] for s in in_shapes])
    return parts, ins, [GPU_SHAPES[s] for s in out_shapes], written, micro_batches


@gpu
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_fused_chain_on_the_gpu_equals_its_parts_run_one_by_one(name):
    parts, ins, out_shapes, written, micro_batches = gpu_chain_case(name)
    code = habits.chain_code(parts, written)
    assert habits.fits_one_kernel(
        code, [(x.shape, "float32") for x in ins], [(s, "float32") for s in out_shapes]
    )
    want = [np.zeros(s, np.float32) for s in out_shapes]
    run_plain(parts, ins, want, micro_batches)  # numpy, on the host
    kernel = habits.fused_chain_kernel(parts, written)
    outs = to_gpu([np.zeros(s, np.float32) for s in out_shapes])
    gins = to_gpu(ins)
    for phase in range(micro_batches):
        kernel([*gins, phase] if micro_batches > 1 else gins, outs)
    for t in code.outputs:
        np.testing.assert_allclose(outs[t].get(), want[t], rtol=1e-5, atol=1e-5, err_msg=f"output {t}")
    for t in set(range(len(outs))) - set(code.outputs):  # intermediates stay in registers
        assert not outs[t].any().get()


@gpu
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_fused_chain_equals_the_plain_chain_run_with_cupy(name):
    parts, ins, out_shapes, written, micro_batches = gpu_chain_case(name)
    code = habits.chain_code(parts, written)
    gins = to_gpu(ins)
    plain, fused = (to_gpu([np.zeros(s, np.float32) for s in out_shapes]) for _ in range(2))
    run_plain(parts, gins, plain, micro_batches)
    for phase in range(micro_batches):
        habits.fused_chain(
            [*gins, phase] if micro_batches > 1 else gins, fused, parts=parts, written=code.outputs
        )
    for t in code.outputs:
        np.testing.assert_allclose(
            fused[t].get(), plain[t].get(), rtol=1e-5, atol=1e-5, err_msg=f"output {t}"
        )


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 5, 37, 37), (2, 4, 512, 512)])
def test_a_scaled_softmax_and_its_gradient_on_the_gpu_equal_their_parts_bit_for_bit(causal, shape):
    """One kernel that scales as it reads (or writes) rounds as the scale kernel did."""
    import cupy

    from actorflow.ops import transformer_kernels as tk

    rng = np.random.default_rng(sum(shape))
    x, dy = to_gpu([(4 * rng.standard_normal(shape)).astype(np.float32) for _ in range(2)])
    factor = 1 / math.sqrt(shape[-1] + 3)
    scale = part(grads.scale, [0], 0, {"factor": factor})
    soft = part(tk.causal_softmax, [~0], 1) if causal else part(kernels.softmax, [~0], 1, {"axis": -1})
    forward = (scale, soft)
    fused, plain = ([cupy.zeros_like(x), cupy.zeros_like(x)] for _ in range(2))
    tk.scaled_softmax([x], fused, parts=forward)
    chain([x], plain, forward)
    cupy.testing.assert_array_equal(fused[1], plain[1])
    assert not fused[0].any()  # the scaled scores stay in registers
    y = plain[1]
    backward = (
        part(grads.softmax_grad, [0, 1], 0, {"axis": -1}),
        part(grads.scale, [~0], 1, {"factor": factor}),
    )
    fused, plain = ([cupy.zeros_like(x), cupy.zeros_like(x)] for _ in range(2))
    tk.scaled_softmax_grad([dy, y], fused, parts=backward)
    chain([dy, y], plain, backward)
    cupy.testing.assert_array_equal(fused[1], plain[1])


@gpu
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 257 * 4099])
def test_relu_bits_on_the_gpu_equal_the_plain_relu_its_mask_and_gradient(n):
    import cupy

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[::5] = 0.0
    x[1::9] = -0.0
    dy = rng.standard_normal(n).astype(np.float32)
    gx, gdy = to_gpu([x, dy])
    y, bits, dx = (
        cupy.empty_like(gx),
        cupy.full(habits.mask_words(n), 0xFFFFFFFF, cupy.uint32),
        cupy.empty_like(gx),
    )
    habits.relu_bits([gx], [y, bits])
    habits.relu_bits_grad([gdy, bits], [dx])
    np.testing.assert_array_equal(bits.get(), habits.pack_mask(x > 0))
    np.testing.assert_array_equal(y.get(), np.maximum(x, 0))
    np.testing.assert_array_equal(dx.get(), dy * (x > 0))
    plain = cupy.empty_like(gx)
    kernels.relu([gx], [plain])  # the plain kernels, on CuPy arrays
    np.testing.assert_array_equal(y.get(), plain.get())


@gpu
@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_the_gather_with_int32_indexes_equals_int64_and_numpy(index, id_dtype):
    import cupy

    rng = np.random.default_rng(5)
    table = rng.standard_normal((1000, 96)).astype(np.float32)
    ids = rng.integers(-3, 1003, (37, 53)).astype(id_dtype)
    out = cupy.empty(ids.shape + (96,), cupy.float32)
    habits.gather_rows(to_gpu([ids, table]), [out], index=index)
    np.testing.assert_array_equal(out.get(), np.take(table, ids, axis=0, mode="clip"))
