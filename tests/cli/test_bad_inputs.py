"""Every user mistake ends in one line on stderr naming the key, value or file, with exit code 2
(usage) or 1 (runtime), never a traceback; and it fails as early as it can.

Each case drives the real CLI. ``stage`` says how far a case may get, enforced by making the
next step impossible: "check" cases fail before any model config is made, "data" cases before
the model is built; "model" cases may build the tiny quickstart model (a few of them train).
"""

import os
from dataclasses import dataclass, field

import datasets  # imported here, not inside CliRunner: its log handler keeps the stderr it sees
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

import mimose_cli.launcher.train
from mimose_cli.cli import app

from helpers import QUICKSTART

runner = CliRunner()
FAST = ["training.max_steps=2", "training.batch_size=2", "data.num_examples=8", "--view", "none"]
OUT = ["--out", "{tmp}/runs"]
HF = ["task=sequence_classification", "data.source=hf", "data.tokenizer={tok}", "data.max_length=32",
      *FAST, *OUT]
A_DIRECTORY = object()  # a ``files`` value: make a directory there
A_FIFO = object()  # a named pipe
A_LOOP = object()  # a symbolic link to itself
A_DANGLING = object()  # a symbolic link to 'nowhere', which does not exist
CSV = "text,label\nthe cat sat,0\na dog ran,1\n"
STEP = '{"step": 0, "loss": 1.0, "memory/peak_bytes": 5}\n'
RUN = {"run/metrics.jsonl": STEP}


@dataclass
class Case:
    id: str
    args: list
    named: str
    """What the error line must contain: the key, value or file (placeholders as in ``args``)."""
    code: int = 2
    files: dict = field(default_factory=dict)
    stage: str = "check"
    datasets_cache: str | None = None
    """Where the ``datasets`` library caches (as HF_DATASETS_CACHE sets it); None: as it is."""


def train(id, *overrides, named, files=None, code=2, stage="check"):
    """``mimose train`` on ``r.yaml`` (the quickstart unless ``files`` gives one)."""
    files = files if files is not None else {}
    recipe = "{tmp}/r.yaml" if "r.yaml" in files else "{quick}"
    return Case(id, ["train", recipe, *FAST, *OUT, *overrides], named, code, files, stage)


def recipe_file(id, text, named):
    return Case(id, ["train", "{tmp}/r.yaml"], named, files={"r.yaml": text})


def hf(id, *overrides, named, files, stage="data"):
    return Case(id, ["train", "{quick}", *HF, *overrides], named, 2, files, stage)


def report(id, files, named, target="run"):
    return Case(id, ["report", "{tmp}/" + target], named, 2, files)


def compare(id, *args, named, files=None):
    return Case(id, ["compare", "{quick}", "--budgets", "40MB", "--view", "none", *args], named, 2,
                files or {})


RECIPE_FILES = [
    recipe_file("not-utf8", b"task: multiple_choice\nseed: \xff\xfe\n", "r.yaml: byte 28 is not UTF-8"),
    recipe_file("empty", "", "r.yaml: the recipe is empty"),
    recipe_file("only-comments", "# nothing yet\n", "r.yaml: the recipe is empty"),
    recipe_file("duplicate-section", "training:\n  lr: 1.0\ntraining:\n  batch_size: 2\n",
                "key 'training' appears twice (first on line 1)"),
    recipe_file("duplicate-nested-key", "training:\n  lr: 1.0\n  lr: 2.0\n", "key 'lr' appears twice"),
    recipe_file("anchor-and-alias", "seed: &s 3\nplanner:\n  mimose:\n    granularity: *s\n", "&s: anchors and aliases"),
    recipe_file("merge-key", "base: &b {lr: 1.0}\ntraining:\n  <<: *b\n", "&b"),
    recipe_file("alias-bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a]\n"
                "c: [*b, *b, *b, *b, *b, *b, *b, *b]\n", "&a"),
    recipe_file("python-tag", "seed: !!python/object/apply:os.getpid []\n", "python/object/apply:os.getpid"),
    recipe_file("unclosed-list", "training:\n  lr: [1.0,\n", "r.yaml: not valid YAML: line 3"),
    recipe_file("tab-indent", "training:\n\tlr: 1.0\n", "r.yaml: not valid YAML"),
    recipe_file("top-level-list", "- task\n", "r.yaml: expected a mapping at the top level, got list"),
    recipe_file("top-level-text", "hello\n", "r.yaml: expected a mapping at the top level, got str"),
    recipe_file("unknown-top-key", "lr: 0.1\n", "unknown key lr"),
    recipe_file("null-section", "training: null\n", "training=None is invalid"),
    Case("missing-file", ["train", "{tmp}/nope.yaml"], "nope.yaml' not found"),
    Case("recipe-is-a-directory", ["train", "{tmp}/d.yaml"], "d.yaml' is a directory",
         files={"d.yaml": A_DIRECTORY}),
]

