"""A Plan's round trip through bytes: msgpack, kernels and user functions as import paths
(by value, pickled with cloudpickle, when they have none: lambdas, local functions, a
script's own), arrays as raw bytes, the whole sealed with a digest (or, with a key, an
HMAC, so that tampering is detected and not only corruption).

Reading bytes back runs nothing they say: decoding leaves every function as a
``FunctionRef``; only once the seal and the schema are checked are the references
resolved, and then only to actorflow's own functions, numpy's ufuncs and the modules the
caller allows (importing a module runs it). A function carried by value is unpickled
only for a caller who says the plan is ``trusted`` (as ``torch.load``'s ``weights_only``
is the default and pickles are the exception). Then ``plan_check.validate`` checks the
plan's consistency before anyone can run it.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import pickle
import reprlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, get_args, get_origin

import attrs
import cattrs
import cloudpickle
import msgpack
import numpy as np
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn

from .collector import cyclic_gc_paused
from .errors import CompileError, PlanSerializationError
from .plan_check import validate
from .plan_data import PlanData
from .records import evolve

FORMAT_VERSION = 4

P = TypeVar("P", bound=PlanData)


OWN_MODULES = ("actorflow",)
"""Modules whose functions every load may import: actorflow's own kernels."""


@attrs.frozen
class FunctionRef:
    """A function as the bytes name it, not yet imported or unpickled: ``path``
    (``module:qualname``) or ``pickled`` (cloudpickle's bytes)."""

    path: str | None = None
    pickled: bytes | None = None


@cyclic_gc_paused()
def to_bytes(plan: PlanData, key: bytes | None = None) -> bytes:
    """``plan`` sealed as bytes, with an HMAC under ``key`` if given; a
    PlanSerializationError names an actor whose function cannot travel."""
    for actor in plan.actors:
        for fn in [actor.kernel, *_functions(actor.attrs)]:
            try:
                _function_entry(fn)
            except PlanSerializationError as e:
                raise PlanSerializationError(f"actor {actor.name!r}: {e}") from None
    return _seal(msgpack.packb(_converter.unstructure(plan), default=_encode), key)


@cyclic_gc_paused()
def from_bytes(
    data: bytes, cls: type[P], *, allow: Sequence[str] = (), trusted: bool = False, key: bytes | None = None
) -> P:
    """A ``cls`` read back, checked: its seal (a digest, so corrupted bytes are refused,
    or the HMAC under ``key``, so changed ones are), its schema (no unknown or missing
    keys, no wrong types), its functions (see the module: imported only from actorflow,
    numpy's ufuncs and the modules in ``allow``, and unpickled only when ``trusted``,
    which also allows any import) and ``plan_check.validate`` (ids, consumers, streams,
    events, ranks, deadlock). Any failure is one PlanSerializationError saying what is
    wrong."""
    try:
        decoded = msgpack.unpackb(
            _unseal(data, key), object_hook=_decode, use_list=False, strict_map_key=False
        )
        plan = _converter.structure(decoded, cls)
    except PlanSerializationError:
        raise
    except (cattrs.BaseValidationError, _Refused) as e:
        raise _schema_error(e) from None
    except Exception as e:
        raise PlanSerializationError(f"not a serialized Plan: {type(e).__name__}: {e}") from e
    plan = _resolved(plan, tuple(allow), trusted)
    try:
        validate(plan)
    except CompileError as e:
        raise PlanSerializationError(f"not a consistent Plan: {e}") from e
    return plan


def _resolved(plan: P, allow: tuple[str, ...], trusted: bool) -> P:
    """``plan`` with its actors' FunctionRefs replaced by the functions, or a
    PlanSerializationError naming the actor whose function the caller did not allow."""
    actors = []
    for actor in plan.actors:
        try:
            actors.append(
                evolve(
                    actor,
                    kernel=_function(actor.kernel, allow, trusted),
                    attrs=_with_functions(actor.attrs, lambda ref: _function(ref, allow, trusted)),
                )
            )
        except PlanSerializationError as e:
            raise PlanSerializationError(f"actor {actor.name!r}: {e}") from None
    return evolve(plan, actors=tuple(actors))


