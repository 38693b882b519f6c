"""Real data: a Hugging Face data set (hub name, or local json/csv/tsv/parquet) tokenized for the task.

Column layouts: sequence_classification and causal_lm read ``data.text_fields`` (default
``text``) and ``data.label_field`` (default ``label``); multiple_choice reads SWAG's ``sent1``,
``sent2``, ``ending0..N-1``, ``label``; question_answering reads SQuAD's ``question``,
``context``, ``answers``. Each example is truncated to ``data.max_length`` (one feature per
QA example, no document stride).
"""

import warnings
from pathlib import Path

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
BUILDER_OPTIONS = {".tsv": {"sep": "\t"}}  # as datasets reads a .tsv in a data directory


def load_raw(data, validation: bool = False):
    """The ``data.split`` split of ``data.name`` (a local file, a local directory or a hub data
    set), or with ``validation`` the ``data.validation_split``: a local file, or another split of
    ``data.name``. A file that cannot be read as its type, or holds no rows, a split that is not
    there, or a hub name that cannot be reached, raises ValueError naming the key."""
    if not validation:
        if data.split != "train" and Path(data.name).is_file():
            raise ValueError(f"data.split={data.split!r}: data.name={data.name!r} is one file, which holds one "
                             "split; leave data.split at 'train', or give the file of that split as data.name")
        return _load_split(data.name, data.split, f"data.name={data.name!r}", data.config_name)
    split = data.validation_split
    if _looks_local(split) or Path(split).is_file():
        return _load_split(split, "validation", f"data.validation_split={split!r}", data.config_name)
    if Path(data.name).is_file():
        raise ValueError(f"data.validation_split={split!r}: data.name={data.name!r} is one file, which "
                         "holds one split; give the validation data's file instead")
    return _load_split(data.name, split, f"data.validation_split={split!r} of data.name={data.name!r}",
                       data.config_name)


def _looks_local(name: str) -> bool:
    return Path(name).suffix.lower() in LOCAL_BUILDERS or name.startswith((".", "/", "~"))


def _load_split(name: str, split: str, label: str, config_name):
    """The ``split`` of ``name`` (a local file, a local directory or a hub data set); errors begin
    with ``label``, the key the user wrote."""
    path = Path(name)
    local = _looks_local(name) or path.exists()
    if path.is_file():
        builder = LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{label}: expected a {', '.join(LOCAL_BUILDERS)} file")
        if path.stat().st_size == 0:
            raise ValueError(f"{label}: the file is empty")
        args, kwargs = (builder,), {"data_files": {split: str(path)}, **BUILDER_OPTIONS.get(path.suffix.lower(), {})}
    elif path.is_dir():
        args, kwargs = (str(path),), {}
    elif local:
        raise ValueError(f"{label}: no such file or directory")
    else:
        args, kwargs = (name, config_name), {}
    raw = _load(label, local, *args, split=split, **kwargs)
    if len(raw) == 0:
        raise ValueError(f"{label}: split {split!r} has no rows")
    if path.suffix.lower() == ".csv" and len(raw.column_names) == 1 and "\t" in raw.column_names[0]:
        raise ValueError(f"{label}: the file looks tab-separated (its header is one column, "
                         f"{raw.column_names[0]!r}); name it .tsv, or separate its columns with commas")
    return raw


def _load(label: str, local: bool, *args, **kwargs):
    """``datasets.load_dataset``, its failures on the user's input as ValueError beginning with
    ``label`` (the reason given is the cause's first line: "An error occurred while generating the
    dataset" says less than the pyarrow error under it)."""
    import datasets  # slow to import: only for hf recipes
    from datasets.exceptions import DatasetsError

    try:
        return datasets.load_dataset(*args, **kwargs)
    except (DatasetsError, OSError, ValueError, StopIteration) as err:
        cache, failed = Path(datasets.config.HF_DATASETS_CACHE), _file_error(err)
        if failed is not None and (cache == Path(failed.filename) or cache in Path(failed.filename).parents):
            raise OSError(f"the datasets cache {str(cache)!r} is not writable ({failed.filename}: {failed.strerror}); "
                          "set HF_DATASETS_CACHE to a directory you can write to") from None
        cause = str(err.__cause__ or err).strip().splitlines()
        reason = cause[0] if cause else type(err).__name__
        if local:
            raise ValueError(f"{label} cannot be read ({reason}); check the file") from None
        raise ValueError(f"{label} cannot be loaded from the Hugging Face Hub ({reason}); "
                         "check the name, or give a local file's path") from None


def _file_error(err: BaseException) -> OSError | None:
    """The first OSError naming a file in ``err``'s chain of causes, if any."""
    while err is not None:
        if isinstance(err, OSError) and err.filename:
            return err
        err = err.__cause__ or err.__context__
    return None


