"""``rlengine.validation``: the constraints declared on the public Structs' field types.

The cases are read off the annotations themselves (every ``Bound``, every ``Literal``,
every bool and number), so a field added with a declaration is covered without a new
test: each bound rejects the value just outside it and accepts the value on it, on
construction and on decoding (JSON and msgpack), with an error naming field and value.
The Tinker request bodies' cases also go through the real Tinker server as JSON: a 400
whose body names the field and the value.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any, Literal

import msgspec
import pytest
from msgspec.structs import force_setattr
from verifiers_recipe import VerifiersOptions

import rlengine as rle
from rlengine import validation
from rlengine.config import EngineConfig, Placement, SimConfig
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.rl.config import TrainConfig, check_integer, check_number
from rlengine.rl.recipes.copy_digits import CopyOptions
from rlengine.rl.recipes.guess import GuessOptions
from rlengine.rl.recipes.tools import ToolsOptions
from rlengine.serve.server import ServeConfig
from rlengine.tinker_api import TinkerServerConfig, start
from rlengine.tinker_api.wire import (
    LoraConfigWire,
    ModelInputWire,
    SampleRequest,
    SamplingParamsWire,
    SaveWeightsForSamplerRequest,
)
from rlengine.types import AdamParams, SamplingParams, TensorData
from rlengine.validation import Bound, PositiveInt, validate

httpx = pytest.importorskip("httpx")

# class -> (its error, the prefix of its field names, the fields a valid instance needs)
CONVERTED: dict[type, tuple[type[Exception], str, dict[str, Any]]] = {
    SamplingParams: (InvalidRequest, "", {}),
    AdamParams: (InvalidRequest, "", {}),
    TensorData: (InvalidRequest, "TensorData.", {"data_raw": b"", "dtype": "int64", "shape": [0]}),
    EngineConfig: (ConfigurationError, "", {}),
    SimConfig: (ConfigurationError, "sim.", {}),
    Placement: (ConfigurationError, "placement.", {}),
    ServeConfig: (ConfigurationError, "", {}),
    TrainConfig: (ConfigurationError, "", {}),
    TinkerServerConfig: (ConfigurationError, "", {}),
    CopyOptions: (ConfigurationError, "", {}),
    GuessOptions: (ConfigurationError, "", {}),
    ToolsOptions: (ConfigurationError, "", {}),
    VerifiersOptions: (ConfigurationError, "", {}),
    LoraConfigWire: (InvalidRequest, "lora_config.", {"rank": 0}),
    SampleRequest: (InvalidRequest, "", {"prompt": ModelInputWire(chunks=[]), "sampling_params": SamplingParamsWire()}),
    SaveWeightsForSamplerRequest: (InvalidRequest, "", {"model_id": "m"}),
}

# Values on a bound that a rule between fields refuses at construction (checked through
# ``validate`` alone), and the companions that make the others constructible.
COMPANIONS: dict[tuple[type, str], dict[str, Any]] = {
    (TrainConfig, "group_size"): {"min_surviving_attempts": 1},
    (TrainConfig, "icepop_low"): {"icepop_high": 2.0},
    (TrainConfig, "geo_mask_low"): {"geo_mask_high": 2.0},
    (TrainConfig, "rollout_only"): {"dump_rollouts": "dumps"},
}
CROSS_FIELD = {(TrainConfig, "icepop_high"), (TrainConfig, "geo_mask_high")}
"""Their lowest value breaks ``low <= 1 <= high`` whatever ``low`` is."""


class Case(typing.NamedTuple):
    cls: type
    field: str
    path: str
    """The field name as errors show it (``replica_resources['x']``, ``shape[0]``)."""
    wrap: typing.Callable[[Any], Any]
    value: Any
    ok: bool
    kind: str
    """What refuses it: a ``bound``, a ``literal``, or the field's ``type``."""

    def __repr__(self) -> str:
        return f"{self.cls.__name__}.{self.path}={self.value!r}:{'ok' if self.ok else 'bad'}"


