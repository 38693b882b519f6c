import pytest
import yaml

from mimose_cli.recipe import RecipeError, load_recipe, recipe_from_dict, save_recipe

from helpers import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.budget_bytes is None or recipe.budget_bytes > 0
    assert recipe.training.batch_size >= 1


def test_paper_recipes_have_published_sizes():
    sizes = {p.stem: load_recipe(p) for p in RECIPES}
    assert (sizes["mc_roberta"].model.type, sizes["mc_roberta"].training.batch_size) == ("roberta", 16)
    assert sizes["mc_roberta"].data.num_choices == 4
    assert (sizes["qa_xlnet"].model.type, sizes["qa_xlnet"].training.batch_size) == ("xlnet", 16)
    assert (sizes["qa_bert"].model.type, sizes["qa_bert"].training.batch_size) == ("bert", 12)
    assert (sizes["tc_bert"].model.type, sizes["tc_bert"].training.batch_size) == ("bert", 32)
    assert all(sizes[n].model.size == "base" for n in ("mc_roberta", "qa_xlnet", "qa_bert", "tc_bert"))


def _write(tmp_path, data):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unknown_key_names_file_and_key(tmp_path):
    path = _write(tmp_path, {"training": {"batch_sise": 4}})
    with pytest.raises(RecipeError, match=r"r\.yaml.*training\.batch_sise"):
        load_recipe(path)


def test_wrong_type_names_key_value_and_expectation(tmp_path):
    path = _write(tmp_path, {"training": {"batch_size": "four"}})
    with pytest.raises(RecipeError, match=r"training\.batch_size='four'.*integer"):
        load_recipe(path)


@pytest.mark.parametrize("data, key", [
    ({"training": {"batch_size": 0}}, "training.batch_size"),
    ({"budget": "lots"}, "budget"),
    ({"task": "translation"}, "task"),
    ({"planner": {"name": "magic"}}, "planner.name"),
    ({"device": "tpu"}, "device"),
])
def test_impossible_values_are_errors(tmp_path, data, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(_write(tmp_path, data))


def test_precedence_defaults_yaml_overrides_flags(tmp_path):
    path = _write(tmp_path, {"training": {"max_steps": 5, "batch_size": 4}, "budget": "1GB"})
    recipe = load_recipe(path, ["training.max_steps=20", "budget=2GB"], {"budget": "3GB"})
    assert recipe.training.max_steps == 20      # override beats YAML
    assert recipe.budget == "3GB"               # flag beats override
    assert recipe.training.batch_size == 4      # YAML beats default
    assert recipe.training.lr == 5e-5           # default


def test_override_must_be_key_value(tmp_path):
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe(_write(tmp_path, {}), ["training.max_steps"])


def test_resolved_recipe_round_trips(tmp_path):
    recipe = recipe_from_dict({"training": {"max_steps": 3}, "budget": "64MB"}, overrides=["seed=7"])
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


def test_missing_file_is_clear():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("no/such/recipe.yaml")
