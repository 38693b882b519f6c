import warnings

import pytest
import yaml

from mimose_cli.launcher.recipe import RecipeError, load_recipe, recipe_from_dict, save_recipe

from helpers import QUICKSTART, ROOT

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


# Each section's own checks: (recipe, the key=value the message must name, what it must expect).
SECTION_MISTAKES = [
    ({"model": {"size": "huge"}}, "model.size='huge'", "'tiny' or 'base'"),
    ({"model": {"type": 5}}, "model.type=5", "string"),
    ({"model": 3}, "model=3", "expected a dictionary"),
    ({"data": {"source": "web"}}, "data.source='web'", "'synthetic' or 'hf'"),
    ({"data": {"preset": "imdb"}}, "data.preset='imdb'", "swag | squad | qqp"),
    ({"data": {"source": "hf"}}, "data.name=None", "data set name"),
    ({"data": {"num_examples": 0}}, "data.num_examples=0", "greater than or equal to 1"),
    ({"data": {"max_length": -4}}, "data.max_length=-4", "greater than or equal to 1"),
    ({"data": {"num_choices": 0}}, "data.num_choices=0", "greater than or equal to 1"),
    ({"data": {"num_labels": 1}}, "data.num_labels=1", "greater than or equal to 2"),
    ({"data": {"shuffle": "yes"}}, "data.shuffle='yes'", "expected true or false"),
    ({"data": {"length_mean": "long"}}, "data.length_mean='long'", "number"),
    ({"data": {"text_fields": "question"}}, "data.text_fields='question'", "list"),
    ({"training": {"lr": 0}}, "training.lr=0", "greater than 0"),
    ({"training": {"lr": "0.001"}}, "training.lr='0.001'", "number"),
    ({"training": {"max_steps": 0}}, "training.max_steps=0", "greater than or equal to 1"),
    ({"training": {"warmup_steps": -1}}, "training.warmup_steps=-1", "greater than or equal to 0"),
    ({"training": {"epochs": 0}}, "training.epochs=0", "greater than or equal to 1"),
    ({"training": {"log_every": 0}}, "training.log_every=0", "greater than or equal to 1"),
    ({"training": {"gradient_accumulation_steps": 0}}, "training.gradient_accumulation_steps=0",
     "greater than or equal to 1"),
    ({"training": {"batch_size": True}}, "training.batch_size=True", "integer"),
    ({"training": {"batch_size": 2.0}}, "training.batch_size=2.0", "integer"),
    ({"training": {"precision": "fp8"}}, "training.precision='fp8'", "'fp32', 'bf16' or 'fp16'"),
    ({"planner": {"mimose": {"sheltered_steps": 0}}}, "planner.mimose.sheltered_steps=0", "greater than or equal to 1"),
    ({"planner": {"mimose": {"granularity": 0}}}, "planner.mimose.granularity=0", "greater than or equal to 1"),
    ({"planner": {"safety_margin": "lots"}}, "planner.safety_margin='lots'", "byte size"),
    ({"planner": {"sublinear": [1]}}, "planner.sublinear=[1]", "dictionary"),
    ({"budget": 0}, "budget='0'", "byte size"),
    ({"budget": True}, "budget=True", "string"),
    ({"seed": 1.5}, "seed=1.5", "integer"),
]


@pytest.mark.parametrize("data, named, expected", SECTION_MISTAKES, ids=[m[1] for m in SECTION_MISTAKES])
def test_each_section_names_key_value_and_expectation(tmp_path, data, named, expected):
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, data))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'r.yaml'}: {named} is invalid; expected ")
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("key", ["model.weights", "data.sorce", "planner.margin", "seed_value",
                                 "budget_bytes", "planner.safety_margin_bytes"])
def test_unknown_keys_list_the_valid_ones(tmp_path, key):
    section = {"model": "type", "data": "source", "planner": "name"}.get(key.partition(".")[0], "task")
    with pytest.raises(RecipeError, match=rf"unknown key {key}; expected one of .*\b{section}\b") as info:
        recipe_from_dict({}, "r.yaml", overrides=[f"{key}=1"])
    assert "_bytes" not in str(info.value).partition("expected one of")[2]  # parsed, never written


def test_a_misspelt_key_is_reported_before_the_values_it_leaves_wrong():
    with pytest.raises(RecipeError, match=r"unknown key training\.batch_sise"):
        recipe_from_dict({"training": {"lr": "fast", "batch_sise": 4}}, "r.yaml")
    with pytest.raises(RecipeError, match="unknown key 1; expected one of task"):
        recipe_from_dict({1: "x"}, "r.yaml")


def test_sizes_are_parsed_once_into_bytes():
    recipe = recipe_from_dict({"budget": "6GiB", "planner": {"safety_margin": "512MB"}})
    assert (recipe.budget, recipe.budget_bytes) == ("6GiB", 6 * 2**30)
    assert (recipe.planner.safety_margin, recipe.planner.safety_margin_bytes) == ("512MB", 512 * 10**6)
    default = recipe_from_dict({})
    assert default.budget_bytes is None and default.planner.safety_margin_bytes is None  # auto
    bare = recipe_from_dict({"budget": 40000000, "planner": {"safety_margin": 0}})
    assert (bare.budget, bare.budget_bytes, bare.planner.safety_margin_bytes) == ("40000000", 40000000, 0)