OVERRIDES = [
    train("override-python-tag", "training.lr=!!python/object/apply:os.system ['true']",
          named="python/object/apply:os.system"),
    train("override-python-name", "seed=!!python/name:os.system", named="python/name:os.system"),
    train("override-unclosed-list", "training.lr=[1,", named="override 'training.lr=[1,'"),
    train("override-unclosed-quote", "seed='3", named="override \"seed='3\""),
    train("override-without-equals", "training.lr", named="override 'training.lr': expected key=value"),
    train("full-selective-not-a-boolean", "planner.full.selective=selective",
          named="planner.full.selective='selective' is invalid; expected true or false"),
    train("selective-choices-with-a-sheltered-estimate", "planner.mimose.estimate=sheltered",
          "planner.mimose.choices=offload",
          named="planner.mimose.choices='offload' is invalid; expected block with planner.mimose.estimate: "
                "sheltered"),
    train("override-alias", "seed=*a", named="*a: anchors and aliases"),
    train("override-into-a-value", "seed.x=1", named="'seed.x' goes inside 'seed'"),
    train("override-unknown-key", "training.nope=1", named="unknown key training.nope"),
    train("override-unknown-section", "trainng.max_steps=5",
          named="override 'trainng.max_steps=5': unknown key trainng"),
    Case("override-without-recipe", ["train", "training.max_steps=5"],
         "missing RECIPE: 'training.max_steps=5' is an override (key=value); give the recipe file first"),
    train("override-duplicate-key", "model.config_overrides={a: 1, a: 2}", named="key 'a' appears twice"),
]