def load_tokenizer(recipe, config):
    """``data.tokenizer`` (or ``model.pretrained``), checked to fit the model's vocabulary."""
    from transformers import AutoTokenizer

    name = recipe.data.tokenizer or recipe.model.pretrained
    if name is None:
        raise ValueError("data.tokenizer is needed when data.source is hf and model.pretrained is unset")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:  # no such directory, no tokenizer files in it, hub unreachable
        key = "data.tokenizer" if recipe.data.tokenizer else "model.pretrained"
        raise ValueError(f"{key}={name!r} cannot be loaded as a tokenizer ({str(err).splitlines()[0]}); "
                         "expected a local tokenizer directory or a hub id") from None
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"data.tokenizer={name!r} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config.vocab_size}; set model.config_overrides: {{vocab_size: {len(tokenizer)}}}"
        )
    return tokenizer


def _columns(raw, names: list, where: str, texts: int = 0) -> dict:
    """The named columns as lists; the first ``texts`` of them must hold strings."""
    missing = [n for n in names if n not in raw.column_names]
    if missing:
        raise ValueError(f"{where}: column {missing[0]!r} not in the data set (columns: {', '.join(raw.column_names)})")
    columns = {n: list(raw[n]) for n in names}
    for name in names[:texts]:
        bad = [v for v in columns[name] if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{where}: column {name!r} holds {bad[0]!r}; expected text in every row")
    return columns


def _label_ids(values: list, limit: int, key: str, names: list | None = None) -> list:
    """Integer labels as they are; string labels numbered in sorted order of ``names``, the
    training split's labels (a validation split is numbered as the training split was; a label
    the training split does not have is refused), or of their own when None."""
    if values and all(isinstance(v, str) for v in values):
        if names is not None and set(values) - set(names):
            unknown = sorted(set(values) - set(names))[0]
            raise ValueError(f"validation label {unknown!r} does not occur in the training split "
                             f"(its labels: {', '.join(names)}); labels are numbered from the training split")
        names = sorted(set(values)) if names is None else names
        if len(names) > limit:
            raise ValueError(f"the labels are {len(names)} texts ({', '.join(map(repr, names[:6]))}"
                             f"{', ...' if len(names) > 6 else ''}) but {key}={limit}; set {key}={len(names)}")
        values = [names.index(v) for v in values]
    if any(v is None for v in values):
        raise ValueError(f"a row has no label (row {values.index(None) + 1}); give every row one")
    typed = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
    if typed:
        raise ValueError(f"label {typed[0]!r} is a {type(typed[0]).__name__}: expected integer class ids "
                         f"0..{limit - 1} ({key}={limit}), or text in every row")
    bad = [v for v in values if not 0 <= v < limit]
    if bad:
        raise ValueError(f"label {bad[0]!r} is out of range: expected 0..{limit - 1} ({key}={limit}), "
                         "or text in every row")
    return values


def _encode(tokenizer, first, second, max_length: int, **kwargs):
    # Segment ids come from the tokenizer's post-processor; the collator drops them for models without.
    return tokenizer(first, second, truncation=kwargs.pop("truncation", True), max_length=max_length,
                     return_token_type_ids=True, **kwargs)


def _rows(encoding, index: int) -> dict:
    ids = encoding["input_ids"][index]
    types = encoding.get("token_type_ids")
    return {"input_ids": ids, "token_type_ids": types[index] if types is not None else [0] * len(ids)}


def _label_field(task: str, data) -> str:
    return (data.label_field or "label") if task == "sequence_classification" else "label"


def text_label_names(raw, task: str, data) -> list | None:
    """The sorted text labels of a split (the training split's number every split), None when
    its labels are not text or the task has none."""
    field = _label_field(task, data)
    if task not in ("sequence_classification", "multiple_choice") or field not in raw.column_names:
        return None
    values = raw[field]
    return sorted(set(values)) if values and all(isinstance(v, str) for v in values) else None


def _classification(raw, tokenizer, data, names=None) -> list:
    fields = data.text_fields or ["text"]
    if len(fields) not in (1, 2):
        raise ValueError(f"data.text_fields={fields!r}: expected one or two column names")
    label_field = data.label_field or "label"
    cols = _columns(raw, [*fields, label_field], "data.text_fields / data.label_field", texts=len(fields))
    second = cols[fields[1]] if len(fields) == 2 else None
    enc = _encode(tokenizer, cols[fields[0]], second, data.max_length)
    labels = _label_ids(cols[label_field], data.num_labels, "data.num_labels", names)
    return [{**_rows(enc, i), "label": label} for i, label in enumerate(labels)]


def _causal_lm(raw, tokenizer, data, names=None) -> list:
    """One example per non-empty text; empty and whitespace-only texts (WikiText's blank lines)
    are dropped with a warning saying how many, since they hold no token to predict."""
    fields = data.text_fields or ["text"]
    texts = _columns(raw, fields[:1], "data.text_fields", texts=1)[fields[0]]
    kept = [t for t in texts if t.strip()]
    if not kept:
        raise ValueError(f"data.text_fields: every text in column {fields[0]!r} is empty; give a data set with text")
    if len(kept) < len(texts):
        warnings.warn(f"dropped {len(texts) - len(kept)} of {len(texts)} rows whose column {fields[0]!r} "
                      "is empty or only whitespace")
    enc = _encode(tokenizer, kept, None, data.max_length)
    return [_rows(enc, i) for i in range(len(kept))]


def _multiple_choice(raw, tokenizer, data, names=None) -> list:
    choices = data.num_choices
    endings = [f"ending{c}" for c in range(choices)]
    cols = _columns(raw, ["sent1", "sent2", *endings, "label"], "multiple_choice (SWAG layout)",
                    texts=2 + choices)
    first = [s for s in cols["sent1"] for _ in range(choices)]
    second = [f"{s} {cols[e][i]}" for i, s in enumerate(cols["sent2"]) for e in endings]
    enc = _encode(tokenizer, first, second, data.max_length)
    labels = _label_ids(cols["label"], choices, "data.num_choices", names)
    examples = []
    for i, label in enumerate(labels):
        rows = [_rows(enc, i * choices + c) for c in range(choices)]
        examples.append({key: [r[key] for r in rows] for key in ("input_ids", "token_type_ids")} | {"label": label})
    return examples


def _answer_tokens(encoding, index: int, answer_start: int, answer_end: int, cls_index: int) -> tuple:
    """Token (start, end) of the answer's characters; the CLS token when truncation cut it off."""
    start = end = None
    for token, (offset, seq) in enumerate(zip(encoding["offset_mapping"][index], encoding.sequence_ids(index))):
        if seq != 1:
            continue
        if start is None and offset[1] > answer_start:
            start = token
        if offset[0] < answer_end:
            end = token
    if start is None or end is None or end < start or encoding["offset_mapping"][index][end][1] < answer_end:
        return cls_index, cls_index
    return start, end


def _is_answer(answers) -> bool:
    """SQuAD's answers: {text: [...], answer_start: [...]}, both empty when unanswerable (v2)."""
    if not isinstance(answers, dict):
        return False
    texts, starts = answers.get("text"), answers.get("answer_start")
    return (isinstance(texts, list) and isinstance(starts, list) and len(texts) == len(starts)
            and all(isinstance(t, str) for t in texts)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in starts))


