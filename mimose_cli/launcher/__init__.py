"""The launcher: a recipe turned into a run (data, model, planner, loop, checkpoints, resume,
torchrun, the Hugging Face Trainer helper), writing through ``runs`` and planning with the library
(``planners``, ``memory``). Nothing below imports it."""
