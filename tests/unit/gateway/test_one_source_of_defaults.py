"""Each default has one source: the settings model. The shipped YAML files list the same values."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from edge_engine.settings import EdgeSettings
from gateway.settings import EdgeSettingsModel, Settings, StateSettings
from policies.cache.config import CacheConfig, CacheSection
from policies.cascade import CascadeSection
from policies.policy import Policy
from policies.trim.config import TrimPolicy, TrimSection

# Set from config for the first time: before, only the engine's own dataclass had them.
ENGINE_ONLY_BEFORE = {
    "max_queue_wait_s": 5.0,
    "default_max_tokens": 64,
    "prefix_slots": 0,
    "min_prefix_tokens": 32,
    "extra_buffers": True,
    "seed": 7,
}


def _shipped_gateway_yaml() -> dict[str, Any]:
    return yaml.safe_load((resources.files("gateway") / "defaults.yaml").read_text("utf-8"))


def _shipped_policy_yaml(name: str) -> dict[str, Any]:
    text = (resources.files("policies") / "defaults" / f"{name}.yaml").read_text("utf-8")
    return yaml.safe_load(text)[name]


def _default(model: type[BaseModel], name: str) -> Any:
    value = model.model_fields[name].get_default(call_default_factory=True)
    # a nested section is listed in the YAML as the mapping of its values
    return value.model_dump() if isinstance(value, BaseModel) else value


def test_the_gateway_edge_section_is_the_engine_model_plus_the_lane_fields() -> None:
    assert issubclass(EdgeSettingsModel, EdgeSettings)
    assert set(EdgeSettingsModel.model_fields) - set(EdgeSettings.model_fields) == {
        "enabled", "aliases", "calibration", "calibration_cache", "calibrate_on_start", "calibrate_budget_s",
        "calibrate_limit", "calibrate_min_probes", "calibrate_concurrency"}
    loaded = Settings.load(env={}).edge
    alone = EdgeSettings()
    assert loaded.model_dump(include=set(EdgeSettings.model_fields)) == alone.model_dump()


def test_gateway_defaults_yaml_lists_exactly_the_edge_model_defaults() -> None:
    section = _shipped_gateway_yaml()["edge"]
    for key, value in section.items():
        assert key in EdgeSettingsModel.model_fields, f"edge.{key} in defaults.yaml is no setting"
        assert value == _default(EdgeSettingsModel, key), f"edge.{key}: defaults.yaml and the model disagree"
    # n_threads alone is left out: its default (all cores but one) depends on the machine.
    assert set(EdgeSettingsModel.model_fields) - set(section) == {"n_threads"}


def test_gateway_defaults_yaml_lists_exactly_the_state_model_defaults() -> None:
    section = _shipped_gateway_yaml()["state"]
    assert set(section) == set(StateSettings.model_fields), "defaults.yaml state: and StateSettings list other keys"
    for key, value in section.items():
        assert value == _default(StateSettings, key), f"state.{key}: defaults.yaml and the model disagree"
    assert Settings.load(env={}).state.backend == "embedded"  # nothing else to start by default


def test_the_engine_defaults_to_all_cores_but_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert EdgeSettings().n_threads == 7
    assert EdgeSettings(n_threads=None).n_threads == 7  # null in a config file: the default
    assert Settings.load(env={}).edge.n_threads == 7
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert EdgeSettings().n_threads == 1


def test_every_engine_setting_can_be_set_from_the_gateway_config() -> None:
    edge = Settings.load(env={}, overrides={"edge": ENGINE_ONLY_BEFORE}).edge
    assert {name: getattr(edge, name) for name in ENGINE_ONLY_BEFORE} == ENGINE_ONLY_BEFORE


@pytest.mark.parametrize("section", [{"n_ctxx": 1024}, {"n_ctx": 64}, {"seed": -1}, {"max_queue_wait_s": 0}])
def test_a_misspelt_or_out_of_range_edge_setting_fails_at_load(section: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=next(iter(section))):
        Settings.load(env={}, overrides={"edge": section})
    with pytest.raises(ValidationError, match=next(iter(section))):
        EdgeSettings(**section)


async def test_the_engine_is_given_the_loaded_edge_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_engine
    from gateway.components import COMPONENTS

    given: list[Any] = []

    class FakeEngine:
        def __init__(self, settings: EdgeSettings) -> None:
            given.append(settings)

        async def start(self) -> None:
            return None

    monkeypatch.setattr(edge_engine, "EdgeEngine", FakeEngine, raising=False)
    settings = Settings.load(env={}, overrides={"edge": {"n_ctx": 1024, **ENGINE_ONLY_BEFORE}})
    engine = next(c for c in COMPONENTS if c.attribute == "engine")
    await engine.build(settings, Policy.load())
    assert given == [settings.edge]
    assert isinstance(given[0], EdgeSettings) and given[0].n_ctx == 1024 and given[0].seed == 7


@pytest.mark.parametrize(("name", "model"), [("cache", CacheSection), ("trim", TrimSection), ("cascade", CascadeSection)])
def test_shipped_policy_yaml_lists_exactly_the_section_model_defaults(name: str, model: type[BaseModel]) -> None:
    section = _shipped_policy_yaml(name)
    assert set(section) == set(model.model_fields), f"policies/defaults/{name}.yaml and {model.__name__} list other keys"
    parsed, default = model.model_validate(section), model()
    for key in model.model_fields:
        assert getattr(parsed, key) == getattr(default, key), f"{name}.{key}: the YAML and the model disagree"


def test_a_partial_section_gets_the_shipped_values() -> None:
    shipped = Policy.load()
    assert CacheConfig.from_section({}) == CacheConfig.from_section(shipped.resolve("cache"))
    assert CacheConfig.from_section({}).threshold == 0.80  # the gate chosen with the cross-encoder (cross_encoder.json)
    assert TrimPolicy.from_dict({}) == TrimPolicy.from_dict(shipped.resolve("trim"))
