"""The input size a planner plans for, read off a batch."""

import math

import torch

TOKEN_KEYS = ("input_ids", "inputs_embeds", "pixel_values")
DECODER_KEYS = ("decoder_input_ids", "labels")


def infer_input_size(batch, encoder_decoder: bool = False) -> tuple:
    """The input size a batch is planned for: (B, L) for tokens, (B, H, W) for images, and
    (B, L, D) for an encoder-decoder, D the decoder's length (``decoder_input_ids``, else the
    ``labels`` it is shifted from).

    Leading dimensions are folded into B, so a multiple-choice batch (B, C, L) is (B*C, L):
    that is the batch the encoder blocks actually see.
    """
    key, tensor = "input_ids", batch if isinstance(batch, torch.Tensor) else None
    if isinstance(batch, dict):
        key = next((k for k in TOKEN_KEYS if batch.get(k) is not None), None)
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