VALUES = [
    train("lr-nan", "training.lr=.nan", named="training.lr=nan is invalid; expected a finite number"),
    train("lr-inf", "training.lr=.inf", named="training.lr=inf is invalid; expected a finite number"),
    train("lr-minus-inf", "training.lr=-.inf", named="training.lr=-inf"),
    train("lr-zero", "training.lr=0.0", named="training.lr=0.0"),
    train("lr-negative", "training.lr=-1e-3", named="training.lr=-0.001"),
    train("lr-text", "training.lr=fast", named="training.lr='fast'"),
    train("weight-decay-nan", "training.weight_decay=.nan", named="training.weight_decay=nan"),
    train("weight-decay-negative", "training.weight_decay=-0.1", named="training.weight_decay=-0.1"),
    train("grad-norm-inf", "training.max_grad_norm=.inf", named="training.max_grad_norm=inf"),
    train("grad-norm-zero", "training.max_grad_norm=0.0", named="training.max_grad_norm=0.0"),
    train("max-steps-zero", "training.max_steps=0", named="training.max_steps=0"),
    train("max-steps-negative", "training.max_steps=-1", named="training.max_steps=-1"),
    train("batch-size-zero", "training.batch_size=0", named="training.batch_size=0"),
    train("epochs-zero", "training.epochs=0", named="training.epochs=0"),
    train("warmup-negative", "training.warmup_steps=-1", named="training.warmup_steps=-1"),
    train("accumulation-zero", "training.gradient_accumulation_steps=0",
          named="training.gradient_accumulation_steps=0"),
    train("accumulation-over-the-epochs", "training.max_steps=null", "training.gradient_accumulation_steps=13",
          named="training.gradient_accumulation_steps=13 needs that many batches", stage="data"),
    train("log-every-zero", "training.log_every=0", named="training.log_every=0"),
    train("precision-fp8", "training.precision=fp8", named="training.precision='fp8'"),
    train("seed-too-large", f"seed={2**64}", named=f"seed={2**64} is invalid"),
    train("seed-too-small", f"seed={-2**63 - 1}", named=f"seed={-2**63 - 1} is invalid"),
    train("seed-float", "seed=1.5", named="seed=1.5"),
    train("seed-text", "seed=abc", named="seed='abc'"),
    train("budget-400-digits", "--budget", "9" * 400, named="budget='99999"),
    train("budget-overflows-float", "budget=1e400", named="budget='inf'"),
    train("budget-text", "--budget", "lots", named="budget='lots'"),
    train("budget-zero", "budget=0", named="budget='0'"),
    train("budget-negative", "--budget", "-1MB", named="budget='-1MB'"),
    train("budget-inf", "budget=.inf", named="budget='inf'"),
    train("budget-unit", "--budget", "6GX", named="budget='6GX'"),
    train("max-length-under-preset", "data.max_length=10",
          named="data.max_length=10 is invalid; expected at least 20, the swag preset's shortest"),
    train("min-length-too-small", "data.min_length=2", named="data.min_length=2"),
    train("min-length-over-max", "data.min_length=600", named="data.min_length=600"),
    train("length-mean-zero", "data.length_mean=0.0", named="data.length_mean=0.0"),
    train("length-mean-nan", "data.length_mean=.nan", named="data.length_mean=nan"),
    train("length-std-negative", "data.length_std=-1.0", named="data.length_std=-1.0"),
    train("num-examples-zero", "data.num_examples=0", named="data.num_examples=0"),
    train("preset-unknown", "data.preset=imdb", named="data.preset='imdb'"),
    train("hf-without-name", "data.source=hf", named="data.name=None"),
    train("margin-over-budget", "planner.safety_margin=1GB", named="planner.safety_margin='1GB' is invalid; "
          "expected less than the budget (40MB)"),
    train("margin-equals-budget", "planner.safety_margin=40MB", named="planner.safety_margin='40MB'"),
    train("margin-text", "planner.safety_margin=lots", named="planner.safety_margin='lots'"),
    train("unknown-planner-option", "planner.mimose={bogus: 1}",
          named="unknown key planner.mimose.bogus; expected one of estimate, sheltered_steps"),
    train("options-of-a-planner-without-options", "--planner", "dtr", "planner.dtr={cost_fn: 5}",
          named="unknown key planner.dtr; expected one of name, safety_margin, mimose, sublinear"),
    train("unknown-sublinear-variant", "--planner", "sublinear", "planner.sublinear.variant=fast",
          named="planner.sublinear.variant='fast' is invalid; expected 'greedy', 'sqrt' or 'chen'"),
    train("options-not-a-mapping", "planner.mimose=[1]", named="planner.mimose=[1] is invalid; expected a dictionary"),
    train("options-of-an-earlier-release", "--planner", "dtr", "planner.options={cost_fn: 5}",
          named="override 'planner.options={cost_fn: 5}': planner.options was split into one section per planner"),
    train("option-wrong-type", "planner.mimose.bucket=fast", named="planner.mimose.bucket='fast' is invalid"),
    train("planner-unknown", "planner.name=magic", named="planner.name='magic'"),
    train("planner-flag-unknown", "--planner", "magic", named="planner.name='magic'"),
    train("sheltered-steps-zero", "planner.mimose.sheltered_steps=0", named="planner.mimose.sheltered_steps=0"),
    train("granularity-zero", "planner.mimose.granularity=0", named="planner.mimose.granularity=0"),
    train("device-tpu", "--device", "tpu", named="device='tpu'"),
    train("task-unknown", "task=translation", named="task='translation'"),
    train("model-size-huge", "model.size=huge", named="model.size='huge'"),
    train("max-steps-flag-zero", "--max-steps", "0", named="--max-steps: training.max_steps=0 is invalid"),
    train("budget-flag-unit", "--budget", "6XB", named="--budget: budget='6XB' is invalid"),
    train("view-bogus", "--view", "bogus", named="--view 'bogus' is invalid; expected one of auto, live, plain, none"),
    train("eval-every-without-validation", "training.eval_every=2",
          named="training.eval_every=2 is invalid; expected null without a validation split"),
    train("eval-every-zero", "data.validation_examples=8", "training.eval_every=0", named="training.eval_every=0"),
    train("validation-examples-zero", "data.validation_examples=0", named="data.validation_examples=0"),
    train("validation-split-of-synthetic-data", "data.validation_split=validation",
          named="data.validation_split='validation' is invalid; expected null when data.source is synthetic"),
    train("validation-examples-of-hf-data", "data.source=hf", "data.name=d.csv", "data.validation_examples=8",
          named="data.validation_examples=8 is invalid; expected null when data.source is hf"),
]

OUT_DIRS = [
    train("out-is-a-file", "--out", "{tmp}/file", named="--out '{tmp}/file' is a file", files={"file": "x"}),
    train("out-under-a-file", "--out", "{tmp}/file/runs", named="{tmp}/file/runs' is not writable",
          files={"file": "x"}),
    train("out-unwritable", "--out", "/sys/mimose-test", named="'/sys/mimose-test' is not writable"),
    Case("out-dir-key-is-a-file", ["train", "{quick}", "out_dir={tmp}/file"], "out_dir='{tmp}/file' is a file",
         files={"file": "x"}),
    train("out-a-dangling-link", "--out", "{tmp}/link",
          named="--out '{tmp}/link' is a symbolic link to 'nowhere', which does not exist; create that directory, "
                "or remove the link", files={"link": A_DANGLING}),
    train("out-under-a-dangling-link", "--out", "{tmp}/link/runs",
          named="--out '{tmp}/link/runs' lies under '{tmp}/link', which is a symbolic link to 'nowhere'",
          files={"link": A_DANGLING}),
]