def _question_answering(raw, tokenizer, data, names=None) -> list:
    if not tokenizer.is_fast:
        raise ValueError("data.tokenizer: question_answering needs a fast tokenizer for character offsets")
    cols = _columns(raw, ["question", "context", "answers"], "question_answering (SQuAD layout)", texts=2)
    bad = [a for a in cols["answers"] if not _is_answer(a)]
    if bad:
        raise ValueError(f"question_answering (SQuAD layout): answers={bad[0]!r}; expected "
                         "{text: [string], answer_start: [integer]} in every row")
    enc = _encode(tokenizer, cols["question"], cols["context"], data.max_length,
                  truncation="only_second", return_offsets_mapping=True)
    examples = []
    for i, answers in enumerate(cols["answers"]):
        row = _rows(enc, i)
        ids = row["input_ids"]
        cls_index = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        if answers["answer_start"]:
            char_start = answers["answer_start"][0]
            start, end = _answer_tokens(enc, i, char_start, char_start + len(answers["text"][0]), cls_index)
        else:  # SQuAD v2 unanswerable
            start = end = cls_index
        examples.append({**row, "start_positions": start, "end_positions": end})
    return examples


TASK_READERS = {
    "sequence_classification": _classification,
    "causal_lm": _causal_lm,
    "multiple_choice": _multiple_choice,
    "question_answering": _question_answering,
}


def _training_rows(data):
    """The first ``data.num_examples`` rows of the training split (as run_glue's
    ``max_train_samples``); all of them when None, and a warning when the split has fewer."""
    raw, count = load_raw(data, False), data.num_examples
    if count is None:
        return raw
    if count > len(raw):
        warnings.warn(f"data.num_examples={count} but the split has {len(raw)} rows; training on all {len(raw)}")
        return raw
    return raw.select(range(count))


def build_hf(recipe, config, validation: bool = False) -> list:
    """Examples of ``data.name`` (``validation``: of ``data.validation_split``) tokenized by
    ``data.tokenizer`` for ``recipe.task``, in file order."""
    raw = load_raw(recipe.data, True) if validation else _training_rows(recipe.data)
    names = text_label_names(_training_rows(recipe.data), recipe.task, recipe.data) if validation else None
    tokenizer = load_tokenizer(recipe, config)
    pair = recipe.task in ("multiple_choice", "question_answering") or len(recipe.data.text_fields or ()) == 2
    special = tokenizer.num_special_tokens_to_add(pair=pair)
    if recipe.data.max_length <= special:
        raise ValueError(f"data.max_length={recipe.data.max_length} leaves no room for text: the tokenizer adds "
                         f"{special} special tokens to each example; raise it to at least {special + 1}")
    return TASK_READERS[recipe.task](raw, tokenizer, recipe.data, names)
