"""The examples a recipe trains and evaluates on: synthetic or Hugging Face."""


from mimose_cli.launcher.data.synthetic import build_synthetic

# Their position embeddings start after the padding index, so they hold pad_token_id + 1 fewer tokens.
PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "roberta-prelayernorm", "camembert", "longformer",
                        "data2vec-text", "xmod", "ibert")


def max_model_length(config):
    """The longest input the model's position embeddings allow; None when unlimited (XLNet)."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is None or positions < 0:
        return None
    if config.model_type in PADDING_OFFSET_TYPES:
        positions -= config.pad_token_id + 1
    return positions


def build_dataset(recipe, config) -> list:
    """The training examples: dicts of token-id lists and labels, the same for the same seed."""
    limit = max_model_length(config)
    if limit is not None and recipe.data.max_length > limit:
        raise ValueError(
            f"data.max_length={recipe.data.max_length} exceeds the {config.model_type} model's {limit} "
            f"positions; lower it to {limit} or raise the model's positions in model.config_overrides"
        )
    if recipe.data.source == "hf":
        from mimose_cli.launcher.data.hub import build_hf  # datasets is slow to import

        return build_hf(recipe, config)
    return build_synthetic(recipe, config)


def build_validation(recipe, config) -> list | None:
    """The validation examples (``data.validation_examples`` or ``data.validation_split``), None
    when the recipe has no validation split; call after ``build_dataset``, which checks the lengths."""
    if not recipe.data.has_validation:
        return None
    if recipe.data.source == "hf":
        from mimose_cli.launcher.data.hub import build_hf

        return build_hf(recipe, config, validation=True)
    return build_synthetic(recipe, config, validation=True)