MODEL_AND_DEVICE = [
    train("model-type-unknown", "model.type=nope", named="model.type='nope'", stage="data"),
    train("config-override-unknown", "model.config_overrides={hidden_sise: 8}",
          named="model.config_overrides.hidden_sise", stage="data"),
    train("max-length-over-positions", "data.max_length=1000",
          named="data.max_length=1000 exceeds the bert model's 512 positions", stage="data"),
    train("pretrained-missing", "model.pretrained={tmp}/no-model", named="model.pretrained='{tmp}/no-model'",
          stage="data"),
    train("pretrained-hub-offline", "model.pretrained=someone/no-such-model",
          named="model.pretrained='someone/no-such-model'", stage="data"),
    train("cuda-without-a-gpu", "--device", "cuda", named="device='cuda' but no CUDA GPU is visible",
          stage="model"),  # resolve_device, the trainer's first step
    train("no-multiple-choice-head", "model.type=gpt2", named="model.type='gpt2' has no multiple_choice",
          stage="model"),
    train("blocks-a-number", "model.blocks=5", named="model.blocks=5 is invalid; expected a glob over module names"),
    train("blocks-list-with-a-number", "model.blocks=[bert.*, 5]", named="model.blocks=['bert.*', 5] is invalid"),
    train("blocks-one-glob-of-two-matches-nothing", "model.blocks=[bert.encoder.layer.*, encoder.zzz.*]",
          named="blocks='encoder.zzz.*' (model.blocks in a recipe) matches no module", stage="model"),
    train("blocks-match-nothing", "model.blocks=encoder.zzz.*", named="blocks='encoder.zzz.*' (model.blocks in a recipe) matches no module",
          stage="model"),
    train("budget-below-the-weights", "--budget", "1", named="budget 1 (1 B) cannot hold the model's weights",
          code=1, stage="model"),
    train("loss-diverges", "training.lr=1e30", "training.max_steps=3",
          named="at step 2: training diverged; lower training.lr (now 1e+30)", code=1, stage="model"),
    train("config-override-breaks-init", "model.config_overrides={initializer_range: .nan}",
          named="model.config_overrides={'initializer_range': nan} cannot build the model (normal expects std",
          stage="model"),
    train("weights-not-finite", "model.config_overrides={initializer_range: 1.0e+30}",
          named="at step 0, before any update: the model's weights hold NaN or inf", code=1, stage="model"),
    train("one-label", "task=sequence_classification", "data.preset=qqp", "data.num_labels=1",
          named="data.num_labels=1 is invalid; expected greater than or equal to 2"),
    train("out-into-a-run-directory", "--out", "{tmp}/run", files={"run/metrics.jsonl": ""},
          named="is a run (or compare) directory; out_dir names where new run directories go"),
    train("attention-kernel-not-installed", "model.attn_implementation=flash_attention_2",
          named="model.attn_implementation='flash_attention_2' cannot be used here", stage="model"),
    train("batch-beyond-host-memory", "training.batch_size=1000000000",
          named="does not fit in this machine's memory; lower training.batch_size", code=1, stage="model"),
    Case("recipe-is-dev-null", ["train", "/dev/null", *FAST, *OUT],
         "recipe file '/dev/null' is a device or special file"),
    train("recipe-is-a-fifo", files={"r.yaml": A_FIFO}, named="recipe file '{tmp}/r.yaml' is a pipe"),
    train("recipe-is-a-symlink-loop", files={"r.yaml": A_LOOP},
          named="recipe file '{tmp}/r.yaml' is a loop of symbolic links"),
    train("override-nested-too-deep", "model.config_overrides={x: " + "[" * 500 + "]" * 500 + "}",
          named="nested deeper than Python can read"),
    recipe_file("recipe-nested-too-deep", "model:\n  config_overrides:\n    x: " + "[" * 500 + "]" * 500 + "\n",
                "nested deeper than Python can read"),
]

