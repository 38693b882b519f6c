"""Build the Hugging Face model a recipe names: config from a size preset, random init or local weights.

``model_config(recipe)`` -> a ``PretrainedConfig``; ``build_model(recipe)`` -> the task model in
train mode. Nothing is downloaded unless ``model.pretrained`` names a hub id.
"""

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError  # transformers' config validation
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

TASK_AUTO_CLASSES = {
    "multiple_choice": AutoModelForMultipleChoice,
    "question_answering": AutoModelForQuestionAnswering,
    "sequence_classification": AutoModelForSequenceClassification,
    "causal_lm": AutoModelForCausalLM,
    "image_classification": AutoModelForImageClassification,
}

# The published base checkpoints' sizes (bert-base-uncased, roberta-base, xlnet-base-cased, gpt2),
# in each config class's own field names. Other model types use their config class's defaults.
BASE_PRESETS = {
    "bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    "roberta": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, vocab_size=50265, max_position_embeddings=514,
                    type_vocab_size=1, layer_norm_eps=1e-5),
    # mem_len=None as in xlnet-base-cased: no memory carried between batches.
    "xlnet": dict(d_model=768, n_layer=12, n_head=12, d_inner=3072, vocab_size=32000, mem_len=None),
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
}

TINY_VOCAB = 1000
# Tiny: generic names, applied to whichever of them (or their aliases) a config class has.
TINY_GENERIC = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
TINY_INTERMEDIATE_KEYS = ("intermediate_size", "d_inner", "n_inner", "ffn_dim")
TINY_INTERMEDIATE = 128
# Room for the longest synthetic examples (data.max_length up to 512, gpt2 keeps its 1024).
TINY_TYPE_EXTRAS = {
    "roberta": dict(max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5),
    "xlnet": dict(mem_len=None),
    "gpt2": dict(n_positions=1024),
    # Bottleneck stages of 2, 3, 6 and 2 layers (ResNet-50 has 3, 4, 6, 3): stages of different
    # lengths, whose 13 layers are all blocks; 16..128 channels.
    "resnet": dict(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[2, 3, 6, 2], layer_type="bottleneck"),
}
SPECIAL_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _default_config(model_type: str):
    try:
        return AutoConfig.for_model(model_type)
    except ValueError as err:
        raise ValueError(
            f"model.type={model_type!r} is not a Hugging Face model type; "
            "expected e.g. bert, roberta, xlnet or gpt2"
        ) from err


def _pretrained_config(name: str):
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:  # not a directory with a config.json, nor a reachable hub id
        raise ValueError(f"model.pretrained={name!r} cannot be loaded ({str(err).splitlines()[0]}); "
                         "expected a local model directory or a hub id") from None


def _native_key(config, key: str) -> str:
    """The config class's own field name for ``key`` (gpt2: hidden_size -> n_embd)."""
    return type(config).attribute_map.get(key, key)


def _tiny_preset(default, model_type: str) -> dict:
    preset = {_native_key(default, k): v for k, v in TINY_GENERIC.items() if hasattr(default, k)}
    preset.update({k: TINY_INTERMEDIATE for k in TINY_INTERMEDIATE_KEYS if hasattr(default, k)})
    if hasattr(default, "vocab_size"):
        preset["vocab_size"] = TINY_VOCAB
        # Special ids of big vocabularies (gpt2's 50256) must stay inside the tiny one.
        for key in SPECIAL_TOKEN_KEYS:
            value = getattr(default, key, None)
            if isinstance(value, int) and value >= TINY_VOCAB:
                preset[key] = TINY_VOCAB - 1
    if model_type not in TINY_TYPE_EXTRAS and hasattr(default, "max_position_embeddings"):
        key = _native_key(default, "max_position_embeddings")
        preset[key] = max(512, getattr(default, "max_position_embeddings"))
    preset.update(TINY_TYPE_EXTRAS.get(model_type, {}))
    return preset


def _overrides(default, overrides: dict) -> dict:
    unknown = [key for key in overrides if not hasattr(default, key)]
    if unknown:
        raise ValueError(
            f"model.config_overrides.{unknown[0]}: not a field of {type(default).__name__}; "
            "expected one of its fields, e.g. hidden_size or num_hidden_layers"
        )
    return {_native_key(default, key): value for key, value in overrides.items()}


def _task_fields(recipe, config) -> dict:
    fields = {}
    if recipe.task in ("sequence_classification", "image_classification"):
        fields["num_labels"] = recipe.data.num_labels
    if recipe.task == "causal_lm" and hasattr(config, "is_decoder"):
        fields["is_decoder"] = True  # BERT/RoBERTa as causal LMs need the causal mask
    if recipe.model.attn_implementation is not None:
        fields["attn_implementation"] = recipe.model.attn_implementation
    return fields


def model_config(recipe) -> transformers.PretrainedConfig:
    """The recipe's model config: size preset, then ``model.config_overrides``, then task fields.

    With ``model.pretrained`` set, the checkpoint's config replaces the preset. Padding needs a
    pad id, so one without (gpt2) gets its eos id, as Hugging Face's examples do.
    """
    model = recipe.model
    if model.pretrained is not None:
        default = _pretrained_config(model.pretrained)
        preset = {}
    else:
        default = _default_config(model.type)
        preset = _tiny_preset(default, model.type) if model.size == "tiny" else BASE_PRESETS.get(model.type, {})
    fields = {**preset, **_overrides(default, model.config_overrides)}
    fields.update(_task_fields(recipe, default))
    try:
        if model.pretrained is not None:
            config = AutoConfig.from_pretrained(model.pretrained, **fields)
        else:
            config = AutoConfig.for_model(model.type, **fields)
    except (ValueError, TypeError, NotImplementedError, StrictDataclassError) as err:
        raise ValueError(f"model.config_overrides={model.config_overrides!r} make an invalid config: {err}") from err
    if hasattr(config, "pad_token_id") and config.pad_token_id is None:
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = eos if isinstance(eos, int) else 0
    return config


def _model_class(task: str, config):
    if config.model_type == "xlnet" and task == "question_answering":
        return transformers.XLNetForQuestionAnsweringSimple  # plain start/end cross-entropy loss
    auto = TASK_AUTO_CLASSES[task]
    if type(config) not in auto._model_mapping:
        raise ValueError(f"model.type={config.model_type!r} has no {task} model in transformers")
    return auto


def build_model(recipe, config: transformers.PretrainedConfig | None = None) -> torch.nn.Module:
    """The task model in train mode: random init seeded by ``recipe.seed``, or ``model.pretrained``;
    ``config`` is ``model_config(recipe)``, made here unless the caller has it already.

    The global RNG is left as it was, so building a model does not shift dropout or data order.
    """
    config = model_config(recipe) if config is None else config
    cls = _model_class(recipe.task, config)
    try:
        if recipe.model.pretrained is not None:
            model = cls.from_pretrained(recipe.model.pretrained, config=config)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.seed)
                model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    except ImportError as err:  # an attention kernel whose package is not installed (flash-attn)
        if recipe.model.attn_implementation is None:
            raise
        reason = " ".join(str(err).split())
        raise ValueError(f"model.attn_implementation={recipe.model.attn_implementation!r} cannot be used here "
                         f"({reason}); install its package or use 'sdpa' or 'eager'") from None
    except (RuntimeError, ValueError, TypeError) as err:  # a config the model's init cannot use
        if (not recipe.model.config_overrides or recipe.model.pretrained is not None
                or isinstance(err, torch.OutOfMemoryError)):
            raise
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"model.config_overrides={recipe.model.config_overrides!r} cannot build the model "
                         f"({reason})") from None
    return model.train()
