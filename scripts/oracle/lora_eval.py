"""mlx-lm's loss of an adapter (any engine's) on a jsonl split, with fp32 activations: the other half of
cross-evaluation (`oxlm lora --test` gives oxlm's).

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/lora_eval.py MODEL ADAPTER_DIR FILE.jsonl [BATCH_SIZE]
Prints the mean loss over every batch of FILE (mlx_lm.tuner.trainer.evaluate with num_batches=-1).
"""
import json
import sys
import types

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.trainer import evaluate

model_dir, adapter_dir, data_file = sys.argv[1:4]
batch_size = int(sys.argv[4]) if len(sys.argv) > 4 else 4
model, tok = load(model_dir, adapter_path=adapter_dir)
model.set_dtype(mx.float32)
rows = [json.loads(l) for l in open(data_file)]
data = CacheDataset(create_dataset(rows, tok, types.SimpleNamespace(mask_prompt=False)))
np.random.seed(0)
print(f"{evaluate(model, data, batch_size, -1):.6f}")