SWAG = "sent1,sent2,ending0,label\nthe cat,sat,on the mat,0\n"
SQUAD = '{"question": "what", "context": "the cat sat", "answers": "the cat"}\n'
HF_DATA = [
    hf("hf-missing-csv", "data.name={tmp}/nope.csv", named="data.name='{tmp}/nope.csv': no such file", files={}),
    hf("hf-missing-json", "data.name={tmp}/nope.json", named="nope.json': no such file", files={}),
    hf("hf-missing-parquet", "data.name={tmp}/nope.parquet", named="nope.parquet': no such file", files={}),
    hf("hf-empty-csv", "data.name={tmp}/d.csv", named="d.csv': the file is empty", files={"d.csv": ""}),
    hf("hf-empty-json", "data.name={tmp}/d.json", named="d.json': the file is empty", files={"d.json": ""}),
    hf("hf-empty-parquet", "data.name={tmp}/d.parquet", named="d.parquet': the file is empty",
       files={"d.parquet": b""}),
    hf("hf-header-only-csv", "data.name={tmp}/d.csv", named="d.csv'", files={"d.csv": "text,label\n"}),
    hf("hf-corrupt-json", "data.name={tmp}/d.json", named="d.json' cannot be read",
       files={"d.json": '{"text": "a", "label": 0}\n{"text": \n'}),
    hf("hf-binary-json", "data.name={tmp}/d.jsonl", named="d.jsonl' cannot be read",
       files={"d.jsonl": bytes(range(256))}),
    hf("hf-corrupt-csv", "data.name={tmp}/d.csv", named="d.csv' cannot be read",
       files={"d.csv": 'text,label\n"a,0\nb,1,2,3\n'}),
    hf("hf-corrupt-parquet", "data.name={tmp}/d.parquet", named="d.parquet' cannot be read",
       files={"d.parquet": b"PAR1" + bytes(range(200))}),
    hf("hf-unsupported-suffix", "data.name={tmp}/d.txt", named="d.txt': expected a .json", files={"d.txt": CSV}),
    hf("hf-empty-directory", "data.name={tmp}/d", named="data.name='{tmp}/d'", files={"d": A_DIRECTORY}),
    hf("hf-hub-name-offline", "data.name=someone/no_such_data",
       named="data.name='someone/no_such_data' cannot be loaded from the Hugging Face Hub", files={}),
    hf("hf-missing-text-column", "data.name={tmp}/d.csv", named="column 'text' not in the data set",
       files={"d.csv": "sentence,label\na dog,0\n"}),
    hf("hf-tab-separated-csv", "data.name={tmp}/d.csv",
       named="data.name='{tmp}/d.csv': the file looks tab-separated (its header is one column, 'text\\tlabel'); "
             "name it .tsv, or separate its columns with commas", files={"d.csv": CSV.replace(",", "\t")}),
    Case("hf-datasets-cache-unwritable", ["train", "{quick}", *HF, "data.name={tmp}/d.csv"],
         "the datasets cache '{tmp}/file/cache' is not writable ({tmp}/file/cache: Not a directory); "
         "set HF_DATASETS_CACHE to a directory you can write to", code=1, files={"d.csv": CSV, "file": "x"},
         stage="data", datasets_cache="{tmp}/file/cache"),
    hf("hf-missing-label-column", "data.name={tmp}/d.csv", named="column 'label' not in the data set",
       files={"d.csv": "text,gold\na dog,0\n"}),
    hf("hf-wrong-text-fields", "data.name={tmp}/d.csv", "data.text_fields=[q1]", named="column 'q1'",
       files={"d.csv": CSV}),
    hf("hf-three-text-fields", "data.name={tmp}/d.csv", "data.text_fields=[a, b, c]",
       named="data.text_fields=['a', 'b', 'c']", files={"d.csv": CSV}),
    hf("hf-label-out-of-range", "data.name={tmp}/d.csv", named="label 5 is out of range: expected 0..1",
       files={"d.csv": "text,label\na dog,5\n"}),
    hf("hf-label-negative", "data.name={tmp}/d.jsonl", named="label -1 is out of range",
       files={"d.jsonl": '{"text": "a dog", "label": -1}\n'}),
    hf("hf-label-missing-value", "data.name={tmp}/d.jsonl", named="a row has no label (row 2)",
       files={"d.jsonl": '{"text": "a dog", "label": 0}\n{"text": "a cat", "label": null}\n'}),
    hf("hf-label-a-float", "data.name={tmp}/d.jsonl", named="label 0.5 is a float: expected integer class ids",
       files={"d.jsonl": '{"text": "a dog", "label": 0.5}\n'}),
    hf("hf-label-a-bool", "data.name={tmp}/d.jsonl", named="label True is a bool: expected integer class ids",
       files={"d.jsonl": '{"text": "a dog", "label": true}\n'}),
    hf("hf-more-text-labels-than-num-labels", "data.name={tmp}/d.csv",
       named="the labels are 3 texts ('neg', 'neu', 'pos') but data.num_labels=2; set data.num_labels=3",
       files={"d.csv": "text,label\nthe cat,pos\na dog,neg\nthe dog,neu\n"}),
    hf("hf-text-not-text", "data.name={tmp}/d.jsonl", named="column 'text' holds 7",
       files={"d.jsonl": '{"text": 7, "label": 0}\n'}),
    hf("hf-text-missing-value", "data.name={tmp}/d.jsonl", named="column 'text' holds None",
       files={"d.jsonl": '{"text": "a dog", "label": 0}\n{"text": null, "label": 1}\n'}),
    hf("hf-squad-missing-answers", "data.name={tmp}/d.jsonl", "task=question_answering",
       named="answers=None", files={"d.jsonl": '{"question": "what", "context": "the cat", "answers": null}\n'}),
    hf("hf-swag-missing-ending", "data.name={tmp}/d.csv", "task=multiple_choice", "data.num_choices=2",
       named="column 'ending1'", files={"d.csv": SWAG}),
    hf("hf-squad-bad-answers", "data.name={tmp}/d.jsonl", "task=question_answering",
       named="answers='the cat'", files={"d.jsonl": SQUAD}),
    hf("hf-tokenizer-unset", "data.name={tmp}/d.csv", "data.tokenizer=null", named="data.tokenizer is needed",
       files={"d.csv": CSV}),
    hf("hf-tokenizer-missing-dir", "data.name={tmp}/d.csv", "data.tokenizer={tmp}/no-tok",
       named="data.tokenizer='{tmp}/no-tok' cannot be loaded", files={"d.csv": CSV}),
    hf("hf-tokenizer-empty-dir", "data.name={tmp}/d.csv", "data.tokenizer={tmp}/tok",
       named="data.tokenizer='{tmp}/tok' cannot be loaded", files={"d.csv": CSV, "tok": A_DIRECTORY}),
    hf("hf-tokenizer-hub-offline", "data.name={tmp}/d.csv", "data.tokenizer=someone/no-tok",
       named="data.tokenizer='someone/no-tok' cannot be loaded", files={"d.csv": CSV}),
    hf("hf-tokenizer-over-vocabulary", "data.name={tmp}/d.csv", "model.config_overrides={vocab_size: 4}",
       named="vocab_size", files={"d.csv": CSV}),
    hf("hf-validation-split-of-one-file", "data.name={tmp}/d.csv", "data.validation_split=validation",
       named="data.validation_split='validation': data.name='{tmp}/d.csv' is one file", files={"d.csv": CSV}),
    hf("hf-training-split-of-one-file", "data.name={tmp}/d.csv", "data.split=validation",
       named="data.split='validation': data.name='{tmp}/d.csv' is one file", files={"d.csv": CSV}),
    hf("hf-max-length-under-special-tokens-of-pairs", "data.name={tmp}/d.csv", "data.text_fields=[a, b]",
       "data.max_length=3", named="data.max_length=3 leaves no room for text: the tokenizer adds 3 special tokens",
       files={"d.csv": "a,b,label\nthe cat,sat,0\na dog,ran,1\n"}),
    hf("hf-max-length-under-special-tokens", "data.name={tmp}/d.csv", "data.max_length=1",
       named="data.max_length=1 leaves no room for text: the tokenizer adds 2 special tokens", files={"d.csv": CSV}),
    hf("hf-validation-file-missing", "data.name={tmp}/d.csv", "data.validation_split={tmp}/v.csv",
       named="data.validation_split='{tmp}/v.csv': no such file", files={"d.csv": CSV}),
    hf("hf-validation-split-not-in-directory", "data.name={tmp}/d", "data.validation_split=validation",
       named="data.validation_split='validation' of data.name='{tmp}/d' cannot be read (Unknown split",
       files={"d/train.csv": CSV}),
    hf("hf-validation-label-out-of-range", "data.name={tmp}/d.csv", "data.validation_split={tmp}/v.csv",
       named="label 5 is out of range", files={"d.csv": CSV, "v.csv": "text,label\na dog,5\n"}),
]

