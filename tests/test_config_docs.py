"""docs/configuration.md is what scripts/gen_config_docs.py writes from the code, and
every setting it lists says what it does."""

from __future__ import annotations

from scripts.gen_config_docs import DOC, env_names, render, settings, settings_classes

FIX = "run `.venv/bin/python scripts/gen_config_docs.py` and commit docs/configuration.md"


def test_configuration_doc_is_up_to_date():
    expected = render()
    assert DOC.is_file(), f"{DOC} is missing: {FIX}"
    current = DOC.read_text(encoding="utf-8")
    if current != expected:
        changed = [line for line in expected.splitlines() if line not in current.splitlines()]
        raise AssertionError(f"docs/configuration.md is out of date ({len(changed)} line(s) differ, first: "
                             f"{changed[:1]}): {FIX}")


def test_the_generator_finds_every_settings_class_and_its_variables():
    names = {cls.__name__ for cls in settings_classes()}
    assert {"StoreSettings", "ApiSettings", "WorkerSettings"} <= names
    from services.store.settings import StoreSettings

    # an alias replaces the prefixed name as the preferred variable; populate_by_name keeps the other
    assert env_names(StoreSettings, "database_url")[0] == "DATABASE_URL"
    assert env_names(StoreSettings, "pool_size") == ["EVALFORGE_DB_POOL_SIZE"]


def test_every_setting_has_a_description():
    undocumented = [f"{s.cls.__module__}.{s.cls.__name__}.{s.name}" for s in settings() if not s.field.description]
    assert not undocumented, (f"settings without a description: {', '.join(undocumented)}: give each "
                              "Field(description=...) (it is the documentation), then " + FIX)