def _function(ref: Any, allow: tuple[str, ...], trusted: bool) -> Callable:
    if not isinstance(ref, FunctionRef):
        raise PlanSerializationError(f"expected a function, got {reprlib.repr(ref)}")
    if ref.pickled is not None:
        if not trusted:
            raise PlanSerializationError(
                "its function is carried by value (pickled), and unpickling runs code: "
                "load the plan with trusted=True only if you trust where it came from"
            )
        return pickle.loads(ref.pickled)
    assert ref.path is not None, "a FunctionRef names a path or carries a pickle"
    module = ref.path.partition(":")[0]
    if not trusted and not any(
        module == m or module.startswith(m + ".") for m in (*OWN_MODULES, *allow, "numpy")
    ):
        raise PlanSerializationError(
            f"its function {ref.path} is in module {module}, which this load does not allow "
            f"(importing a module runs it): pass allow=[{module.partition('.')[0]!r}] if you trust it"
        )
    fn = resolve(ref.path)
    if not trusted and (
        import_path(fn) != ref.path or module.startswith("numpy") and not isinstance(fn, np.ufunc)
    ):
        raise PlanSerializationError(
            f"{ref.path} is not a function defined there"
            + (" (of numpy, only ufuncs load)" if module.startswith("numpy") else "")
        )
    return fn


def import_path(fn: Callable) -> str | None:
    """``module:qualname`` of a function that imports back as itself, else None."""
    module = getattr(fn, "__module__", None) or ("numpy" if isinstance(fn, np.ufunc) else None)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    path = f"{module}:{qualname}"
    try:
        return path if resolve(path) is fn else None
    except PlanSerializationError:
        return None


def _function_entry(fn: Callable) -> dict:
    """A function by import path, which any program with its module can load; one without
    (a lambda, a local function, a kernel in the script run as ``__main__``) by value."""
    path = import_path(fn)
    if path is not None:
        return {"__function__": path}
    try:
        return {"__pickled_function__": cloudpickle.dumps(fn)}
    except Exception as e:
        raise PlanSerializationError(
            f"cannot serialize {fn!r}: it has no import path and cloudpickle cannot carry it "
            f"by value ({type(e).__name__}: {e}); define it at the top level of a module"
        ) from e


def resolve(path: str) -> Callable:
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise PlanSerializationError(f"cannot import function {path}: {e}") from e
    return obj


def _seal(payload: bytes, key: bytes | None = None) -> bytes:
    """The serialized form: the format, the plan's msgpack payload and its digest, or its
    HMAC under ``key``."""
    seal = {"blake2b": _digest(payload)} if key is None else {"hmac-sha256": _hmac(payload, key)}
    return msgpack.packb({"format": FORMAT_VERSION, **seal, "plan": payload})


def _unseal(data: bytes, key: bytes | None = None) -> bytes:
    """The payload of sealed bytes, or a PlanSerializationError if they aren't whole (or,
    with a ``key``, if they weren't sealed with it)."""
    try:
        sealed = msgpack.unpackb(data)
    except Exception as e:
        raise PlanSerializationError(f"not a serialized Plan: {type(e).__name__}: {e}") from e
    if (
        isinstance(sealed, dict)
        and isinstance(sealed.get("format"), int)
        and sealed["format"] != FORMAT_VERSION
    ):
        raise PlanSerializationError(
            f"a serialized Plan of format {sealed['format']}; this actorflow reads format {FORMAT_VERSION} "
            "(compile the plan again)"
        )
    seals = ({"blake2b"}, {"hmac-sha256"})
    if not isinstance(sealed, dict) or not any(set(sealed) == {"format", "plan", *seal} for seal in seals):
        raise PlanSerializationError(f"not a serialized Plan of format {FORMAT_VERSION}")
    payload = sealed["plan"]
    if not isinstance(payload, bytes):
        raise PlanSerializationError("the serialized Plan is corrupt: its payload is not bytes")
    if key is None and "hmac-sha256" in sealed:
        raise PlanSerializationError("the serialized Plan is sealed with a key: pass key= to check it")
    if key is not None and "hmac-sha256" not in sealed:
        raise PlanSerializationError(
            "the serialized Plan is not sealed with a key, so it can't be checked with one"
        )
    if key is not None and not hmac.compare_digest(sealed["hmac-sha256"], _hmac(payload, key)):
        raise PlanSerializationError(
            "the serialized Plan's HMAC does not match: it was changed, or sealed with another key"
        )
    if key is None and sealed["blake2b"] != _digest(payload):
        raise PlanSerializationError("the serialized Plan is corrupt: its digest does not match its contents")
    return payload


def _hmac(payload: bytes, key: bytes) -> bytes:
    return hmac.new(key, payload, "sha256").digest()