REPORTS = [
    report("metrics-random-bytes", {"run/metrics.jsonl": bytes(range(128, 256))}, "run/metrics.jsonl: byte 0"),
    report("metrics-line-a-list", {"run/metrics.jsonl": "[1, 2]\n"}, "metrics.jsonl line 1: expected a JSON object"),
    report("metrics-line-a-number", {"run/metrics.jsonl": '{"step": 0}\n3\n'}, "metrics.jsonl line 2"),
    report("metrics-line-a-string", {"run/metrics.jsonl": '"step"\n'}, "got str"),
    report("metrics-garbage-line", {"run/metrics.jsonl": '{"step": 0}\n{garbage\n{"step": 1}\n'},
           "metrics.jsonl line 2: not JSON"),
    report("metrics-missing-step", {"run/metrics.jsonl": '{"loss": 1.0}\n'},
           "metrics.jsonl record 1: key 'step' is missing"),
    report("metrics-step-without-loss", {"run/metrics.jsonl": '{"step": 0, "input_size": [2, 8]}\n'},
           "metrics.jsonl record 1: key 'loss' is missing"),
    report("metrics-step-without-peak", {"run/metrics.jsonl": STEP + '{"step": 1, "loss": 1.0}\n'},
           "metrics.jsonl record 2: key 'memory/peak_bytes' is missing"),
    report("metrics-step-text", {"run/metrics.jsonl": '{"step": "first"}\n'}, "step='first' is invalid"),
    report("metrics-peak-text", {"run/metrics.jsonl": '{"step": 0, "memory/peak_bytes": "big"}\n'},
           "memory/peak_bytes='big'"),
    report("metrics-plan-not-list", {"run/metrics.jsonl": '{"step": 0, "plan": 3}\n'}, "plan=3"),
    report("metrics-is-a-directory", {"run/metrics.jsonl": A_DIRECTORY}, "run/metrics.jsonl is not a file"),
    report("summary-torn", {**RUN, "run/summary.json": '{"status": "compl'}, "run/summary.json: not valid JSON"),
    report("summary-a-list", {**RUN, "run/summary.json": "[1, 2]"},
           "run/summary.json: expected a JSON object, got list"),
    report("summary-no-status", {**RUN, "run/summary.json": "{}"}, "summary.json: key status is missing"),
    report("summary-status-number", {**RUN, "run/summary.json": '{"status": 3}'}, "status=3"),
    report("summary-peak-text", {**RUN, "run/summary.json": '{"status": "completed", "peak_bytes": "9 GB"}'},
           "summary.json: peak_bytes='9 GB'"),
    report("summary-planner-list", {**RUN, "run/summary.json": '{"status": "completed", "planner": []}'},
           "summary.json: planner=[]"),
    report("summary-random-bytes", {**RUN, "run/summary.json": bytes(range(255, 0, -1))}, "run/summary.json"),
    report("summary-is-a-directory", {**RUN, "run/summary.json": A_DIRECTORY}, "run/summary.json is not a file"),
    report("recipe-corrupt", {**RUN, "run/recipe.yaml": "budget: [1,\n"}, "run/recipe.yaml"),
    report("recipe-bad-budget", {**RUN, "run/recipe.yaml": "budget: lots\n"}, "run/recipe.yaml"),
    report("compare-random-bytes", {"c/compare.json": bytes(range(256))}, "c/compare.json", "c"),
    report("compare-not-json", {"c/compare.json": "hello"}, "c/compare.json: not valid JSON", "c"),
    report("compare-a-list", {"c/compare.json": "[]"}, "c/compare.json: expected a JSON object", "c"),
    report("compare-no-budgets", {"c/compare.json": "{}"}, "c/compare.json: key budgets is missing", "c"),
    report("compare-budgets-not-list", {"c/compare.json": '{"budgets": 3}'}, "budgets=3", "c"),
    report("compare-run-without-planner",
           {"c/compare.json": '{"budgets": [{"budget": "1MB", "budget_bytes": 1, "runs": [{"status": "oom", '
                              '"steps": 1}]}]}'}, "key budgets[0].runs[0].planner is missing", "c"),
    report("compare-is-a-directory", {"c/compare.json": A_DIRECTORY}, "c/compare.json is not a file", "c"),
    report("plots-a-dangling-link", {**RUN, "run/plots": A_DANGLING},
           "run/plots, where the plots go, is a symbolic link to 'nowhere', which does not exist"),
    report("report-on-a-file", {"run": "x"}, "run is not a run directory (a file)"),
    report("report-on-nothing", {}, "run is not a run directory (no such directory)"),
    report("report-on-an-empty-directory", {"run": A_DIRECTORY}, "run is not a run directory (no metrics.jsonl)"),
]

