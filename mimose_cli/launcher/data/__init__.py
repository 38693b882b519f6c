"""Data (the launcher's): synthetic or Hugging Face examples, and the dynamically padded batches built from them.

```python
from mimose_cli.launcher.data.dataset import build_dataset, build_validation
from mimose_cli.launcher.data.loader import build_dataloader

dataset = build_dataset(recipe, config)
loader = build_dataloader(recipe, dataset, config, epoch=0, skip_batches=0)
validation = build_validation(recipe, config)  # None without a validation split
```
"""