def test_flag_budget_replaces_the_parsed_bytes(tmp_path):
    recipe = load_recipe(_write(tmp_path, {"budget": "1GB"}), ["budget=2GB"], {"budget": "3GiB"})
    assert recipe.budget_bytes == 3 * 2**30


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
    recipe = recipe_from_dict({"training": {"max_steps": 3}, "budget": "64MB",
                               "planner": {"safety_margin": "1MiB"}}, overrides=["seed=7"])
    save_recipe(recipe, tmp_path / "resolved.yaml")
    saved = (tmp_path / "resolved.yaml").read_text()
    assert "budget: 64MB" in saved and "_bytes" not in saved  # what the user wrote, not the bytes
    again = load_recipe(tmp_path / "resolved.yaml")
    assert again == recipe and again.budget_bytes == 64 * 10**6


def test_missing_file_is_clear():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("no/such/recipe.yaml")


def test_exponent_numbers_are_numbers_and_text_that_looks_like_one_round_trips(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("training:\n  lr: 1e-4\ndata:\n  source: hf\n  name: '1e5'\n")
    recipe = load_recipe(path, ["training.weight_decay=1e-2"])
    assert (recipe.training.lr, recipe.training.weight_decay) == (1e-4, 1e-2)  # PyYAML alone reads text
    assert recipe.data.name == "1e5"
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


def test_a_recipe_of_an_earlier_release_reads_its_planner_options_with_a_warning(tmp_path):
    # A run directory's recipe.yaml written before one section per planner: re-run or resumed.
    old = tmp_path / "recipe.yaml"
    old.write_text("planner:\n  name: sublinear\n  sheltered_steps: 3\n  granularity: 8\n"
                   "  options: {variant: sqrt}\n")
    with pytest.warns(UserWarning) as caught:
        recipe = load_recipe(old)
    said = " ".join(str(w.message) for w in caught)
    assert "planner.sheltered_steps is now planner.mimose.sheltered_steps" in said
    assert "planner.options.variant is now planner.sublinear.variant" in said
    assert recipe.planner.keywords == {"variant": "sqrt"}
    assert (recipe.planner.mimose.sheltered_steps, recipe.planner.mimose.granularity) == (3, 8)
    with pytest.warns(UserWarning, match="override 'planner.sheltered_steps=2'"):
        overridden = load_recipe(old, ["planner.sheltered_steps=2"])  # the override still wins
    assert overridden.planner.mimose.sheltered_steps == 2


def test_an_override_given_twice_is_said_and_the_last_wins():
    with pytest.warns(UserWarning, match="override 'seed=4': seed is given twice \\(also by override 'seed=3'\\)"):
        recipe = load_recipe(QUICKSTART, ["seed=3", "seed=4"])
    assert recipe.seed == 4


def test_a_mapping_override_sets_its_keys_in_the_section():
    recipe = load_recipe(QUICKSTART, ["training={max_steps: 7}"])
    assert recipe.training.max_steps == 7
    assert recipe.training.batch_size == 4 and recipe.training.lr == 2e-3  # the file's, not the defaults


def test_warmup_longer_than_the_run_is_said():
    with pytest.warns(UserWarning, match="training.warmup_steps=5 is longer than the run"):
        load_recipe(QUICKSTART, ["training.max_steps=3"])


def test_an_invalid_recipe_is_its_error_alone():
    """What a section warns of (warm-up longer than the run) is not said of a recipe that is then
    refused: the refusal is the one line."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(RecipeError, match="planner.mimose.choices='selective' is invalid"):
            load_recipe(QUICKSTART, ["training.max_steps=3", "planner.mimose.estimate=sheltered",
                                     "planner.mimose.choices=selective"])
    assert not [w for w in said if "warmup" in str(w.message)]


def test_an_override_of_another_planners_section_is_named():
    """A recipe holds every planner's options, but a run reads its own planner's: the overrides
    that set another's are found (``mimose train`` warns of them)."""
    from mimose_cli.launcher.recipe import idle_planner_overrides

    overrides = ["planner.name=sublinear", "planner.mimose.choices=selective", "planner.sublinear.variant=sqrt",
                 "planner.hf_every_n={every_n_layers: 2}", "planner.safety_margin=0", "training.max_steps=3"]
    recipe = load_recipe(QUICKSTART, overrides)
    assert idle_planner_overrides(recipe, overrides) == ["planner.mimose.choices=selective",
                                                          "planner.hf_every_n={every_n_layers: 2}"]
    recipe = load_recipe(QUICKSTART, ["planner.name=hf-every-n"])
    assert idle_planner_overrides(recipe, ["planner.hf_every_n.every_n_layers=2"]) == []