COMPARES = [
    compare("compare-steps-negative", "--steps", "-1", named="error: steps=-1 is invalid"),
    compare("compare-steps-zero", "--steps", "0", named="error: steps=0 is invalid"),
    compare("compare-repeats-zero", "--repeats", "0", named="repeats=0 is invalid"),
    compare("compare-unknown-baseline", "--baselines", "sublinear,dtx", named="unknown planner 'dtx'"),
    compare("compare-unknown-variant", "--baselines", "sublinear:fast",
            named="compare sublinear:fast: planner.sublinear.variant='fast'"),
    compare("compare-variant-of-a-planner-without", "--baselines", "dtr:fast",
            named="baseline 'dtr:fast': dtr has no variants (those that do: mimose:block|selective|offload, "
                  "oracle:block|selective|offload, sublinear:greedy|sqrt|chen); write dtr alone"),
    compare("compare-variant-left-empty", "--baselines", "sublinear:",
            named="baseline 'sublinear:' names no variant after the colon; write sublinear alone or "
                  "sublinear:greedy|sqrt|chen"),
    compare("compare-selective-variant-of-a-sheltered-recipe", "--baselines", "mimose:selective",
            "planner.mimose.estimate=sheltered",
            named="compare mimose:selective: planner.mimose.choices='selective' is invalid; expected block "
                  "with planner.mimose.estimate: sheltered"),
    compare("compare-unknown-choice-set", "--baselines", "mimose:fancy",
            named="compare mimose:fancy: planner.mimose.choices='fancy'"),
    compare("compare-budget-text", "--budgets", "1MB,lots", named="budget='lots'"),
    compare("compare-budget-twice", "--budgets", "40MB,40MB", named="budget 40MB is given twice"),
    compare("compare-margin-over-a-budget", "--budgets", "1MB", "planner.safety_margin=2MB",
            named="planner.safety_margin='2MB'"),
    compare("compare-max-steps-zero", "training.max_steps=0", named="training.max_steps=0"),
    compare("compare-view-bogus", "--view", "bogus", named="--view 'bogus' is invalid"),
    compare("compare-out-holds-a-compare", "--out", "{tmp}/c", named="'{tmp}/c' already exists and is not empty",
            files={"c/compare.json": "{}"}),
    compare("compare-out-holds-a-run", "--out", "{tmp}/r", named="'{tmp}/r' already exists",
            files={"r/metrics.jsonl": ""}),
    compare("compare-out-is-a-file", "--out", "{tmp}/f", named="'{tmp}/f' is a file", files={"f": "x"}),
    compare("compare-out-a-dangling-link", "--out", "{tmp}/link", named="'{tmp}/link' is a symbolic link to 'nowhere'",
            files={"link": A_DANGLING}),
    compare("compare-out-dir-key-is-a-file", "out_dir={tmp}/f", named="out_dir='{tmp}/f' is a file",
            files={"f": "x"}),
    Case("compare-without-a-budget", ["compare", "{quick}", "budget=null"],
         "compare needs a budget: set `budget` in the recipe or pass --budgets"),
]

