import pytest
import torch
import transformers

from mimose_cli.launcher.data.loader import make_batch
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import DataConfig, ModelConfig, Recipe

TASK_TYPES = [
    (task, model_type)
    for task in ("multiple_choice", "question_answering", "sequence_classification", "causal_lm")
    for model_type in ("bert", "roberta", "xlnet", "gpt2")
    # gpt2 has no multiple-choice head; XLNet's LM head does not shift labels (not a causal LM).
    if (task, model_type) not in {("multiple_choice", "gpt2"), ("causal_lm", "xlnet")}
]


def recipe(task="sequence_classification", model_type="bert", size="tiny", seed=0, **model):
    return Recipe(task=task, model=ModelConfig(type=model_type, size=size, **model),
                  data=DataConfig(num_choices=3, num_labels=3), seed=seed)


@pytest.mark.parametrize("task,model_type", TASK_TYPES)
def test_tiny_model_trains_one_step(task, model_type):
    r = recipe(task, model_type)
    model = build_model(r)
    assert model.training
    batch_eff = 2 * r.data.num_choices if task == "multiple_choice" else 2
    loss = model(**make_batch(r, model.config, (batch_eff, 24))).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2


def test_xlnet_question_answering_uses_the_plain_span_head():
    model = build_model(recipe("question_answering", "xlnet"))
    assert isinstance(model, transformers.XLNetForQuestionAnsweringSimple)


@pytest.mark.parametrize("model_type,expected", [
    ("bert", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                  intermediate_size=3072, vocab_size=30522, max_position_embeddings=512)),
    ("roberta", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                     intermediate_size=3072, vocab_size=50265, max_position_embeddings=514, type_vocab_size=1)),
    ("xlnet", dict(d_model=768, n_layer=12, n_head=12, d_inner=3072, vocab_size=32000, d_head=64)),
    ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
])
def test_base_preset_is_the_published_size(model_type, expected):
    config = model_config(recipe(model_type=model_type, size="base"))
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlnet", "gpt2"])
def test_tiny_preset_is_small_and_consistent(model_type):
    config = model_config(recipe(model_type=model_type))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 4, 4)
    assert config.vocab_size == 1000
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        assert value is None or 0 <= value < config.vocab_size


def test_tiny_positions_fit_512_tokens():
    assert model_config(recipe(model_type="bert")).max_position_embeddings >= 512
    assert model_config(recipe(model_type="roberta")).max_position_embeddings == 514
    assert model_config(recipe(model_type="gpt2")).n_positions == 1024


def test_overrides_apply_after_the_preset_and_accept_aliases():
    config = model_config(recipe(model_type="gpt2", config_overrides={"num_hidden_layers": 2, "hidden_size": 32}))
    assert (config.n_layer, config.n_embd) == (2, 32)
    model = build_model(recipe(model_type="bert", config_overrides={"num_hidden_layers": 2}))
    assert len(model.bert.encoder.layer) == 2


def test_xlnet_override_keeps_head_size_consistent():
    config = model_config(recipe(model_type="xlnet", config_overrides={"d_model": 128}))
    assert config.d_head == 128 // 4


def test_unknown_override_key_is_named():
    with pytest.raises(ValueError, match="hidden_sise"):
        model_config(recipe(config_overrides={"hidden_sise": 8}))


def test_invalid_override_value_is_a_value_error():
    with pytest.raises(ValueError, match="config_overrides"):
        model_config(recipe(model_type="xlnet", config_overrides={"d_model": 66}))  # 66 % 4 heads != 0


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="'bertt'"):
        model_config(recipe(model_type="bertt"))


def test_task_without_a_head_is_named():
    with pytest.raises(ValueError, match="gpt2.*multiple_choice"):
        build_model(recipe("multiple_choice", "gpt2"))


def test_classification_sets_labels_and_gpt2_pad_token():
    config = model_config(recipe("sequence_classification", "gpt2"))
    assert config.num_labels == 3
    assert config.pad_token_id == config.eos_token_id


def test_attn_implementation_is_passed_through():
    assert model_config(recipe(attn_implementation="eager"))._attn_implementation == "eager"
    assert build_model(recipe(attn_implementation="sdpa")).config._attn_implementation == "sdpa"


def test_dropout_stays_on():
    config = model_config(recipe())
    assert config.hidden_dropout_prob == 0.1 and config.attention_probs_dropout_prob == 0.1


def test_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = (build_model(recipe(seed=s)) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


def test_pretrained_loads_a_local_directory(tmp_path):
    saved = build_model(recipe(seed=7))
    saved.save_pretrained(tmp_path)
    loaded = build_model(recipe(seed=0, pretrained=str(tmp_path)))
    assert loaded.training
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