def _unwrap(tp: Any) -> tuple[Any, str, typing.Callable[[Any], Any]]:
    """The scalar type inside ``X | None``, ``dict[str, X]`` or ``list[X]``, how its field name is
    shown, and how a scalar becomes a field value."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap(inner[0]) if len(inner) == 1 else (None, "", lambda v: v)
    if origin is dict:
        base, _, _ = _unwrap(typing.get_args(tp)[1])
        return base, "['x']", lambda v: {"x": v}
    if origin is list:
        base, _, _ = _unwrap(typing.get_args(tp)[0])
        return base, "[0]", lambda v: [v]
    return tp, "", lambda v: v


def _step(x: float, integer: bool, up: bool) -> float:
    if integer:
        return int(x) + (1 if up else -1)
    return math.nextafter(float(x), math.inf if up else -math.inf)


def _bound_values(bound: Bound, integer: bool) -> list[tuple[Any, bool]]:
    """Each end: the value on it (accepted) and the one just outside (refused)."""
    out: list[tuple[Any, bool]] = []
    cast = int if integer else float
    if bound.ge is not None:
        out += [(cast(bound.ge), True), (_step(bound.ge, integer, up=False), False)]
    if bound.gt is not None:
        out += [(_step(bound.gt, integer, up=True), True), (cast(bound.gt), False)]
    if bound.le is not None:
        out += [(cast(bound.le), True), (_step(bound.le, integer, up=True), False)]
    if bound.lt is not None:
        out += [(_step(bound.lt, integer, up=False), True), (cast(bound.lt), False)]
    out += [(cast(a), True) for a in bound.also]
    if not integer and bound.finite and (bound.ge is None and bound.gt is None or bound.le is None
                                         and bound.lt is None):
        out += [(math.inf, False), (-math.inf, False), (math.nan, False)]
    return out


def _cases() -> list[Case]:
    cases = []
    for cls in CONVERTED:
        hints = typing.get_type_hints(cls, include_extras=True)
        for field in cls.__struct_fields__:
            base, suffix, wrap = _unwrap(hints[field])
            values: list[tuple[Any, bool, str]] = []
            if typing.get_origin(base) is Annotated:
                scalar, *meta = typing.get_args(base)
                for bound in (m for m in meta if isinstance(m, Bound)):
                    values += [(v, ok, "bound") for v, ok in _bound_values(bound, scalar is int)]
                base = scalar
            if typing.get_origin(base) is Literal:
                values += [(c, True, "literal") for c in typing.get_args(base)] + [("no such choice", False, "literal")]
            elif base is bool:
                values += [(True, True, "type"), (False, True, "type"), (1, False, "type"), ("false", False, "type")]
            elif base is int:
                values += [(True, False, "type"), (1.0, False, "type"), ("1", False, "type")]
            elif base is float:
                values += [(False, False, "type"), ("1.0", False, "type")]
            cases += [Case(cls, field, field + suffix, wrap, v, ok, kind) for v, ok, kind in values]
    return cases


CASES = _cases()


def test_the_cases_cover_every_converted_type_and_each_kind_of_declaration():
    covered = {c.cls for c in CASES}
    assert covered == set(CONVERTED)
    paths = {(c.cls, c.path) for c in CASES}
    for expected in [(SamplingParams, "top_k"), (SamplingParams, "logprobs_mode"), (Placement, "replica_resources['x']"),
                     (TensorData, "shape[0]"), (TrainConfig, "kl_estimator"), (ServeConfig, "port"),
                     (EngineConfig, "dtype"), (SimConfig, "gen_len_dist"), (TinkerServerConfig, "port"),
                     (CopyOptions, "digits"), (ToolsOptions, "deadline_s"), (VerifiersOptions, "scripted"),
                     (LoraConfigWire, "rank"), (SampleRequest, "topk_sample_logprobs"),
                     (SampleRequest, "prompt_logprobs_last_n"), (SaveWeightsForSamplerRequest, "kind")]:
        assert expected in paths
    assert sum(not c.ok for c in CASES) > 200  # typically ~470


def _assert_names(err: BaseException, case: Case) -> None:
    error, prefix, _ = CONVERTED[case.cls]
    assert isinstance(err, error), err
    assert str(err).startswith(f"{prefix}{case.path}={case.value!r}:"), str(err)
    if isinstance(err, InvalidRequest):
        assert err.field == prefix + case.path
        assert repr(err.value) == repr(case.value)


@pytest.mark.parametrize("case", [c for c in CASES if not c.ok], ids=repr)
def test_a_value_outside_a_declaration_is_refused_on_construction_naming_field_and_value(case):
    error, _, base = CONVERTED[case.cls]
    with pytest.raises(error) as info:
        case.cls(**{**base, case.field: case.wrap(case.value)})
    _assert_names(info.value, case)


def _encodable(case: Case, codec: Any) -> bool:
    # JSON has no inf or nan; both wires carry bools, ints, floats and strings as they are.
    return codec is msgspec.msgpack or not (isinstance(case.value, float) and not math.isfinite(case.value))


@pytest.mark.parametrize(("case", "codec"), [
    pytest.param(c, codec, id=f"{c!r}-{codec.__name__}") for c in CASES if not c.ok and c.kind == "bound"
    for codec in (msgspec.json, msgspec.msgpack) if codec is msgspec.msgpack or math.isfinite(c.value)  # JSON: no inf
])
def test_a_number_outside_its_bound_is_refused_on_decoding_with_the_same_message(case, codec):
    """A decoder (msgspec) runs ``__post_init__``: the typed error is the cause of its ValidationError,
    whose message is the one construction gives."""
    _, _, base = CONVERTED[case.cls]
    with pytest.raises(msgspec.ValidationError) as info:
        codec.decode(codec.encode({**base, case.field: case.wrap(case.value)}), type=case.cls)
    _assert_names(info.value.__cause__, case)
    assert str(info.value).startswith(str(info.value.__cause__))


@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack], ids=["json", "msgpack"])
@pytest.mark.parametrize("case", [c for c in CASES if not c.ok and c.kind != "bound"], ids=repr)
def test_a_wrong_choice_or_type_is_refused_on_decoding_by_msgspec_naming_the_field(case, codec):
    """msgspec checks literals and types itself while decoding, before ``__post_init__``: its message
    names the field (and a literal's value)."""
    _, _, base = CONVERTED[case.cls]
    with pytest.raises(msgspec.ValidationError) as info:
        codec.decode(codec.encode({**base, case.field: case.wrap(case.value)}), type=case.cls)
    assert f"- at `$.{case.field}" in str(info.value), str(info.value)
    if case.kind == "literal":
        assert repr(case.value) in str(info.value)


@pytest.mark.parametrize("case", [c for c in CASES if c.ok], ids=repr)
def test_a_value_on_a_bound_is_accepted(case):
    error, prefix, base = CONVERTED[case.cls]
    made = case.cls(**base)
    force_setattr(made, case.field, case.wrap(case.value))
    validate(made, error, prefix)  # the declaration alone
    if (case.cls, case.field) in CROSS_FIELD:
        return
    given = {**base, **COMPANIONS.get((case.cls, case.field), {}), case.field: case.wrap(case.value)}
    assert getattr(case.cls(**given), case.field) == case.wrap(case.value)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(given), type=case.cls)
    assert getattr(decoded, case.field) == case.wrap(case.value)


