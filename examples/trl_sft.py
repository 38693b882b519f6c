"""Fine-tune with TRL's SFTTrainer, its own defaults kept, a peft LoRA adapter, under a budget.

TRL's `SFTConfig` turns on gradient checkpointing (and bf16 on hardware that has it) by default;
`fit_budget` takes that over with one logged line and checkpoints per micro-batch instead. Here a
tiny Llama (built from a config: random weights, nothing downloaded) gets a LoRA adapter from
peft and learns synthetic text whose lengths vary like real documents, with gradient
accumulation, on the CPU, where mimose simulates a device of exactly the budget
(docs/HF_TRAINER.md). The same run without mimose (TRL's own checkpointing of every layer) goes
first, so that the two can be compared: the losses and the trained adapter are the same. Needs
the `[trl]` extra (trl, peft).

    python3 examples/trl_sft.py            # about 13 s on one CPU core, both runs and imports included
"""

import tempfile

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from mimose_cli import fit_budget  # mimose

# Without checkpointing the longest micro-batch peaks at 164 MB, with every block checkpointed at
# 115 MB (TRL's fused LM head and its metrics hold most of that, outside the blocks): at 135 MB
# short batches run plainly and long ones checkpoint just enough blocks to fit.
BUDGET = "135MB"
WORDS = [f"w{i}" for i in range(500)]
MAX_LENGTH = 192


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the synthetic vocabulary, built here (nothing downloaded)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def synthetic_text(n: int, seed: int = 0) -> Dataset:
    """``n`` documents of lognormal length (median ~48 words, a long right tail), each repeating a
    short phrase of its own: text a model can learn to continue."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(48), 0.6, n), 8, MAX_LENGTH - 2).astype(int)
    texts = []
    for length in lengths:
        phrase = list(rng.choice(WORDS, 4))
        texts.append(" ".join((phrase * (length // 4 + 1))[:length]))
    return Dataset.from_dict({"text": texts})


def train(out_dir: str, budget=None) -> tuple:
    """One SFT run (the same seed, data and adapter every time); ``budget``: under fit_budget."""
    torch.set_num_threads(1)  # a model this small gains nothing from a second CPU thread
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LENGTH,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3)
    model = LlamaForCausalLM(config)
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     max_steps=6, learning_rate=1e-3, max_length=MAX_LENGTH, logging_steps=1,
                     save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
                     bf16=False)  # bf16 autocast on this CPU is slow; on a GPU keep TRL's default
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=synthetic_text(96), processing_class=tokenizer(),
                         peft_config=lora)
    checkpointing = args.gradient_checkpointing  # TRL's default: True
    if budget is not None:
        fit_budget(trainer, budget)  # mimose: checkpoint just enough blocks per micro-batch to fit
        checkpointing = f"{checkpointing} -> {trainer.args.gradient_checkpointing}"  # taken over: off
    metrics = trainer.train().metrics
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    adapter = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    return losses, metrics, checkpointing, adapter


def main(out_dir: str) -> None:
    plain, _, _, plain_adapter = train(out_dir)
    losses, metrics, checkpointing, adapter = train(out_dir, BUDGET)
    # The same ops in the same order (recomputing a block reruns its forward exactly), so the
    # trained adapter is the run without mimose's to the bit, and so is every logged loss.
    same = len(adapter) == len(plain_adapter) and all(torch.equal(a, b) for a, b in zip(adapter, plain_adapter))
    print(f"SFTConfig(gradient_checkpointing={checkpointing}); {len(losses)} steps, losses "
          f"{'equal to' if losses == plain else 'DIFFERENT from'} the run without mimose "
          f"({', '.join(f'{loss:.4f}' for loss in losses)}); LoRA weights after training "
          f"{'bit-identical' if same else 'DIFFERENT'}")
    print(f"mimose: {metrics['mimose/micro_batches']} micro-batches, "
          f"{metrics['mimose/checkpointed_micro_batches']} with blocks checkpointed "
          f"({metrics['mimose/measured_micro_batches']} of them while measuring), "
          f"{metrics['mimose/retries']} retries; peak {metrics['mimose/max_peak_bytes'] / 1e6:.1f} MB "
          f"of the {metrics['mimose/budget_bytes'] / 1e6:.1f} MB budget")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        main(out)