CASES = RECIPE_FILES + OVERRIDES + VALUES + OUT_DIRS + MODEL_AND_DEVICE + HF_DATA + REPORTS + COMPARES


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer of a few words, saved as a hub tokenizer is."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat", "a dog ran"], trainers.WordLevelTrainer(
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    special = [(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")]  # as BERT's: [CLS] text [SEP]
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=special)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(path)
    return str(path)


def _write(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        if content is A_DIRECTORY:
            path.mkdir(parents=True)
            continue
        if content is A_FIFO or content is A_LOOP or content is A_DANGLING:
            path.parent.mkdir(parents=True, exist_ok=True)
            target = "nowhere" if content is A_DANGLING else path.name
            os.mkfifo(path) if content is A_FIFO else os.symlink(target, path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def _forbid(monkeypatch, stage: str) -> None:
    """Make the step after ``stage`` fail loudly, so a check that moved later is caught."""
    def reached(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} before the error")
        return fail
    if stage == "check":
        monkeypatch.setattr(mimose_cli.launcher.train, "model_config", reached("made a model config"))
    elif stage == "data":
        monkeypatch.setattr(mimose_cli.launcher.train, "build_trainer", reached("built the model"))


def test_at_least_a_hundred_cases_with_unique_ids():
    ids = [case.id for case in CASES]
    assert len(ids) >= 100 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_mistake_is_one_line_naming_it(case, tmp_path, monkeypatch, tokenizer_dir):
    if case.id == "cuda-without-a-gpu" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    _write(tmp_path, case.files)
    _forbid(monkeypatch, case.stage)
    monkeypatch.chdir(tmp_path)  # a case that ignored --out would write here, not in the checkout
    values = {"{tmp}": str(tmp_path), "{quick}": str(QUICKSTART), "{tok}": tokenizer_dir}

    def fill(text):
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        return text

    if case.datasets_cache is not None:
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", fill(case.datasets_cache))
    result = runner.invoke(app, [fill(arg) for arg in case.args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code == case.code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.rstrip().splitlines()[-1] == errors[0], result.stderr
    assert fill(case.named) in errors[0]


def test_debug_shows_the_traceback(tmp_path):
    result = runner.invoke(app, ["--debug", "train", str(QUICKSTART), "training.lr=.inf"])
    assert result.exit_code != 0 and "training.lr=inf" in str(result.exception)
    assert not isinstance(result.exception, SystemExit)  # raised, with its traceback, not turned into a line