# -- the Tinker request bodies, through the real server ----------------------------------------------

TINKER_CALLS: dict[type, tuple[str, typing.Callable[[dict[str, Any]], dict[str, Any]]]] = {
    LoraConfigWire: ("create_model", lambda fields: {"session_id": "s", "model_seq_id": 0, "base_model": "tiny",
                                                     "lora_config": {"rank": 0, **fields}}),
    SampleRequest: ("asample", lambda fields: {"prompt": {"chunks": []}, "sampling_params": {}, **fields}),
    SaveWeightsForSamplerRequest: ("save_weights_for_sampler", lambda fields: {"model_id": "m", **fields}),
}
"""Each Tinker body's endpoint, and the JSON request that carries the given fields of that body."""


@pytest.fixture(scope="module")
def tinker_url(engine_config, tmp_path_factory):
    # The sim: a body is refused while it is decoded, before any call reaches the engine.
    with rle.Engine(engine_config("sim")) as engine:
        server = start(engine, TinkerServerConfig(no_auth=True, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))))
        try:
            yield server.url
        finally:
            server.close()


def test_every_tinker_body_with_declarations_is_sent_to_the_server():
    assert set(TINKER_CALLS) == {c for c in CONVERTED if c.__module__ == "rlengine.tinker_api.wire"}


@pytest.mark.parametrize("case", [c for c in CASES if c.cls in TINKER_CALLS and not c.ok
                                  and _encodable(c, msgspec.json)], ids=repr)
