"""The input size a planner plans for, read off a batch."""

import math
import operator
from collections.abc import Mapping

import torch

TOKEN_KEYS = ("input_ids", "inputs_embeds", "pixel_values")
DECODER_KEYS = ("decoder_input_ids", "labels")


def size_key(batch) -> str | None:
    """The key of a batch (a mapping) its input size is read from: the tokens when it has them, so
    a two-tower batch (CLIP's ``input_ids`` and ``pixel_values``) is planned by its text, its
    images staying the size the model takes; else the images; None when it has neither."""
    return next((k for k in TOKEN_KEYS if batch.get(k) is not None), None)


def infer_input_size(batch, encoder_decoder: bool = False) -> tuple:
    """The input size a batch is planned for: (B, L) for tokens, (B, H, W) for images, and
    (B, L, D) for an encoder-decoder, D the decoder's length (``decoder_input_ids``, else the
    ``labels`` it is shifted from).

    Leading dimensions are folded into B, so a multiple-choice batch (B, C, L) is (B*C, L):
    that is the batch the encoder blocks actually see.
    """
    key, tensor = "input_ids", batch if isinstance(batch, torch.Tensor) else None
    if isinstance(batch, dict):
        key = size_key(batch)
        tensor = batch.get(key)
    if tensor is None:
        raise ValueError(
            "cannot infer the input size from this batch: pass a tensor or a dict with "
            f"one of {TOKEN_KEYS}, or call planner.step(input_size=(B, L))"
        )
    shape = tuple(tensor.shape)
    if key == "inputs_embeds":
        shape = shape[:-1]  # the hidden dimension is not part of the input size
    if key == "pixel_values":
        return (shape[0],) + shape[-2:]
    if len(shape) == 1:
        return (1, shape[0])
    size = (math.prod(shape[:-1]), shape[-1])
    if encoder_decoder:
        decoder = next((batch[k] for k in DECODER_KEYS if isinstance(batch, dict) and batch.get(k) is not None), None)
        if decoder is None:
            raise ValueError("an encoder-decoder's batch needs decoder_input_ids or labels to size its "
                             "decoder, or call planner.step(input_size=(B, L, D))")
        size += (decoder.shape[-1],)
    return size


def checked_input_size(size, name: str = "max_input_size") -> tuple:
    """``size`` as a tuple of at least two positive ints ((batch, length), (batch, height, width),
    ...), or ValueError in one line naming ``name``: a bare ``128`` says neither the batch nor the
    length."""
    try:
        dims = tuple(operator.index(d) for d in size) if isinstance(size, (tuple, list)) else ()
    except TypeError:
        dims = ()
    if len(dims) < 2 or min(dims) <= 0 or any(isinstance(d, bool) for d in size):
        raise ValueError(f"{name}={size!r} is invalid; expected (batch_size, max_length) as a tuple of "
                         "positive ints, e.g. (8, 128)")
    return dims


def with_padding(batch):
    """``batch`` with its last row's last position masked when it has an attention mask: real
    batches, padded to their longest row, take the models' masked code paths (an attention mask
    of all ones is dropped, and the fused kernel holds less), which hold more memory. What a batch
    made for measuring (``launcher.data.loader.make_batch``, a probe's) is run as. Any mapping
    (a ``BatchEncoding``) comes back a dict; a decoder's mask, which padding collators do not
    make, is left as it is."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or mask.shape[-1] < 2:
        return batch
    mask = mask.clone()
    mask[(-1,) * mask.ndim] = 0
    return {**batch, "attention_mask": mask}


def _rows(value, rows: int):
    """``value``'s first dimension cut or repeated to ``rows`` (a tensor; anything else as it is)."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    return value[torch.arange(rows, device=value.device) % value.shape[0]]


def resized_batch(batch, size: tuple) -> dict:
    """``batch`` cut or repeated, rows then tokens, to the input size ``size``: (B, L), an
    encoder-decoder's (B, L, D) (the decoder's tensors, ``labels`` and ``decoder_*``, take D) or
    an image batch's (B, H, W) (its pixels cut or tiled to H x W). A batch of another size for
    planners that measure ahead, with every key the model takes and valid values."""
    images = size_key(batch) == "pixel_values"
    ids = batch["pixel_values" if images else "input_ids"]
    per_row = 1 if images else max(1, ids[0, ..., 0].numel())  # (B, C, L) multiple choice: B*C = size[0]
    rows = size[0] // per_row
    lengths = {}
    if images and len(size) == 3:
        pixels = _rows(ids, rows)
        for dim, target in ((-2, size[1]), (-1, size[2])):
            pixels = pixels.index_select(dim, torch.arange(target, device=ids.device) % pixels.shape[dim])
        return {key: pixels if key == "pixel_values" else _rows(value, rows) for key, value in batch.items()}
    if not images:
        lengths[False] = (ids.shape[-1], size[1])
        decoder = next((batch[k] for k in DECODER_KEYS if batch.get(k) is not None), None)
        if len(size) == 3 and decoder is not None:
            lengths[True] = (decoder.shape[-1], size[2])

    def resize(key, value):
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        value = _rows(value, rows)
        is_decoder = True in lengths and (key in DECODER_KEYS or key.startswith("decoder_"))
        length, target = lengths.get(is_decoder, (None, None))
        if value.ndim >= 2 and value.shape[-1] == length and not key.startswith("pixel_"):
            value = value[..., torch.arange(target, device=value.device) % length]
        return value

    return {key: resize(key, value) for key, value in batch.items()}