def _functions(value: Any) -> Iterator[Callable]:
    """The functions in an actor's attrs, also inside tuples, lists and dicts (a fused
    chain's parts carry their members' kernels and attrs)."""
    if callable(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _functions(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _functions(item)


def _with_functions(value: Any, function: Callable[[FunctionRef], Callable]) -> Any:
    """``value`` (an actor's attrs) with ``function(ref)`` in place of each FunctionRef,
    also inside tuples, lists and dicts."""
    if isinstance(value, FunctionRef):
        return function(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_with_functions(item, function) for item in value)
    if isinstance(value, dict):
        return {k: _with_functions(item, function) for k, item in value.items()}
    return value


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__array__": (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())}
    if callable(obj):
        return _function_entry(obj)
    raise PlanSerializationError(f"cannot serialize {type(obj).__name__} in a Plan")


def _decode(obj: dict) -> Any:
    if "__array__" in obj:
        dtype, shape, raw = obj["__array__"]
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if "__function__" in obj:
        return FunctionRef(path=obj["__function__"])
    if "__pickled_function__" in obj:
        return FunctionRef(pickled=obj["__pickled_function__"])
    return obj


class _Refused(ValueError):
    """A value the Plan's schema refuses; the message says why."""


def _exactly(*types: Any) -> Callable[[Any, Any], Any]:
    """A structure hook that takes a value of these types as it is and refuses the rest
    (cattrs would convert: int("3"), str(3), bool(5))."""

    def structure(value: Any, target: Any) -> Any:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = getattr(target, "__name__", target)
            raise _Refused(f"expected {expected}, got {reprlib.repr(value)}")
        return value

    return structure


def _strict_tuple(target: Any, converter: cattrs.Converter) -> Callable[[Any, Any], tuple]:
    """``tuple[X, ...]`` only from an array (cattrs would take any iterable: bytes, a
    string, a map's keys), each element structured as X."""
    (element,) = [a for a in get_args(target) if a is not Ellipsis]
    hook = converter.get_structure_hook(element)

    def structure(value: Any, _: Any) -> tuple:
        if not isinstance(value, (tuple, list)):
            raise _Refused(f"expected an array, got {reprlib.repr(value)}")
        items, errors = [], []
        for k, v in enumerate(value):
            try:
                items.append(hook(v, element))
            except Exception as e:  # noqa: BLE001 - collected, raised together below
                e.__notes__ = [
                    *getattr(e, "__notes__", []),
                    IterableValidationNote(f"@ index {k}", k, element),
                ]
                errors.append(e)
        if errors:
            raise IterableValidationError(f"While structuring {target}", errors, target)
        return tuple(items)

    return structure


def _complete(cls: type, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """An attrs class only from a map with every field (to_bytes writes them all, so a
    missing one, even one with a default, means the bytes were changed) and no other
    (cattrs would ignore an unknown key, such as a misspelt ``consulers``)."""
    structure: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, converter)
    fields = {f.name for f in attrs.fields(cls)}

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _Refused(f"expected a map of {cls.__name__}, got {reprlib.repr(value)}")
        if value.keys() != fields:
            missing, unknown = sorted(fields - value.keys()), sorted(value.keys() - fields, key=str)
            said = [f"without {missing}"] * bool(missing) + [f"with unknown keys {unknown}"] * bool(unknown)
            raise _Refused(f"{cls.__name__} {' and '.join(said)}")
        return structure(value, cls)

    return hook


def _schema_error(e: Exception) -> PlanSerializationError:
    def describe(exc: BaseException, target: type | None) -> str:
        return str(exc) if isinstance(exc, _Refused) else cattrs.v.format_exception(exc, target)

    return PlanSerializationError(
        f"not a valid Plan: {'; '.join(cattrs.transform_error(e, '$plan', describe))}"
    )


_converter = cattrs.Converter()
_converter.register_unstructure_hook(np.ndarray, lambda a: a)
_converter.register_structure_hook(np.ndarray, _exactly(np.ndarray))
_converter.register_unstructure_hook_func(lambda t: get_origin(t) is Callable, lambda fn: fn)
_converter.register_structure_hook_func(lambda t: get_origin(t) is Callable, _exactly(FunctionRef))
for _type, _accepted in ((int, (int,)), (float, (float, int)), (str, (str,)), (bool, (bool,))):
    _converter.register_structure_hook(_type, _exactly(*_accepted))
_converter.register_structure_hook_factory(
    lambda t: get_origin(t) is tuple and Ellipsis in get_args(t), _strict_tuple
)
_converter.register_structure_hook_factory(attrs.has, _complete)