def test_a_refused_tinker_body_is_a_400_naming_field_and_value(case, tinker_url):
    """A declared limit (the body's own ``InvalidRequest``) and msgspec's own refusal (a type, a
    literal, at the path msgspec names) read alike: the field as the body's error names it, and the
    value as sent."""
    endpoint, request = TINKER_CALLS[case.cls]
    response = httpx.post(f"{tinker_url}/api/v1/{endpoint}", timeout=60,
                          content=msgspec.json.encode(request({case.field: case.wrap(case.value)})),
                          headers={"X-API-Key": "tml-any", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("invalid", CONVERTED[case.cls][1] + case.path), error
    assert (type(error["value"]), error["value"]) == (type(case.value), case.value), error


# -- the defects the hand-written checks let through (each failed on the old code) ---------------------

@pytest.mark.parametrize(("make", "field"), [
    (lambda: ServeConfig(ipc="no"), "ipc"),  # a truthy string served IPC
    (lambda: ServeConfig(port=8000.5), "port"),
    (lambda: ServeConfig(frame_timeout_s=True), "frame_timeout_s"),
    (lambda: ServeConfig(grace_s="5"), "grace_s"),  # was a TypeError from the comparison
    (lambda: EngineConfig(continuous_sampling="no"), "continuous_sampling"),  # resolved_continuous() said "no"
    (lambda: TrainConfig(reproducible="false"), "reproducible"),
    (lambda: SimConfig(sleep_supported=0), "sim.sleep_supported"),
    (lambda: TinkerServerConfig(sample_use_retrieve_futures="false"), "sample_use_retrieve_futures"),  # was on
    (lambda: VerifiersOptions(scripted=0), "scripted"),
])
def test_bools_and_numbers_are_checked_on_every_config_not_only_where_someone_wrote_a_check(make, field):
    with pytest.raises(ConfigurationError, match=f"^{field}="):
        make()


def test_a_huge_integer_for_a_number_is_judged_not_an_overflow():
    check_number("think_s", 10 ** 400, minimum=0.0)  # was OverflowError from math.isfinite
    with pytest.raises(ConfigurationError, match=r"^sim\.gen_len_sigma=-10{400}: must be a finite number >= 0$"):
        SimConfig(gen_len_sigma=-10 ** 400)


def test_a_bad_resource_amount_is_named_by_its_resource():
    with pytest.raises(ConfigurationError, match=r"^placement\.trainer_resources\['GPU'\]=-1: must be a finite "
                                                 r"number >= 0$"):
        Placement(trainer_resources={"CPU": 1, "GPU": -1})


# -- the module itself --------------------------------------------------------------------------------

class _Sample(msgspec.Struct, kw_only=True, frozen=True):
    count: PositiveInt = 1
    share: Annotated[float, Bound(gt=0, le=1, note="of the batch")] = 0.5
    k: Annotated[int, Bound(ge=1, also=(-1,))] = -1
    mode: Literal["a", "b"] | None = None
    flag: bool = False
    sizes: list[Annotated[int, Bound(ge=0)]] = []
    name: str = "x"
    """Not checked: a str field takes what it is given (a Path too)."""

    def __post_init__(self) -> None:
        validate(self, InvalidRequest)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"count": 0}, "count=0: must be an integer >= 1"),
    ({"share": 1.5}, "share=1.5: must be a number in (0, 1] (of the batch)"),
    ({"k": 0}, "k=0: must be -1 or an integer >= 1"),
    ({"mode": "c"}, "mode='c': must be 'a', 'b' or None"),
    ({"flag": None}, "flag=None: must be true or false"),
    ({"sizes": [1, -2]}, "sizes[1]=-2: must be an integer >= 0"),
    ({"sizes": (1,)}, "sizes=(1,): must be a list"),
])
def test_messages_say_what_the_declaration_says(kwargs, message):
    with pytest.raises(InvalidRequest) as info:
        _Sample(**kwargs)
    assert str(info.value) == message


def test_a_field_without_a_checkable_type_is_left_to_the_struct():
    assert _Sample(name=3).name == 3  # type: ignore[arg-type]


def test_the_declarations_of_a_class_are_read_once(monkeypatch):
    class Fresh(msgspec.Struct, frozen=True):
        n: PositiveInt = 1

        def __post_init__(self) -> None:
            validate(self, ConfigurationError)

    compiled = []
    real = validation._compile
    monkeypatch.setattr(validation, "_compile", lambda cls: compiled.append(cls) or real(cls))
    for n in (1, 2, 3):
        Fresh(n=n)
    with pytest.raises(ConfigurationError, match="^n=0: must be an integer >= 1$"):
        Fresh(n=0)
    assert compiled == [Fresh]


def test_a_bound_on_a_type_it_cannot_bound_is_a_programming_error():
    class Wrong(msgspec.Struct):
        s: Annotated[str, Bound(ge=1)] = "x"

    with pytest.raises(TypeError, match="Bound applies to int and float"):
        validate(Wrong(), InvalidRequest)
    with pytest.raises(TypeError, match="at most one of ge/gt"):
        Bound(ge=1, gt=0)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check_integer("digits", 9, minimum=1, maximum=8), "digits=9: must be an integer in [1, 8]"),
    (lambda: check_integer("size", True, minimum=1), "size=True: must be an integer >= 1"),
    (lambda: check_number("share", 0, minimum=0, exclusive=True, maximum=1), "share=0: must be a number in (0, 1]"),
    (lambda: check_number("think_s", math.inf, minimum=0.0), "think_s=inf: must be a finite number >= 0"),
    (lambda: check_number("reward", math.nan, minimum=None), "reward=nan: must be a finite number"),
])
def test_check_integer_and_check_number_use_the_same_rules(call, message):
    with pytest.raises(ConfigurationError) as info:
        call()
    assert str(info.value) == message


def test_subclasses_pass_as_their_base_a_bool_never_as_a_number():
    import collections
    import enum

    assert Placement(replica_resources=collections.OrderedDict(CPU=2.0)).replica_resources == {"CPU": 2.0}
    assert EngineConfig(backend=enum.StrEnum("Backend", {"SIM": "sim"}).SIM).backend == "sim"
    with pytest.raises(ConfigurationError, match=r"^placement\.replica_resources\['CPU'\]=True: must be a finite"):
        Placement(replica_resources={"CPU": True})
